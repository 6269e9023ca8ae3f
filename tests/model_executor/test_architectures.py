"""Gemma 2, Gemma 3 and Phi-3 beyond the default configuration (test_correctness.py runs them there, as every arch
in ARCHS), and the long-context RoPE scalings end to end: greedy token for token with transformers in float32.

  * chunked prefill (a 32-token budget) crossing the 32-token window, with prefix-cache hits on a shared 100-token
    prefix, on the native CPU backend (windows and soft caps in its kernels; test_native_attention_extras.py checks
    that no layer falls back) and on the PyTorch reference backend;
  * Gemma 3 from a hub-style (transformers 4) config.json: rope_theta / rope_local_base_freq / rope_scaling and
    sliding_window_pattern instead of layer_types and per-type rope_parameters;
  * Phi-4-mini's partial rotary (half the head rotates) with LongRoPE;
  * yarn (Qwen2) and dynamic NTK (Llama) RoPE, dynamic past max_position_embeddings (max_model_len 4x it).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from test_correctness import (
    GREEDY,
    LOGPROB_ATOL,
    MAX_TOKENS,
    check_engine_drained,
    check_prefix_cache_hits_match_transformers,
    run,
)

from pagedserve import LLM
from pagedserve.model_executor.kernels import cpu_kernels


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_chunked_prefill_and_prefix_cache_hits_match_transformers(arch, backend, tiny_model_dir, tiny_tokenizer):
    check_prefix_cache_hits_match_transformers(tiny_model_dir(arch), tiny_tokenizer, max_num_batched_tokens=32,
                                                attention_backend=backend)


def test_gemma_layers_are_what_the_config_says(tiny_model_dir):
    """Windows, soft caps, scales and RoPE bases reach the layers (a regression here would still be caught by the
    HF comparisons, this says where)."""
    llm = LLM(str(tiny_model_dir("gemma2")), num_threads=1, dtype="float32", num_kv_blocks=16)
    model = llm.llm_engine.runner.model
    attns = [layer.self_attn for layer in model.layers]
    assert [a.sliding_window for a in attns] == [32, None]
    assert all(a.logits_soft_cap == 10.0 and a.scale == 24 ** -0.5 for a in attns)
    assert model.final_logit_soft_cap == 30.0
    ops = cpu_kernels()
    if ops is not None and ops.native_small_gemm(torch.float32):  # the native decode stack runs Gemma's layer
        stack = model.fused_decode
        assert stack.soft_caps == [10.0, 10.0] and len(stack.sandwich_norms) == 4 and stack.activation == 1
    llm = LLM(str(tiny_model_dir("gemma3")), num_threads=1, dtype="float32", num_kv_blocks=16)
    model = llm.llm_engine.runner.model
    assert [layer.self_attn.sliding_window for layer in model.layers] == [32, 32, None]
    assert [layer.layer_type for layer in model.layers] == ["sliding_attention"] * 2 + ["full_attention"]
    assert all(layer.self_attn.logits_soft_cap is None for layer in model.layers)
    local, full = model.rotary.rotaries["sliding_attention"], model.rotary.rotaries["full_attention"]
    assert float(local.sin[1, 0]) == pytest.approx(0.841470985)  # position 1, theta^0: sin(1) in both
    assert float(full.sin[1, 0]) == pytest.approx(0.479425539)  # linear x2: sin(0.5)
    assert float(local.cos[1000, -1]) != pytest.approx(float(full.cos[1000, -1]), abs=1e-3)  # different bases


def test_gemma3_hub_config_layout_matches_transformers(tiny_model_dir, tiny_tokenizer, tmp_path):
    src = tiny_model_dir("gemma3")
    model_dir = tmp_path / "gemma3-hub"
    shutil.copytree(src, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    del cfg["layer_types"]
    full = dict(rope["full_attention"])
    cfg.update(rope_theta=full.pop("rope_theta"), rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
               rope_scaling=full, sliding_window_pattern=3)  # layers sliding, sliding, full as before
    (model_dir / "config.json").write_text(json.dumps(cfg))
    prompts = mixed_prompts(tiny_tokenizer, n=4)
    llm, ours = run(model_dir, prompts, num_kv_blocks=512)
    hf = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert_greedy_match(ours, hf, logprob_atol=LOGPROB_ATOL)
    assert [r.token_ids for r in hf] == [r.token_ids for r in hf_greedy(src, prompts, MAX_TOKENS)]  # same model
    check_engine_drained(llm)


def test_phi4_partial_rotary_matches_transformers(tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir("phi3", partial_rotary_factor=0.5,
                               rope_scaling={"type": "longrope", "attention_factor": 1.2,
                                             "short_factor": [1.0, 1.1, 1.2, 1.3],
                                             "long_factor": [1.5, 2.0, 2.5, 3.0]})
    prompts = mixed_prompts(tiny_tokenizer, n=6)
    llm, ours = run(model_dir, prompts, num_kv_blocks=512, max_num_batched_tokens=32)
    model = llm.llm_engine.runner.model
    assert model.rotary.cos.shape[-1] == 4 and model.fused_decode is None  # 8 of 16 channels rotate
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
    check_engine_drained(llm)


def test_longrope_short_factors_when_max_model_len_fits_the_original_context(tiny_model_dir, tiny_tokenizer):
    """original_max_position_embeddings 512 (attention factor derived from max_position_embeddings / 512): served
    with --max-model-len 512 no sequence passes it, the short factors rotate every token, as in transformers; served
    at the full 1024 the long factors do (vLLM's choice: one rotation for every key a sequence caches)."""
    model_dir = tiny_model_dir("phi3", original_max_position_embeddings=512,
                               rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                             "long_factor": [1.5 + 0.5 * i for i in range(8)]})
    prompts = mixed_prompts(tiny_tokenizer, n=6)
    llm, ours = run(model_dir, prompts, num_kv_blocks=512, max_num_batched_tokens=32, max_model_len=512)
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
    check_engine_drained(llm)
    short = llm.llm_engine.runner.model.rotary.cos
    full = LLM(str(model_dir), num_threads=1, dtype="float32", num_kv_blocks=16).llm_engine.runner.model.rotary.cos
    assert not torch.allclose(short[100], full[100])


def test_yarn_rope_matches_transformers(tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir("qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    prompts = mixed_prompts(tiny_tokenizer, n=6)
    llm, ours = run(model_dir, prompts, num_kv_blocks=512)
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
    check_engine_drained(llm)


def test_dynamic_ntk_rope_past_max_position_embeddings_matches_transformers(tiny_model_dir, tiny_tokenizer):
    """max_position_embeddings 64, factor 4: max_model_len up to 256. transformers rescales the base for each
    forward's length past 64 and keeps the largest it has seen (per model object), so the prompts go in increasing
    length, each longer than the previous one's end, and one at a time (one sequence length per forward)."""
    model_dir = tiny_model_dir("llama", max_position_embeddings=64,
                               rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    prompts = sorted(mixed_prompts(tiny_tokenizer, n=3, lengths=(70, 200), seed=5), key=len)
    assert all(len(a) + MAX_TOKENS < len(b) for a, b in zip(prompts, prompts[1:]))
    hf = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(str(model_dir), num_threads=1, dtype="float32", num_kv_blocks=512, max_model_len=256)
    for prompt, expected in zip(prompts, hf):
        outs = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
        assert_greedy_match([outs[0].outputs[0]], [expected], logprob_atol=LOGPROB_ATOL)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        LLM(str(model_dir), num_threads=1, dtype="float32", num_kv_blocks=16, max_model_len=257)
    check_engine_drained(llm)
