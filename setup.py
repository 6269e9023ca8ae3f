"""The native CPU kernels, compiled when the package is built: one extension module per instruction-set level the
engine dispatches between (pagedserve/model_executor/kernels/_cpu_<isa>*.so; all four on x86-64, "generic"
elsewhere), so that one wheel runs on any of those CPUs and the engine picks the best module at run time. Beside
them, prebuilt.json records the torch version they were compiled against and the build key of their sources, which
the loader checks before importing one (kernels/__init__.py; on a mismatch it falls back to its just-in-time build).

Everything else (metadata, dependencies, package data) is in pyproject.toml. Environment:
  MAX_JOBS=N                      compile N sources at once (torch's BuildExtension, with ninja; default: all cores)
  PAGEDSERVE_BUILD_KERNELS=0      build no kernels (a machine without a C++ compiler: the engine then builds them
                                  on first use if it can, else runs its PyTorch path)
  PAGEDSERVE_KERNEL_ISAS=LEVELS   which levels: "all", "host" (the best one this machine runs) or a comma list
                                  (avx512bf16,avx512,avx2,generic). Default: all for a wheel (it runs on any CPU),
                                  host for an editable install (`pip install -e .`: it runs where it was built, and
                                  compiles in a quarter of the time)
  PAGEDSERVE_KERNEL_BUILD_CACHE=DIR  where a level's compiled module is kept for the next build of the same sources,
                                  flags, compiler and torch (default ~/.cache/pagedserve/kernel-builds; 0: off)
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
KERNELS = "pagedserve/model_executor/kernels"
# setuptools compiles with Python's own CFLAGS first (-g -fwrapv ...); these undo the two that matter, so the
# modules are the code the just-in-time build makes: -fwrapv (defined signed overflow) holds back loop
# optimisations, -g makes each module several times larger.
UNDO_PYTHON_CFLAGS = ("-fno-wrapv", "-g0")


def load_build_config():
    """kernels/build_config.py by path: the package itself is not importable before it is built."""
    spec = importlib.util.spec_from_file_location("pagedserve_kernel_build_config", ROOT / KERNELS / "build_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def levels_to_build(config) -> tuple[str, ...]:
    """PAGEDSERVE_KERNEL_ISAS, or its default: every level for a wheel, the host's best for an editable install."""
    available = config.X86_ISAS if platform.machine().lower() in config.X86_MACHINES else ("generic",)
    editable = any(command in sys.argv for command in ("editable_wheel", "develop"))
    choice = os.environ.get("PAGEDSERVE_KERNEL_ISAS", "host" if editable else "all")
    if choice == "all":
        return available
    if choice == "host":
        return (config.runnable_isas(config.read_cpu_flags(), platform.machine())[0],)
    levels = tuple(level.strip() for level in choice.split(",") if level.strip())
    unknown = [level for level in levels if level not in available]
    if not levels or unknown:
        raise SystemExit(f"PAGEDSERVE_KERNEL_ISAS={choice!r}: expected all, host or a comma list of "
                         f"{', '.join(available)}")
    return levels


def kernel_build() -> dict:
    """setup() arguments that build the kernels: none when PAGEDSERVE_BUILD_KERNELS=0."""
    if os.environ.get("PAGEDSERVE_BUILD_KERNELS", "1") == "0":
        return {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    config = load_build_config()
    isas = levels_to_build(config)
    print(f"pagedserve: building the native kernels for {', '.join(isas)}", flush=True)
    cache_dir = config.build_cache_dir(os.environ.get(config.BUILD_CACHE_ENV, ""), os.environ.get("XDG_CACHE_HOME", ""))
    extensions = {
        isa: CppExtension(f"{config.PREBUILT_PACKAGE}.{config.prebuilt_module(isa)}",
                          [f"{KERNELS}/{name}" for name in config.UNITS],
                          extra_compile_args=[*config.build_flags(isa), *UNDO_PYTHON_CFLAGS],
                          extra_link_args=list(config.LDFLAGS))
        for isa in isas
    }

    class BuildKernels(BuildExtension):
        """Each level's objects in their own folder (the levels compile the same sources with other flags), then
        the manifest beside the modules."""

        def build_extension(self, ext):
            isa = next(level for level, e in extensions.items() if e is ext)
            target = Path(self.get_ext_fullpath(ext.name))
            entry = None
            if cache_dir is not None:
                # the compiler that compiles the units, and every flag it gets (setup.py's own included)
                compiler = " ".join([config.compiler_identity(self.compiler.compiler_so[0]), *self.compiler.compiler_so,
                                     *ext.extra_compile_args, *ext.extra_link_args])
                entry = config.build_cache_entry(cache_dir, isa, target.name, torch.__version__, compiler)
                if config.restore_cached_build(entry, target):
                    print(f"pagedserve: the {isa} kernels taken from the build cache ({entry})", flush=True)
                    return
            base, self.build_temp = self.build_temp, os.path.join(self.build_temp, isa)
            t0 = time.perf_counter()
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base
            print(f"pagedserve: the {isa} kernels built in {time.perf_counter() - t0:.0f} s", flush=True)
            if entry is not None:
                config.store_cached_build(entry, target)

        def manifest_path(self) -> str:
            return os.path.join(os.path.dirname(self.get_ext_fullpath(next(iter(extensions.values())).name)),
                                config.MANIFEST)

        def run(self):
            super().run()
            manifest = {"torch": torch.__version__,
                        "modules": {isa: {"module": config.prebuilt_module(isa), "key": config.extension_name(isa)}
                                    for isa in extensions}}
            with open(self.manifest_path(), "w") as f:
                json.dump(manifest, f, indent=1)

        def get_outputs(self):
            return [*super().get_outputs(), self.manifest_path()]

    return {"ext_modules": list(extensions.values()), "cmdclass": {"build_ext": BuildKernels}}


setup(**kernel_build())
