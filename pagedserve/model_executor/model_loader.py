"""Building a model on its device: its class (models/registry.py), its weights loaded and processed by their
quantization methods, and the KV cache tensors it attends over (their size per block; their layout is its
attention backend's)."""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagedserve.model_executor.attention.backend import AttentionBackend
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.registry import get_model_class
from pagedserve.model_executor.parallel_state import SINGLE, ParallelState
from pagedserve.model_executor.quantization.base import QuantizationConfig

logger = logging.getLogger("pagedserve")


def load_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype, quant_config: QuantizationConfig,
               attn_backend: AttentionBackend, parallel: ParallelState = SINGLE, pooling: bool = False) -> nn.Module:
    """pooling: the pooling runner's model (models/adapters.py), whatever the checkpoint's architecture."""
    t0 = time.perf_counter()
    model_cls = get_model_class(model_config.architecture, pooling)
    with torch.device(device):
        model = model_cls(model_config, parallel, attn_backend, quant_config)
    model.load_weights(model_config.model_dir)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    model.process_weights_after_loading()
    logger.info("Loaded %s (%s, %.1fM params, %s on %s) in %.1f s", model_config.model_dir,
                model_config.architecture, model_config.num_params / 1e6, str(dtype).removeprefix("torch."),
                device, time.perf_counter() - t0)
    return model


def _kv_tensors(model: nn.Module) -> list[int]:
    """The KV tensors this process's layers use (their positions in their KV cache groups): as many as its layers
    for a model with one group, a hybrid model's group size (core/kv_cache_groups.py: the groups share them)."""
    return sorted({tensor for _, tensor in model.layer_kv_slots})


def kv_bytes_per_block(model: nn.Module, block_size: int, kv_dtype: torch.dtype) -> int:
    """One block in every K and V tensor this process holds: its layers' (shared by a hybrid model's groups), its KV
    heads."""
    return 2 * len(_kv_tensors(model)) * block_size * model.num_local_kv_heads * model.cfg.head_dim \
        * kv_dtype.itemsize


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K cache, V cache), each indexed [num_blocks, block_size, KV heads, head_dim], in the layout of the
    model's attention backend (attention/cpu.py, attention/triton.py, ...); layers at one position of their KV
    cache groups share one tensor."""
    tensors = _kv_tensors(model)
    caches = dict(zip(tensors, model.attn_backend.allocate_kv_cache(
        len(tensors), num_blocks, block_size, model.num_local_kv_heads, model.cfg.head_dim, kv_dtype, device)))
    return [caches[tensor] for _, tensor in model.layer_kv_slots]
