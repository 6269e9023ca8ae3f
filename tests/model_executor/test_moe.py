"""Mixture of experts: the grouped expert computation against a naive per-token loop, and Mixtral / Qwen2-MoE /
Qwen3-MoE greedy token for token against transformers in float32, with and without chunked prefill."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from test_correctness import GREEDY, LOGPROB_ATOL, MAX_TOKENS, check_engine_drained, run
from tiny_models import MOE_ARCHS

from pagedserve.model_executor.layers.fused_moe import fused_experts, select_experts


@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_experts_matches_naive(renormalize):
    gen = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 37, 24, 16, 8, 3
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
    logits = torch.randn(t, e, generator=gen)
    weights, ids = select_experts(logits, k, renormalize)
    probs = logits.softmax(-1)
    ref = torch.zeros_like(x)
    for i in range(t):  # naive: every token, every chosen expert
        top = probs[i].topk(k)
        ws = top.values / top.values.sum() if renormalize else top.values
        for w, j in zip(ws, top.indices):
            g, u = (w13[j] @ x[i]).chunk(2)
            ref[i] += w * (w2[j] @ (F.silu(g) * u))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("config", [dict(num_kv_blocks=512), dict(num_kv_blocks=512, max_num_batched_tokens=32)],
                         ids=["default", "budget-32-chunked"])
def test_moe_greedy_matches_transformers(arch, config, tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=6)
    llm, ours = run(model_dir, prompts, GREEDY, **config)
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
    check_engine_drained(llm)
