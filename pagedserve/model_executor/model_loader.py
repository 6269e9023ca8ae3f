"""Building a model on its device: the linear backend it runs, its weights loaded, and the KV cache tensors it
attends over (their size per block and their layout)."""
from __future__ import annotations

import logging
import time

import torch

from pagedserve.model_executor.attention import uses_triton
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.llama import LlamaForCausalLM
from pagedserve.model_executor.parallel_state import SINGLE, ParallelState

logger = logging.getLogger("pagedserve")

# Pre-packed oneDNN beats F.linear (MKL) at every decode batch size >= 4 and in prefill; the native packed small
# GEMM beats oneDNN up to 32 rows and ties it above.
AUTO_CPU_LINEAR_BACKEND = "native"


def pick_linear_backend(requested: str, quantization: str | None, device: torch.device) -> str:
    """The GEMM path of the model's linears for `--linear-backend` and `--quantization` on this device."""
    if quantization == "int8":
        if device.type != "cpu":
            raise ValueError("quantization='int8' is implemented for the CPU only.")
        return "int8"
    if device.type != "cpu":
        return "torch"
    if requested == "auto":
        return AUTO_CPU_LINEAR_BACKEND if torch.backends.mkldnn.is_available() else "torch"
    return requested


def load_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
               linear_backend: str, parallel: ParallelState = SINGLE) -> LlamaForCausalLM:
    t0 = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(model_config, parallel)
    model.load_weights(model_config.model_dir)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    model.set_linear_backend(linear_backend)
    logger.info("Loaded %s (%s, %.1fM params, %s on %s) in %.1f s", model_config.model_dir,
                model_config.architecture, model_config.num_params / 1e6, str(dtype).removeprefix("torch."),
                device, time.perf_counter() - t0)
    return model


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
    """One block in every K and V this process holds: its layers, its KV heads."""
    return 2 * len(model.layers) * block_size * model.num_local_kv_heads * model.cfg.head_dim * kv_dtype.itemsize


def allocate_kv_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K cache, V cache), each indexed [num_blocks, block_size, KV heads, head_dim]. On CPU they are views
    of one [num_blocks, 2, KV heads, block_size, head_dim] tensor: a block's K and V are one contiguous run, which
    decode attention streams slightly faster than two separate tensors, and head-major inside it, so that each KV
    head's rows of a block are contiguous for the decode kernel's walk. The Triton kernels write by flat slot, so
    where they run (GPUs; CPU with PAGEDSERVE_ATTENTION_BACKEND=triton) they stay two contiguous token-major
    tensors."""
    kv_heads, head_dim = model.num_local_kv_heads, model.cfg.head_dim
    if device.type == "cpu" and not uses_triton(device.type):
        joint = [torch.zeros((num_blocks, 2, kv_heads, block_size, head_dim), dtype=kv_dtype, device=device)
                 for _ in model.layers]
        return [(kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)) for kv in joint]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in model.layers]
