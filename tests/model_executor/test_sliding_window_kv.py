"""Sliding-window layers keep only their window's KV blocks (core/kv_cache_groups.py, core/kv_cache_manager.py):
the blocks in use for a prompt far longer than the 32-token window, and greedy outputs token for token with
transformers in float32 while blocks are freed behind the window, under chunked prefill, preemption and prefix
caching; every block back in the pool after."""
from __future__ import annotations

import pytest
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from test_correctness import GREEDY, LOGPROB_ATOL, MAX_TOKENS, check_engine_drained

from pagedserve import LLM
from pagedserve.core.kv_cache_manager import cdiv

BS = 16
WINDOW = 32


def _peak_blocks(llm: LLM, prompts: list[list[int]]) -> tuple[int, list[list[int]]]:
    """Serves the prompts step by step: (most blocks in use at once, each request's output token ids)."""
    engine = llm.llm_engine
    pool = engine.kv_cache_manager.block_pool
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    peak, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
        peak = max(peak, pool.num_used_blocks)
    return peak, [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch, num_full, num_sliding", [("gemma3", 1, 2), ("gemma2", 1, 1), ("mistral-sw", 0, 1),
                                                          ("qwen2-sw", 1, 1)])
def test_sliding_layers_blocks_are_freed(arch, num_full, num_sliding, tiny_model_dir, tiny_tokenizer):
    """A 400-token prompt in 32-token chunks: each sliding group holds about a window and a chunk of blocks, the
    full-attention group the whole context; the KV bytes a token takes fall accordingly (Gemma 3's tiny model:
    two sliding layers to one full one, one layer per group)."""
    model_dir = tiny_model_dir(arch)
    prompt = mixed_prompts(tiny_tokenizer, n=1, lengths=(400, 400), seed=5)[0]
    llm = LLM(str(model_dir), num_threads=1, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    runner = llm.llm_engine.runner
    groups = runner.model.kv_cache_groups
    assert [g.sliding_window for g in groups] == [None] * num_full + [WINDOW] * num_sliding
    peak, (out,) = _peak_blocks(llm, [prompt])
    assert_greedy_match([out], hf_greedy(model_dir, [prompt], MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
    context_blocks = cdiv(len(prompt) + MAX_TOKENS, BS)
    window_blocks = cdiv(WINDOW - 1 + 32, BS) + 1  # the window behind a 32-token chunk, the chunk, a partial block
    assert peak <= num_full * context_blocks + num_sliding * window_blocks
    # full attention everywhere: every layer's K/V for the whole context
    num_layers = runner.model.cfg.num_layers
    per_layer_block = runner.kv_bytes_per_block // len({t for _, t in runner.model.layer_kv_slots})
    full_everywhere = context_blocks * num_layers * per_layer_block
    assert peak * runner.kv_bytes_per_block <= full_everywhere * (num_full + num_sliding * window_blocks
                                                                  / context_blocks) / (num_full + num_sliding)
    check_engine_drained(llm)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral-sw", "qwen2-sw"])
def test_preemption_with_sliding_groups_matches_transformers(arch, tiny_model_dir, tiny_tokenizer):
    """Prompts past the window in 32-token chunks through a pool that holds the longest request only: requests
    are preempted (their groups' blocks freed) and recomputed; the second pass hits the prefix cache."""
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=6, lengths=(60, 200), seed=7)
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    llm = LLM(str(model_dir), num_threads=1, dtype="float32", num_kv_blocks=cdiv(longest, BS) + 1,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    hf = hf_greedy(model_dir, prompts, MAX_TOKENS)
    for _ in range(2):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert_greedy_match([o.outputs[0] for o in outs], hf, logprob_atol=LOGPROB_ATOL)
    stats = llm.llm_engine.get_stats().scheduler
    assert stats.num_preemptions > 0
    check_engine_drained(llm)
