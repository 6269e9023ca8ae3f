"""The contract every attention backend keeps, and the one place the rest of the model side learns about it.

A backend owns the KV cache's layout (it allocates the per-layer K and V tensors), builds its view of a step's
metadata once per forward from the common one (attention/metadata.py: what every layer would otherwise derive
again), writes a step's new K/V into the cache and runs attention over the flattened step (decode rows and prefill
chunks). It also says
what else may run on its device beside it: the fused small ops of a decoder layer (`fused_ops`), the native
whole-stack decode (`supports_fused_decode_stack`) and CUDA graphs (`supports_cuda_graphs`). Adding a backend is
one file here and one line in selector.py.

Every layout keeps the same logical indexing, [num_blocks, block_size, num_kv_heads, head_dim] for K and for V
(strided views where the storage differs), so that code outside the backend (KV transfer, tests) indexes blocks
the same way whatever the layout.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedserve.model_executor.attention.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (K cache, V cache)


class AttentionBackend(ABC):
    name: ClassVar[str]
    # CUDA graphs replay fixed shapes: a backend supports them when its K/V write skips padding rows (slot -1) and
    # its decode reads nothing past a row's context length
    supports_cuda_graphs: ClassVar[bool] = False
    # block tables narrower than this many tokens share one graph (they cost the backend's decode the same)
    cuda_graph_min_width_tokens: ClassVar[int] = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raises ValueError when this backend cannot run on `device` (default: every device)."""

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device) -> list[KVCache]:
        """Per layer (K cache, V cache), each indexed [num_blocks, block_size, num_kv_heads, head_dim]; by default
        two contiguous token-major tensors (a slot's heads adjacent, writable by flat slot)."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """This backend's metadata for one forward, built once from the step's common metadata and read by every
        layer; by default the common metadata itself."""
        return common

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v: [T, KVH, D] (views of the QKV output) stored at slot_mapping ([T] long)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (this step's new tokens, written to the cache first). Returns [T, H, D].
        sliding_window: each query attends only to the last this many positions (its own included).
        logits_soft_cap: scores become cap * tanh(scores / cap) before the softmax (Gemma 2).
        sinks: [H] float32, one learned logit per query head that joins each softmax's denominator and adds no
        value (gpt-oss)."""

    def forward_encoder(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        """An encoder's attention (models/bert.py): each prefill span is a whole prompt whose tokens attend to each
        other both ways, straight from this step's q/k/v ([T, H, D], [T, KVH, D]): an encoder keeps no KV cache
        (its K/V are never read again: no decode, no prefix caching). By default PyTorch's SDPA per span, on any
        device (the Triton prefill kernel is causal only)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for span in meta.prefills:
            sl = slice(span.start, span.start + span.num_tokens)
            out[sl] = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                                                     v[sl].transpose(0, 1), scale=scale,
                                                     enable_gqa=True).transpose(0, 1)
        return out

    def fused_ops(self, x: torch.Tensor) -> ModuleType | None:
        """The decoder layer's small ops that run beside this backend for a tensor like x (a module with rms_norm,
        rotary_inplace and silu_and_mul), or None: the layers run PyTorch's ops."""
        return None

    @property
    def supports_fused_decode_stack(self) -> bool:
        """Whether the native whole-stack decode (kernels/decode_layers.cpp) may run a decode-only step over this
        backend's cache: it reads and writes the cache itself, in the CPU backend's layout."""
        return False
