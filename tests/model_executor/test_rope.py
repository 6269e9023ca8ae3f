"""RoPE scalings against transformers' own rotary modules: the cos/sin each token gets (default, linear, llama3, yarn,
dynamic NTK past max_position_embeddings, LongRoPE's short and long factors), and partial rotary applied to q/k as
Phi-3's apply_rotary_pos_emb does."""
from __future__ import annotations

import pytest
import torch

from pagedserve.model_executor.attention.metadata import AttentionMetadata, PrefillSpan
from pagedserve.model_executor.layers.rotary import RotaryEmbedding, apply_rotary

HEAD_DIM, MPE = 32, 64
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.8,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 4)],
                 "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 4)]},
}


def prefill_meta(length: int) -> AttentionMetadata:
    """One prompt of `length` tokens in one chunk: the sequence length transformers sees."""
    span = PrefillSpan(0, length, length, torch.zeros(1, dtype=torch.long), None)
    return AttentionMetadata(torch.zeros(length, dtype=torch.long), 0, None, None, 16, [span])


def hf_rotary(name: str, partial: float):
    """transformers' rotary module for the scaling (Phi-3's for LongRoPE: its config carries the threshold)."""
    import transformers

    scaling = dict(SCALINGS[name], rope_theta=10000.0) if SCALINGS[name] else {"rope_type": "default",
                                                                                "rope_theta": 10000.0}
    common = dict(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MPE)
    if name == "longrope" or partial != 1.0:
        config = transformers.Phi3Config(**common, partial_rotary_factor=partial, pad_token_id=0, eos_token_id=1,
                                         original_max_position_embeddings=16, rope_parameters=scaling)
        return transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    config = transformers.LlamaConfig(**common, rope_parameters=scaling)
    return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("length", [10, 16, 17, 40, 150])  # around LongRoPE's 16, past dynamic's 64
def test_cos_sin_match_transformers(name, length):
    partial = 0.5 if name == "longrope" else 1.0
    dim = int(HEAD_DIM * partial)
    # LongRoPE's factors follow the served length: a max_model_len within 16 keeps every sequence short
    max_model_len = 16 if name == "longrope" and length <= 16 else 256
    ours = RotaryEmbedding(HEAD_DIM, 256, 10000.0, SCALINGS[name], rotary_dim=dim, max_position_embeddings=MPE,
                           max_model_len=max_model_len)
    positions = torch.arange(length)
    cos, sin = ours.cos_sin(positions, prefill_meta(length))
    hf_cos, hf_sin = hf_rotary(name, partial)(torch.zeros(1, dtype=torch.float32), positions[None])
    assert cos.shape == (length, 1, dim // 2)
    torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :dim // 2], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :dim // 2], atol=2e-6, rtol=1e-5)


def test_dynamic_ntk_follows_each_rows_sequence():
    """A decode row of a sequence past max_position_embeddings (64) and a short prompt's chunk in one step: the
    row's base is rescaled for its length, the chunk keeps the plain frequencies."""
    rotary = RotaryEmbedding(HEAD_DIM, 256, 10000.0, SCALINGS["dynamic"], max_position_embeddings=MPE)
    span = PrefillSpan(1, 8, 8, torch.zeros(1, dtype=torch.long), None)
    meta = AttentionMetadata(torch.zeros(9, dtype=torch.long), 1, torch.zeros(1, 2, dtype=torch.long),
                             torch.tensor([100]), 16, [span])
    positions = torch.cat((torch.tensor([99]), torch.arange(8)))
    cos, _ = rotary.cos_sin(positions, meta)
    torch.testing.assert_close(cos[1:], rotary.cos[:8].unsqueeze(1))
    alone, _ = rotary.cos_sin(torch.arange(100), prefill_meta(100))
    torch.testing.assert_close(cos[0], alone[99])  # as the sequence's own 100-token forward rotates it
    assert not torch.allclose(cos[0], rotary.cos[99][None])


def test_partial_rotary_matches_phi3():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None, rotary_dim=HEAD_DIM * 3 // 4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 6, HEAD_DIM, generator=gen)  # [T, heads, D]
    positions = torch.arange(12)
    ours = apply_rotary(x.clone(), rotary.cos_sin(positions), None)
    cos, sin = rotary.cos_sin(positions)
    hf_cos, hf_sin = torch.cat((cos, cos), -1).transpose(0, 1), torch.cat((sin, sin), -1).transpose(0, 1)
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(ours, hf[0].transpose(0, 1))
    torch.testing.assert_close(ours[..., HEAD_DIM * 3 // 4:], x[..., HEAD_DIM * 3 // 4:])  # the rest passes
