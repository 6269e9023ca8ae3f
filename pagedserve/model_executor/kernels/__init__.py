"""Native CPU kernels (paged decode and prefill attention, KV writes, fused per-layer small ops, small-M GEMM).

Prebuilt or just in time. The package build (setup.py) compiles one module per instruction-set level,
`_cpu_<isa>`, and writes a manifest beside them (prebuilt.json: the torch version they were compiled against and
the build key of their sources). The loader imports the module for this CPU's level when the manifest matches the
running torch and the sources in the tree. Otherwise (an unusual platform, a package built without kernels,
another torch, kernel sources edited since an editable install, PAGEDSERVE_PREBUILT_KERNELS=0) it compiles them
with the local C++ compiler (torch.utils.cpp_extension) the first time they are needed on a CPU and caches that
build. The log says which path it took.

Instruction sets. Each build is of one instruction-set level, picked at run time from what this CPU has
(`detect_isa`): "avx512bf16" (AVX-512 F/BW/VL/DQ + AVX512-BF16: Zen 4, Cooper Lake, Sapphire Rapids
and later), "avx512", "avx2" (AVX2 + FMA + F16C) or "generic" (the compiler's baseline). Each level is its
own extension with explicit `-m` flags (never `-march=native`), and its name carries the level and a hash of
the sources and flags, so a build made on one CPU is never loaded on a CPU that lacks its instructions, and a
changed source or flag never loads a stale build. PAGEDSERVE_CPU_ISA=avx2 (or any level the CPU has) forces a
lower level, e.g. to test the AVX2 code on an AVX-512 machine.

Build cache and locks (the just-in-time build). Builds live in torch's extension directory (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions/...), one folder per extension name. A process that builds or loads holds an
flock on `pagedserve.lock` in that folder (its pid and host written inside, for messages): the kernel releases it
when the process dies, so a killed build never leaves it held; torch's own `lock` file found there while we hold
ours is stale (left by a killed build: torch would wait on it forever) and is removed. A lock held by a live
process is waited for at most PAGEDSERVE_KERNEL_BUILD_TIMEOUT seconds (default 300); after that the engine runs on
the PyTorch path with a warning instead of hanging.

`load_cpu_kernels()` loads (or builds) the kernels (call it at engine start-up, before serving); `cpu_kernels()`
is the cached accessor the layers use. If compiling fails (no compiler, no ninja), both return None and
callers fall back to the pure PyTorch path; PAGEDSERVE_CPU_KERNELS=0 forces that path.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import platform
import socket
import threading
import time
from pathlib import Path

from pagedserve import envs
from pagedserve.model_executor.kernels.build_config import (HEADERS, ISA_LEVELS, KERNEL_DIR, LDFLAGS,  # noqa: F401
                                                            MANIFEST, PREBUILT_PACKAGE, SOURCES, UNITS,
                                                            build_flags, extension_name, prebuilt_module,
                                                            read_cpu_flags, runnable_isas)

logger = logging.getLogger("pagedserve")
LOCK_NAME = "pagedserve.lock"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty off Linux/x86)."""
    return read_cpu_flags()


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The levels this CPU can run, best first ("generic" always)."""
    return runnable_isas(cpu_flags() if flags is None else flags, platform.machine())


def detect_isa() -> str:
    """The level to build for: PAGEDSERVE_CPU_ISA if set (must be one this CPU runs), else the best one."""
    supported = supported_isas()
    forced = envs.PAGEDSERVE_CPU_ISA
    if forced:
        if forced not in ISA_LEVELS:
            raise ValueError(f"PAGEDSERVE_CPU_ISA={forced!r}: expected one of {', '.join(ISA_LEVELS)}")
        if forced not in supported:
            raise ValueError(f"PAGEDSERVE_CPU_ISA={forced!r}: this CPU supports only {', '.join(supported)}")
        return forced
    return supported[0]


def has_bf16_compute() -> bool:
    """True on CPUs with AMX-BF16 or AVX512-BF16 (where bfloat16 GEMMs and small ops beat float32)."""
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


# ---------------------------------------------------------------------------------------------- build lock
def acquire_build_lock(build_dir: Path, timeout_s: float, poll_s: float = 0.2) -> int | None:
    """Lock `build_dir/pagedserve.lock` (an flock: the kernel drops it when its holder dies, so a killed build can
    never leave it held). A live holder is waited for at most `timeout_s` seconds (None then). Returns the file
    descriptor to pass to `release_build_lock`. While we hold it, a torch `lock` file in the directory is stale
    (every build runs under our lock): it is removed, or torch would wait on it forever."""
    import fcntl

    path = build_dir / LOCK_NAME
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    deadline = time.monotonic() + timeout_s
    warned = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            if not warned:
                try:
                    holder = path.read_text().strip() or "?"
                except OSError:
                    holder = "?"
                logger.warning("Waiting (at most %.0f s) for another process (pid, host: %s) building the native "
                               "kernels in %s.", timeout_s, holder, build_dir)
                warned = True
            time.sleep(poll_s)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    torch_lock = build_dir / "lock"
    if torch_lock.exists():
        logger.warning("Removing a stale torch extension lock %s (left by a killed build).", torch_lock)
        try:
            torch_lock.unlink()
        except FileNotFoundError:
            pass
    return fd


def release_build_lock(fd: int) -> None:
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def build_extension(name: str, sources: list[Path], cflags: list[str], timeout_s: float | None = None):
    """Build (or load the cached build of) one extension under the lock; None when it cannot be had."""
    from torch.utils.cpp_extension import load

    if timeout_s is None:
        timeout_s = envs.PAGEDSERVE_KERNEL_BUILD_TIMEOUT
    build_dir = _build_directory(name)
    lock = acquire_build_lock(build_dir, timeout_s)
    if lock is None:
        logger.warning("Native CPU kernels: another live process has held the build lock %s for over %.0f s; "
                       "using the PyTorch path.", build_dir / LOCK_NAME, timeout_s)
        return None
    try:
        t0 = time.perf_counter()
        library = next(iter(sorted(build_dir.glob(f"{name}*.so"))), None)
        if library is not None:
            # The name carries a hash of the sources and flags, so a finished build is these sources: import it
            # as it is. (torch's load() would rerun ninja, which rebuilds whenever the same sources sit at another
            # path, e.g. two checkouts of the repository sharing the cache.)
            module = _import_library(name, library)
        else:
            logger.warning("Building native kernels %s (first start on this CPU, ~1 min)...", name)
            module = load(name=name, sources=[str(s) for s in sources], extra_cflags=list(cflags),
                          extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), verbose=False)
        logger.info("Native CPU kernels %s %s in %.1f s.", name, "loaded" if library else "built",
                    time.perf_counter() - t0)
        return module
    finally:
        release_build_lock(lock)


def _import_library(name: str, library: Path):
    import importlib.util

    import torch  # noqa: F401  (the extension links against libtorch: load it first)

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- prebuilt modules
def read_manifest() -> dict | None:
    """What the package build wrote beside its modules (setup.py): {"torch": version, "modules": {isa: {"module":
    name, "key": extension_name}}}; None when the package was built without them (or not built: a bare checkout)."""
    try:
        return json.loads((KERNEL_DIR / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def prebuilt_unusable(isa: str, manifest: dict | None, torch_version: str) -> str | None:
    """Why the package's prebuilt module for `isa` must not be loaded, or None when it may: one compiled against
    another torch could crash inside libtorch (its C++ ABI is only stable within a release), and one compiled from
    other sources (an editable install whose kernels were edited since) is not the code in the tree."""
    entry = (manifest or {}).get("modules", {}).get(isa)
    if entry is None:
        return "none was built with the package"
    if manifest.get("torch") != torch_version:
        return f"it was built against torch {manifest.get('torch')}, this is torch {torch_version}"
    if entry.get("key") != extension_name(isa):
        return "the kernel sources changed since the package was built (rerun `pip install -e .`)"
    return None


def load_prebuilt(isa: str):
    """The package's prebuilt module for `isa`, or None (with the reason logged) when there is none it may use."""
    import importlib

    import torch

    manifest = read_manifest()
    if not envs.PAGEDSERVE_PREBUILT_KERNELS:
        reason = "PAGEDSERVE_PREBUILT_KERNELS=0"
    else:
        reason = prebuilt_unusable(isa, manifest, torch.__version__)
    if reason is None:
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(f"{PREBUILT_PACKAGE}.{prebuilt_module(isa)}")
        except ImportError as exc:  # a damaged install, a missing system library
            reason = f"{type(exc).__name__}: {exc}"
            unexpected = True
        else:
            logger.info("Native CPU kernels: the prebuilt %s module loaded in %.2f s (%s).", isa,
                        time.perf_counter() - t0, module.__file__)
            return module
    else:
        # a package built against another torch deserves a warning; a checkout without prebuilt modules, or whose
        # kernels are being edited, does not
        unexpected = manifest is not None and manifest.get("torch") != torch.__version__
    logger.log(logging.WARNING if unexpected else logging.INFO,
               "Native CPU kernels: no prebuilt %s module used (%s); using the just-in-time build.", isa, reason)
    return None


