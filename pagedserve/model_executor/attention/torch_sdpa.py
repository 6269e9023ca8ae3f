"""The reference backend: plain PyTorch, no native kernel, on any device. Token-major cache (the default layout).

  * K/V write: an indexed store at (block, offset) of each slot;
  * decodes: one batched SDPA over the blocks gathered through the padded block table, masked past each row's
    context length;
  * prefill chunks: one SDPA per chunk: a chunk with no earlier context attends to its own new K/V (causal, or
    bidirectional for an encoder's span: PrefillSpan.causal False), a later chunk gathers its context through its
    block table (causal with an offset).

A sliding-window layer (`sliding_window`: each query attends to the last `sliding_window` positions, its own
included, as Hugging Face's sliding masks do) gathers only the blocks its window reaches (a decode row's last
ceil(window / block_size) + 1, a chunk's from its first query's window on) and adds the window's lower bound to the
masks: a long context's windowed layer reads about a window of K/V, not the whole context.
A soft-capped layer (Gemma 2's `attn_logit_softcapping`: scores -> cap * tanh(scores / cap)) cannot go through
SDPA, which has no hook between the scores and the softmax: it runs the same masks through explicit matmuls, and
so does a layer with attention sinks (gpt-oss: `sinks`, one learned logit per head that joins each softmax's
denominator and adds no value).

The tests compare the other backends with this one, and the engine's greedy outputs on it with Hugging Face's.
The CPU backend (cpu.py) runs these same paths wherever its kernels do not apply.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch
import torch.nn.functional as F

from pagedserve.model_executor.attention.backend import AttentionBackend
from pagedserve.model_executor.attention.metadata import AttentionMetadata, PrefillSpan, sliding_causal_mask


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool, True = attend: built on the first layer's decode, read
        by every other layer's."""
        width = self.decode_block_tables.shape[1] * self.block_size
        positions = torch.arange(width, device=self.decode_context_lens.device)
        return (positions[None, :] < self.decode_context_lens[:, None])[:, None, None, :]

    def sliding_decode_view(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables [num_decodes, n], mask [num_decodes, 1, 1, n * block_size]) of the n blocks that hold each
        row's last `window` positions (its own included): the same n blocks per row (from the one the window starts
        in, moved back where the table ends sooner), so one gather serves every row, on the device (no sync).
        Built on the first windowed layer's decode, read by the others."""
        views = self.__dict__.setdefault("_sliding_decode_views", {})
        if window not in views:
            bs, tables, lens = self.block_size, self.decode_block_tables, self.decode_context_lens
            n = min(tables.shape[1], -(-window // bs) + 1)
            first = ((lens - window).clamp(min=0) // bs).clamp(max=tables.shape[1] - n)
            idx = first[:, None] + torch.arange(n, device=lens.device)[None, :]
            positions = (first * bs)[:, None] + torch.arange(n * bs, device=lens.device)[None, :]
            mask = (positions < lens[:, None]) & (positions >= lens[:, None] - window)
            views[window] = tables.gather(1, idx), mask[:, None, None, :]
        return views[window]

    @classmethod
    def from_common(cls, common: AttentionMetadata) -> TorchSDPAMetadata:
        if isinstance(common, cls):
            return common
        return cls(**{f.name: getattr(common, f.name) for f in fields(AttentionMetadata)})


class TorchSDPABackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, common: AttentionMetadata) -> TorchSDPAMetadata:
        return TorchSDPAMetadata.from_common(common)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # (block, offset) pairs, not flat slots: a cache may be a strided view (the CPU layout), not viewable flat
        block_size = k_cache.shape[1]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        k_cache[blocks, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, offsets] = v.to(v_cache.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, sinks)

    @classmethod
    def attend(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None = None, logits_soft_cap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over a cache the step's K/V are already written to (any backend's layout, any backend's
        metadata: another backend's is viewed as this one's); sinks: [H] per-head sink logits."""
        meta = TorchSDPAMetadata.from_common(meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            cls.decode(q, k_cache, v_cache, meta, scale, out, sliding_window, logits_soft_cap, sinks)
        for span in meta.prefills:
            cls.prefill(q, k, v, k_cache, v_cache, span, scale, out, sliding_window, logits_soft_cap, sinks)
        return out

    @staticmethod
    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchSDPAMetadata, scale: float,
               out: torch.Tensor, sliding_window: int | None = None, logits_soft_cap: float | None = None,
               sinks: torch.Tensor | None = None) -> None:
        """The decode rows (the first meta.num_decodes of q) into out."""
        d = meta.num_decodes
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        if sliding_window is None:
            bt, mask = meta.decode_block_tables, meta.decode_mask
        else:
            bt, mask = meta.sliding_decode_view(sliding_window)
        keys = k_cache[bt].reshape(d, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        values = v_cache[bt].reshape(d, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        o = _sdpa(q[:d].unsqueeze(2), keys, values, mask, scale, logits_soft_cap, sinks=sinks)
        out[:d] = o.squeeze(2)

    @staticmethod
    def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                span: PrefillSpan, scale: float, out: torch.Tensor, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        """One prefill chunk's rows into out."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        sl = slice(span.start, span.start + span.num_tokens)
        qs = q[sl].transpose(0, 1).unsqueeze(0)
        mask = span.causal_mask
        start = 0  # the first cached position read: a window's first block
        if sliding_window is not None and span.context_len > sliding_window:
            first = span.context_len - span.num_tokens
            mask = sliding_causal_mask(first, span.context_len, sliding_window, q.device)
            if span.causal_mask is None:  # the chunk's own K/V are its whole context: same key range
                mask = mask[:, -span.num_tokens:]
            else:  # from the block where the chunk's first query's window starts
                start = max(0, first - sliding_window + 1) // block_size * block_size
                mask = mask[:, start:]
        if span.causal_mask is None:  # the chunk is the whole context so far
            keys, values = k[sl], v[sl]
        else:
            blocks, end = span.block_ids[start // block_size:], span.context_len - start
            keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:end].to(q.dtype)
            values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:end].to(q.dtype)
        o = _sdpa(qs, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), mask, scale,
                  logits_soft_cap, span.causal, sinks)
        out[sl] = o.squeeze(0).transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          logits_soft_cap: float | None, causal: bool = True, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D]; mask: bool, True = attend (None: causal, Lq == Lk, or with causal False
    every key). PyTorch's SDPA, or with a soft cap or sinks the same attention as explicit matmuls (Hugging Face's
    eager order: scale, cap, mask, the sink column, float32 softmax, the sink's probability dropped)."""
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and causal,
                                              scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        mask = mask.tril() if causal else mask
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return probs.to(q.dtype) @ v
