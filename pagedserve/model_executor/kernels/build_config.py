"""What one build of the native CPU kernels is: its sources, its instruction-set level and compiler flags, and the
names its module gets. Shared by the package build (setup.py, which compiles one prebuilt module per level) and the
just-in-time fallback (kernels/__init__.py). Standard library only: setup.py loads this file by path, before
pagedserve or its dependencies are importable.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
# What is compiled: two translation units, each #including a group of the kernel files (a unity build). Every kernel
# file needs ATen's headers, and parsing them was ~8 s of each file's 9-22 s compile on a 2-core AVX2 EPYC: eleven
# files parsed them eleven times per level (four levels in a wheel), two units parse them twice and still keep two
# cores busy. The units' #include lines are the list of kernel files (SOURCES).
UNITS = ("unit_attention.cpp", "unit_gemm.cpp")
HEADERS = ("vec.h", "paged_cache.h", "attention_math.h", "ops.h", "torch_slice.h")


def unit_sources(unit: Path) -> tuple[str, ...]:
    """The kernel files a unit compiles: its `#include "<name>.cpp"` lines, in order."""
    return tuple(re.findall(r'^#include "([\w.]+\.cpp)"', unit.read_text(), flags=re.MULTILINE))


SOURCES = tuple(name for unit in UNITS for name in unit_sources(KERNEL_DIR / unit))

# Instruction-set levels, best first: (name, /proc/cpuinfo flags it needs, compiler flags). Explicit -m flags, never
# -march=native: a build runs on every CPU that has its level's flags, whichever machine compiled it.
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c")
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512bf16": (_AVX512 + ("avx512_bf16", "avx512_vnni"),
                   ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mavx512vnni")),
    "avx512": (_AVX512, ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "generic": ((), ()),
}
X86_ISAS = tuple(ISA_LEVELS)  # every level compiles on x86-64; elsewhere only "generic"
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")
BASE_CFLAGS = ("-O3", "-fopenmp", "-ffast-math")
LDFLAGS = ("-fopenmp",)

# The package build's modules, pagedserve/model_executor/kernels/_cpu_<isa>*.so, and the manifest written beside
# them: the torch version they were compiled against and, per level, the build key (`extension_name`) of the
# sources they were compiled from.
PREBUILT_PACKAGE = "pagedserve.model_executor.kernels"
MANIFEST = "prebuilt.json"


def prebuilt_module(isa: str) -> str:
    return f"_cpu_{isa}"


def build_flags(isa: str) -> list[str]:
    return [*BASE_CFLAGS, *ISA_LEVELS[isa][1]]


def extension_name(isa: str, sources: tuple[Path, ...] | None = None, cflags: list[str] | None = None) -> str:
    """`pagedserve_cpu_<isa>_<hash>`: the hash covers the source and header bytes, the flags and the level."""
    if sources is None:
        sources = tuple(KERNEL_DIR / n for n in UNITS + SOURCES + HEADERS)
    cflags = build_flags(isa) if cflags is None else cflags
    h = hashlib.sha256()
    for path in sources:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(" ".join(cflags).encode() + b"\0" + isa.encode())
    return f"pagedserve_cpu_{isa}_{h.hexdigest()[:16]}"


def read_cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty off Linux/x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable_isas(flags: frozenset[str], machine: str) -> list[str]:
    """The levels a CPU with these flags runs, best first ("generic" always)."""
    x86 = machine.lower() in X86_MACHINES
    return [name for name, (needs, _) in ISA_LEVELS.items()
            if name == "generic" or (x86 and all(f in flags for f in needs))]


# The package build's compile cache. A level's module compiled from the same sources, headers and flags, by the same
# compiler, against the same torch and Python, is the same module, so a second package build (CI on a warm machine,
# a reinstall) copies it from the cache instead of compiling it again (about a minute per level on 2 cores).
BUILD_CACHE_ENV = "PAGEDSERVE_KERNEL_BUILD_CACHE"


def build_cache_dir(setting: str, cache_home: str) -> Path | None:
    """The cache folder from PAGEDSERVE_KERNEL_BUILD_CACHE's value (`setting`: a folder, "0" for none, empty for the
    default) and XDG_CACHE_HOME's (empty: ~/.cache), read by setup.py: the default sits beside pip's and torch's."""
    if setting == "0":
        return None
    if setting:
        return Path(setting)
    return Path(cache_home or Path.home() / ".cache") / "pagedserve" / "kernel-builds"


def compiler_identity(cxx: str) -> str:
    """What `cxx --version` says (version and build of the compiler): part of the cache key."""
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def build_cache_entry(cache_dir: Path, isa: str, module_file: str, torch_version: str, compiler: str) -> Path:
    """Where the module `module_file` (its name carries Python's ABI tag) of this level is cached: the key covers
    the build key (sources, headers, flags, level), torch's version (its headers) and `compiler` (its identity and
    the whole command line the build gives it)."""
    key = hashlib.sha256("\0".join((extension_name(isa), torch_version, compiler)).encode()).hexdigest()[:20]
    return cache_dir / f"{isa}-{key}" / module_file


def restore_cached_build(entry: Path, target: Path) -> bool:
    """Copy a cached module to where the build would have written it; False when there is none."""
    if not entry.is_file():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(entry, target)
    return True


def store_cached_build(entry: Path, built: Path) -> None:
    """Add a module just compiled to the cache: written beside its place, then renamed, so that a build killed
    half-way, or two at once, never leave a partial module where the next build would take it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    partial = entry.with_name(f"{entry.name}.{os.getpid()}.partial")
    shutil.copyfile(built, partial)
    os.replace(partial, entry)
