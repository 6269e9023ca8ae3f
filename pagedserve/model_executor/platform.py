"""The platform the model runs on: which device and dtype, how many threads, how much memory is free. Nothing else
in the package asks torch which device it has or reads /proc for memory."""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("pagedserve")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def torch_dtype(name: str) -> torch.dtype:
    """A resolved dtype name from the config ("float32" | "bfloat16" | "float16") as a torch dtype."""
    return _DTYPES[name]


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The model dtype for `--dtype` ("auto" or a name). "auto" is bfloat16 on GPUs and on CPUs with AMX-BF16 or
    AVX512-BF16 (as vLLM's CPU backend picks: bfloat16 GEMMs and the native bfloat16 ops run there at ~2x the
    float32 speed), float32 on other CPUs (bfloat16 arithmetic is emulated there). Logs which and why."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        logger.info("dtype auto: bfloat16 (CUDA device).")
        return torch.bfloat16
    if device.type == "cpu":
        from pagedserve.model_executor.kernels import cpu_flags, has_bf16_compute

        if has_bf16_compute():
            units = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
                     if flag in cpu_flags()]
            logger.info("dtype auto: bfloat16 (this CPU has %s; pass --dtype float32 for float32).",
                        " and ".join(units))
            return torch.bfloat16
        logger.info("dtype auto: float32 (this CPU has neither AMX-BF16 nor AVX512-BF16, so bfloat16 would be "
                    "emulated; pass --dtype bfloat16 to force it).")
    return torch.float32


def configure_threads(num_threads: int | None) -> None:
    """Intra-op threads = cores by default; one pool, no oversubscription."""
    torch.set_num_threads(num_threads or os.cpu_count() or 1)


def leaves_a_core_free(device: torch.device) -> bool:
    """Whether the forward leaves a CPU core for other work (structured output's mask worker): it runs on an
    accelerator, or on fewer torch threads than this process has cores."""
    return device.type != "cpu" or torch.get_num_threads() < len(os.sched_getaffinity(0))


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024
