"""What one build of the native CPU kernels is: its sources, its instruction-set level and compiler flags, and the
names its module gets. Shared by the package build (setup.py, which compiles one prebuilt module per level) and the
just-in-time fallback (kernels/__init__.py). Standard library only: setup.py loads this file by path, before
pagedserve or its dependencies are importable.
"""
from __future__ import annotations

import hashlib
import re
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
