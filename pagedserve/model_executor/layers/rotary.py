"""Rotary position embedding (Neox style, as HF Llama/Qwen/Mistral/Gemma/Phi-3), with the default, linear, llama3,
yarn, dynamic (NTK) and longrope scalings, each computed as transformers' rope init functions compute it
(modeling_rope_utils.py), and partial rotary (only the first `rotary_dim` channels of a head rotate).

Two scalings depend on the length of the sequence a forward sees in transformers (the largest position + 1):

  * longrope takes its long factors once a sequence is past the pretraining length (original_max_position_embeddings),
    and transformers' Phi-3 generate then recomputes the whole cache with them. A paged cache cannot rotate its
    keys again, so, as vLLM does, the choice is made once for the served length: the long factors when
    max_model_len exceeds original_max_position_embeddings, the short ones otherwise. Greedy equals transformers'
    for every sequence with max_model_len <= original_max_position_embeddings, and past it for sequences longer
    than the threshold (a short one gets the long factors where transformers uses the short ones);
  * dynamic NTK keeps the plain frequencies up to max_position_embeddings and rescales its base past it, for each
    forward's length, without recomputing the cache. Here each token's length is its own request's context in the
    step (a decode row's context, a prefill chunk's end): transformers' for a request decoded alone with its prompt
    in one chunk; a chunked prompt past the threshold rotates each chunk with its own end's base.
"""
from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import nn

from pagedserve.model_executor.attention.metadata import AttentionMetadata

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(dim: int, theta: float, scaling: dict | None,
                  max_position_embeddings: int = 0) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of the `dim` rotated channels, the factor cos and sin are multiplied by); for
    longrope the short factors' (`_longrope` with long=True gives the long ones)."""
    kind = rope_type(scaling)
    inv_freq = _default_inv_freq(dim, theta)
    if kind in ("default", "dynamic"):  # dynamic: the plain frequencies up to max_position_embeddings
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_position_embeddings)
    if kind == "longrope":
        return _longrope(dim, theta, scaling, max_position_embeddings, long=False)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: high frequencies extrapolated, low ones interpolated by `factor`, a linear ramp between the dimensions
    that turn beta_fast and beta_slow times over the original context; cos/sin scaled by the attention factor."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)) \
            if mscale and mscale_all_dim else _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, attention_factor


def _longrope(dim: int, theta: float, scaling: dict, max_position_embeddings: int,
              long: bool) -> tuple[torch.Tensor, float]:
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention_factor


def _cos_sin_cache(inv_freq: torch.Tensor, attention_factor: float, max_position: int):
    # float32 throughout, as transformers computes it, so positions round the same way
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def seq_lens_per_token(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> torch.Tensor:
    """[T] long: each token's request context at the end of this step's part of it (a decode row's context, a
    prefill chunk's context_len): the sequence length transformers' dynamic NTK sees in that forward."""
    lens = torch.zeros(num_tokens, dtype=torch.long, device=device)
    if meta.num_decodes:
        lens[:meta.num_decodes] = meta.decode_context_lens
    for span in meta.prefills:
        lens[span.start:span.start + span.num_tokens] = span.context_len
    return lens


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate halves) of the first `rotary_dim` channels (all by default); cos/sin precomputed
    per position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 rotary_dim: int | None = None, max_position_embeddings: int | None = None,
                 max_model_len: int | None = None) -> None:
        """max_position: the positions to precompute; max_position_embeddings: the config's (yarn's, longrope's
        and dynamic's reference length); max_model_len: the served length (longrope's choice of factors). Both
        max_position by default."""
        super().__init__()
        dim = rotary_dim or head_dim
        self.kind = rope_type(scaling)
        self.max_position_embeddings = max_position_embeddings or max_position
        if self.kind == "longrope" and (max_model_len or max_position) > scaling["original_max_position_embeddings"]:
            inv_freq, attention_factor = _longrope(dim, theta, scaling, self.max_position_embeddings, long=True)
        else:
            inv_freq, attention_factor = rope_inv_freq(dim, theta, scaling, self.max_position_embeddings)
        cos, sin = _cos_sin_cache(inv_freq, attention_factor, max_position)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if self.kind == "dynamic":
            self.dim, self.theta, self.factor = dim, theta, scaling["factor"]

    def cos_sin(self, positions: torch.Tensor,
                meta: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim/2] each; looked up once per step and shared by every layer. `meta` (the step's
        attention metadata) is read by dynamic NTK only."""
        if self.kind != "dynamic" or meta is None:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return self._dynamic_cos_sin(positions, meta)

    def _dynamic_cos_sin(self, positions: torch.Tensor, meta: AttentionMetadata):
        """Dynamic NTK: the plain frequencies for a token of a sequence up to max_position_embeddings long, past it
        the base rescaled for the token's sequence length, in float32 as transformers computes it (its `seq_len` is
        a tensor there)."""
        seq = seq_lens_per_token(meta, positions.shape[0], positions.device)
        long = (seq > self.max_position_embeddings)[:, None]
        mpe, dim = self.max_position_embeddings, self.dim
        base = self.theta * ((self.factor * seq.clamp(min=mpe) / mpe) - (self.factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base[:, None] ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                                         device=positions.device).float() / dim)[None, :])
        freqs = positions[:, None].float() * inv_freq
        short = positions.clamp(max=self.cos.shape[0] - 1)
        cos = torch.where(long, freqs.cos().to(self.cos.dtype), self.cos[short])  # the model dtype, as the cache
        sin = torch.where(long, freqs.sin().to(self.sin.dtype), self.sin[short])
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], ops: ModuleType | None) -> torch.Tensor:
    """x: [T, heads, D]. Returns x rotated (in place by `ops.rotary_inplace`, the attention backend's fused op,
    when there is one); with partial rotary (cos/sin narrower than D / 2) only the first channels rotate, in place
    in x, by PyTorch's ops."""
    cos, sin = cos_sin
    rot = 2 * cos.shape[-1]
    if rot != x.shape[-1]:
        x[..., :rot] = apply_rotary(x[..., :rot], cos_sin, None)
        return x
    if ops is not None:
        ops.rotary_inplace(x, cos, sin)
        return x
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
