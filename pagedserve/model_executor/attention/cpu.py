"""The CPU backend: the native kernels (kernels/), with the reference backend's SDPA paths where one does not apply.

KV cache layout: per layer, views of one [num_blocks, 2, num_kv_heads, block_size, head_dim] tensor. A block's K
and V are one contiguous run, which decode attention streams a little faster than two separate tensors, and
head-major inside it, so that each KV head's rows of a block are contiguous for the decode kernel's walk. The
views keep the common [num_blocks, block_size, num_kv_heads, head_dim] indexing (attention/backend.py).

  * K/V write: one native call for K and V, straight from the QKV output (float32 / bfloat16 activations);
  * decodes: a native kernel reads each row's blocks in place through its block table
    (q read in place from the QKV output, the output written in place);
  * prefill chunks: with AVX-512 (head_dim % 16 == 0), one native call per chunk reads the chunk's whole context,
    its own new K/V included, from the cache through its block table (causal with an offset; bfloat16 on AMX tiles
    where the CPU has them); elsewhere the reference SDPA per chunk;
  * an encoder's spans (no KV cache): the same prefill kernel, bidirectional, over the step's own K/V in place.
A sliding-window layer's rows read only their windows (decode rows from each row's window on, a prefill chunk from
its first row's window on: the blocks a sliding group has freed are never read); Gemma 2's logit soft cap and
gpt-oss's sinks are applied inside both kernels.
Any activation dtype the kernels do not read (float16), or a build without the kernels, runs the reference paths.
"""
from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.model_executor.attention.backend import KVCache
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.attention.torch_sdpa import TorchSDPABackend
from pagedserve.model_executor.kernels import cpu_kernels

NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the native kernels read and write (any KV cache dtype)


class CpuAttentionBackend(TorchSDPABackend):
    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.kernels = cpu_kernels()  # None: the build failed or is disabled, every op runs the reference path

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU only, not on {device.type!r}.")

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device) -> list[KVCache]:
        joint = [torch.zeros((num_blocks, 2, num_kv_heads, block_size, head_dim), dtype=dtype, device=device)
                 for _ in range(num_layers)]
        return [(kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)) for kv in joint]

    def _native(self, x: torch.Tensor) -> ModuleType | None:
        return self.kernels if x.dtype in NATIVE_DTYPES else None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        kernels = self._native(k)
        if kernels is None:
            super().write_kv(k, v, k_cache, v_cache, slot_mapping)
        else:
            kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        kernels = self._native(q)
        if kernels is None:
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, sinks)
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        extras = dict(window=sliding_window or 0, soft_cap=logits_soft_cap or 0.0,
                      sinks=None if sinks is None else sinks.float())
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = meta.num_decodes
        if d:
            kernels.paged_decode_attention(q[:d], k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_context_lens, scale, out[:d], **extras)
        native_prefill = kernels.native_prefill(k.shape[2])
        for span in meta.prefills:
            if native_prefill:  # reads the chunk's context (its own K/V included) from the cache in place
                sl = slice(span.start, span.start + span.num_tokens)
                kernels.paged_prefill_attention(q[sl], k_cache, v_cache, span.block_ids,
                                                span.context_len - span.num_tokens, scale, out[sl], span.causal,
                                                **extras)
            else:
                self.prefill(q, k, v, k_cache, v_cache, span, scale, out, sliding_window, logits_soft_cap, sinks)
        return out

    def forward_encoder(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        """The native prefill kernel, bidirectional, one call per span, reading the span's K/V where the QKV
        projection left them: viewed as a paged cache of one-token blocks (block i = the span's token i, any token
        stride) with the table 0, 1, ..., so nothing is copied or written to a cache. Several times faster than an
        SDPA call per span at an encoder's lengths."""
        kernels = self._native(q)
        if kernels is None or not kernels.native_prefill(q.shape[2]):
            return super().forward_encoder(q, k, v, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if not meta.prefills:
            return out
        tokens = torch.arange(max(span.num_tokens for span in meta.prefills), device=q.device)
        for span in meta.prefills:
            sl = slice(span.start, span.start + span.num_tokens)
            kernels.paged_prefill_attention(q[sl], k[sl].unsqueeze(1), v[sl].unsqueeze(1), tokens[:span.num_tokens],
                                            0, scale, out[sl], False)
        return out

    def fused_ops(self, x: torch.Tensor) -> ModuleType | None:
        """The compiled small ops (kernels/layer_ops.cpp) for float32 / bfloat16 on the CPU: at decode batch sizes
        these ops cost more in per-op dispatch than in arithmetic (RMSNorm alone is six ATen ops, and in bfloat16
        PyTorch adds conversions around each)."""
        return self._native(x)

    @property
    def supports_fused_decode_stack(self) -> bool:
        return self.kernels is not None
