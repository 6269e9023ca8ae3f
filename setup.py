"""The native CPU kernels, compiled when the package is built: one extension module per instruction-set level the
engine dispatches between (pagedserve/model_executor/kernels/_cpu_<isa>*.so; all four on x86-64, "generic"
elsewhere), so that one wheel runs on any of those CPUs and the engine picks the best module at run time. Beside
them, prebuilt.json records the torch version they were compiled against and the build key of their sources, which
the loader checks before importing one (kernels/__init__.py; on a mismatch it falls back to its just-in-time build).

Everything else (metadata, dependencies, package data) is in pyproject.toml. Environment:
  MAX_JOBS=N                      compile N sources at once (torch's BuildExtension, with ninja; default: all cores)
  PAGEDSERVE_BUILD_KERNELS=0      build no kernels (a machine without a C++ compiler: the engine then builds them
                                  on first use if it can, else runs its PyTorch path)
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
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


def kernel_build() -> dict:
    """setup() arguments that build the kernels: none when PAGEDSERVE_BUILD_KERNELS=0."""
    if os.environ.get("PAGEDSERVE_BUILD_KERNELS", "1") == "0":
        return {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    config = load_build_config()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    isas = config.X86_ISAS if x86 else ("generic",)
    extensions = {
        isa: CppExtension(f"{config.PREBUILT_PACKAGE}.{config.prebuilt_module(isa)}",
                          [f"{KERNELS}/{name}" for name in config.SOURCES],
                          extra_compile_args=[*config.build_flags(isa), *UNDO_PYTHON_CFLAGS],
                          extra_link_args=list(config.LDFLAGS))
        for isa in isas
    }

    class BuildKernels(BuildExtension):
        """Each level's objects in their own folder (the levels compile the same sources with other flags), then
        the manifest beside the modules."""

        def build_extension(self, ext):
            isa = next(level for level, e in extensions.items() if e is ext)
            base, self.build_temp = self.build_temp, os.path.join(self.build_temp, isa)
            t0 = time.perf_counter()
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base
            print(f"pagedserve: the {isa} kernels built in {time.perf_counter() - t0:.0f} s", flush=True)

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
