"""Every environment variable pagedserve reads, in one place: its name, its default and what it means.

Read lazily, as vLLM's envs.py: `envs.PAGEDSERVE_CPU_KERNELS` looks the variable up each time it is asked (module
`__getattr__`), so a test or a launcher that sets one after this module was imported is still obeyed. Code reads
`envs.NAME`, never os.environ; `ENVIRONMENT_VARIABLES` lists them all (name -> (meaning, parser)).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the types `envs.NAME` has (read through __getattr__ below)
    PAGEDSERVE_CPU_KERNELS: bool
    PAGEDSERVE_CPU_ISA: str
    PAGEDSERVE_KERNEL_BUILD_TIMEOUT: float
    PAGEDSERVE_PREBUILT_KERNELS: bool
    PAGEDSERVE_ATTENTION_BACKEND: str
    PAGEDSERVE_KEEP_FREED_MEMORY: bool
    TRITON_INTERPRET: bool
    GOMP_SPINCOUNT: str | None
    PAGEDSERVE_CPU_OMP_THREADS_BIND: str | None
    PAGEDSERVE_DIST_TIMEOUT_S: float
    PAGEDSERVE_API_KEY: str | None
    PAGEDSERVE_ADMIN_API_KEY: str | None
    OPENAI_API_KEY: str | None
    PAGEDSERVE_KV_TRANSFER_SECRET: str | None
    PAGEDSERVE_FAULT_INJECT_TOKEN: str | None
    PAGEDSERVE_SERVER_DEV_MODE: bool

DEFAULT_GOMP_SPINCOUNT = "10000"


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _flag(name: str, default: bool) -> Callable[[], bool]:
    """"0" turns it off, anything else on; unset: the default."""
    return lambda: os.environ.get(name, "1" if default else "0") != "0"


def _float(name: str, default: float) -> Callable[[], float]:
    return lambda: float(os.environ.get(name, default))


ENVIRONMENT_VARIABLES: dict[str, tuple[str, Callable[[], Any]]] = {
    # ---- native CPU kernels (model_executor/kernels/)
    "PAGEDSERVE_CPU_KERNELS": (
        "1 (default): build or load the native C++ CPU kernels; 0: run every op on its PyTorch path.",
        _flag("PAGEDSERVE_CPU_KERNELS", True)),
    "PAGEDSERVE_CPU_ISA": (
        "Force the kernels' instruction-set build (avx512bf16 | avx512 | avx2 | generic; one this CPU runs); "
        "unset: the best level the CPU supports.",
        lambda: os.environ.get("PAGEDSERVE_CPU_ISA", "").strip().lower()),
    "PAGEDSERVE_KERNEL_BUILD_TIMEOUT": (
        "Seconds to wait for another process's build of the kernels (the build lock) before running without them.",
        _float("PAGEDSERVE_KERNEL_BUILD_TIMEOUT", 300.0)),
    "PAGEDSERVE_PREBUILT_KERNELS": (
        "1 (default): use the kernel module compiled when the package was built, where it matches this CPU, torch "
        "and sources; 0: ignore it and use the just-in-time build (tests of that fallback).",
        _flag("PAGEDSERVE_PREBUILT_KERNELS", True)),
    # ---- model execution
    "PAGEDSERVE_ATTENTION_BACKEND": (
        "What --attention-backend auto stands for (cpu | triton | torch); unset or auto: chosen by device.",
        _str("PAGEDSERVE_ATTENTION_BACKEND", "auto")),
    "PAGEDSERVE_KEEP_FREED_MEMORY": (
        "1 (default): glibc's malloc keeps freed memory for the next step's activations (host_allocator.py); "
        "0: glibc's defaults.",
        _flag("PAGEDSERVE_KEEP_FREED_MEMORY", True)),
    "TRITON_INTERPRET": (
        "Triton's own: 1 runs Triton kernels in its interpreter (on a CPU); the Triton backend then also accepts "
        "bfloat16, which the interpreter emulates.",
        _flag("TRITON_INTERPRET", False)),
    "GOMP_SPINCOUNT": (
        "libgomp's own: how long finished OpenMP threads spin before sleeping. The CLI sets it to "
        f"{DEFAULT_GOMP_SPINCOUNT} unless given (set_openmp_defaults): on cores shared with the event loop or the "
        "detokenizer, libgomp's long default spin made 2-thread steps several times slower, and with free cores "
        "the two are equal. Read when torch loads.",
        _str("GOMP_SPINCOUNT", None)),
    # ---- parallelism (executor/)
    "PAGEDSERVE_CPU_OMP_THREADS_BIND": (
        "Cores per rank when --cpu-bind is not given, as vLLM's VLLM_CPU_OMP_THREADS_BIND: '0-31|32-63'.",
        _str("PAGEDSERVE_CPU_OMP_THREADS_BIND", None)),
    "PAGEDSERVE_DIST_TIMEOUT_S": (
        "Seconds a collective waits for a silent (hung, not dead) peer before it raises; a dead worker is noticed "
        "at once (its sockets close).",
        _float("PAGEDSERVE_DIST_TIMEOUT_S", 300.0)),
    # ---- server and clients
    "PAGEDSERVE_API_KEY": (
        "Default of `pagedserve serve --api-key`: the bearer token every endpoint but /health, /metrics and the "
        "dashboard page requires.",
        _str("PAGEDSERVE_API_KEY", None)),
    "PAGEDSERVE_ADMIN_API_KEY": (
        "Default of `pagedserve serve --admin-api-key`: the key that alone gets the full view of /v1/events "
        "(other clients' token ids).",
        _str("PAGEDSERVE_ADMIN_API_KEY", None)),
    "PAGEDSERVE_SERVER_DEV_MODE": (
        "1: `pagedserve serve` adds the development routes (POST /reset_prefix_cache), as vLLM's "
        "VLLM_SERVER_DEV_MODE; 0 (default): they do not exist (404).",
        _flag("PAGEDSERVE_SERVER_DEV_MODE", False)),
    "OPENAI_API_KEY": (
        "The key `pagedserve bench serve` sends (as vLLM's benchmark client), for a server started with --api-key.",
        _str("OPENAI_API_KEY", None)),
    # ---- KV connector (kv_transfer/)
    "PAGEDSERVE_KV_TRANSFER_SECRET": (
        "A secret the instances sharing a KV store (redis, directory) hold: every stored block carries an HMAC "
        "under it, so whoever can write to the store without it cannot make an instance load a block. Unset: a "
        "plain digest (catches corruption, not forgery).",
        _str("PAGEDSERVE_KV_TRANSFER_SECRET", None)),
    # ---- tests
    "PAGEDSERVE_FAULT_INJECT_TOKEN": (
        "Test hook: a token id; a step that schedules a request whose prompt holds it fails in the model forward "
        "(engine/fault_injection.py). Unset: no hook.",
        _str("PAGEDSERVE_FAULT_INJECT_TOKEN", None)),
}


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return ENVIRONMENT_VARIABLES[name][1]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *ENVIRONMENT_VARIABLES})


def set_openmp_defaults() -> None:
    """GOMP_SPINCOUNT's default (see ENVIRONMENT_VARIABLES) unless the user set it; before torch is imported."""
    os.environ.setdefault("GOMP_SPINCOUNT", DEFAULT_GOMP_SPINCOUNT)