_lock = threading.Lock()
_loaded: dict[str, object] = {}
_UNSET = object()
_default = _UNSET  # what cpu_kernels() returns, once known


def load_cpu_kernels(isa: str | None = None):
    """The native kernels for `isa` (default: `detect_isa()`): the package's prebuilt module where it may be used,
    else the just-in-time build (built or loaded from the cache); None when they are disabled
    (PAGEDSERVE_CPU_KERNELS=0) or cannot be had. Cached per level; call it at engine start-up so the first request
    does not wait for a compiler."""
    global _default
    if not envs.PAGEDSERVE_CPU_KERNELS:
        return None
    with _lock:
        default = isa is None
        try:
            isa = isa or detect_isa()
            if isa not in supported_isas():  # never load code this CPU cannot run
                raise ValueError(f"this CPU cannot run the {isa!r} build (it supports {', '.join(supported_isas())})")
        except ValueError as exc:
            logger.warning("Native CPU kernels: %s; using the PyTorch path.", exc)
            if default:
                _default = None
            return None
        if isa not in _loaded:
            module = load_prebuilt(isa)
            if module is None:
                try:
                    sources = [KERNEL_DIR / n for n in UNITS]
                    module = build_extension(extension_name(isa), sources, build_flags(isa))
                except Exception as exc:  # no compiler / ninja: the torch path still works
                    logger.warning("Native CPU kernels unavailable (%s: %s); using the PyTorch path.",
                                   type(exc).__name__, exc)
            _loaded[isa] = module
        if default:
            _default = _loaded[isa]
        return _loaded[isa]


def cpu_kernels():
    """The compiled module for this CPU (built or loaded on the first call, then cached), or None."""
    if _default is _UNSET:
        return load_cpu_kernels()
    return _default
