"""KV as virtual memory, part two: prefix caching, shared blocks for n > 1 and beam search, priority."""
from __future__ import annotations

import pytest
import torch
from hf_reference import load_hf_model

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.core.kv_cache_manager import cdiv

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("dtype", "float32")  # compared with HF's float32: not `auto` (bf16 on some CPUs)
    return LLM(str(model_dir), num_threads=1, **kwargs)


def greedy(llm: LLM, prompts, salts=None) -> list[list[int]]:
    inputs = [{"prompt_token_ids": p, "cache_salt": s} for p, s in zip(prompts, salts or [None] * len(prompts))]
    return [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY, use_tqdm=False)]


def assert_drained(llm: LLM) -> None:
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def base(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 700, (n,), generator=g).tolist()


def test_prefix_caching_outputs_identical(model_dir):
    shared = base(100)
    scenarios = [
        [base(40, 2), base(40, 2)],                              # the same prompt twice
        [base(37, 3), base(37, 4)],                              # nothing shared
        shared[:10] + base(20, 5), shared[:10] + base(20, 6),    # partial-block prefix: no hit possible
        [shared + base(7, 7), shared + base(30, 8), shared[:64] + base(3, 9)],  # many shared blocks
    ]
    scenarios[2:4] = [[scenarios[2], scenarios[3]]]
    off = make_llm(model_dir, enable_prefix_caching=False)
    on = make_llm(model_dir)
    chunked = make_llm(model_dir, max_num_batched_tokens=24)  # hits that start and end inside chunks
    for prompts in scenarios:
        expected = greedy(off, prompts)
        # one at a time, so later prompts hit blocks freed by finished requests; then all at once
        assert [greedy(on, [p])[0] for p in prompts] == expected
        assert greedy(on, prompts) == expected
        assert greedy(chunked, prompts) == expected
        assert [greedy(chunked, [p])[0] for p in prompts] == expected
    stats = on.llm_engine.get_stats().scheduler
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    for llm in (off, on, chunked):
        assert_drained(llm)


def test_prefix_hit_after_eviction(model_dir):
    prompt = base(160, 11)  # 10 full blocks
    llm = make_llm(model_dir, num_kv_blocks=24)
    expected = greedy(make_llm(model_dir, enable_prefix_caching=False), [prompt])
    assert greedy(llm, [prompt]) == expected
    kv = llm.llm_engine.kv_cache_manager
    # an unrelated request takes most of the pool: the LRU end of the cached prompt is evicted
    greedy(llm, [base(250, 12)])
    assert kv.block_pool.num_evictions > 0
    hits_before = kv.prefix_cache_hits
    assert greedy(llm, [prompt]) == expected
    assert 0 < kv.prefix_cache_hits - hits_before < 160 - 1, "only the surviving leading blocks should hit"
    assert_drained(llm)


def test_cache_salt_isolates_tenants(model_dir):
    prompt = base(80, 13)
    llm = make_llm(model_dir)
    kv = llm.llm_engine.kv_cache_manager
    first = greedy(llm, [prompt], ["tenant-a"])
    hits = kv.prefix_cache_hits
    assert greedy(llm, [prompt], ["tenant-b"]) == first
    assert kv.prefix_cache_hits == hits, "a different salt must not hit"
    assert greedy(llm, [prompt]) == first
    assert kv.prefix_cache_hits == hits, "no salt must not hit a salted block"
    assert greedy(llm, [prompt], ["tenant-a"]) == first
    assert kv.prefix_cache_hits > hits, "the same salt hits"
    assert llm.reset_prefix_cache()
    hits = kv.prefix_cache_hits
    assert greedy(llm, [prompt], ["tenant-a"]) == first
    assert kv.prefix_cache_hits == hits, "nothing is cached after a reset"


def peak_blocks_during(llm: LLM, fn) -> int:
    engine = llm.llm_engine
    pool = engine.kv_cache_manager.block_pool
    peak = 0
    step = engine.step

    def tracking_step():
        nonlocal peak
        outputs = step()
        peak = max(peak, pool.num_used_blocks)
        return outputs

    engine.step = tracking_step
    try:
        fn()
    finally:
        engine.step = step
    return peak


def test_parallel_sampling_shares_prompt_blocks(model_dir):
    prompt = base(512, 14)
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=32, ignore_eos=True)
    llm = make_llm(model_dir, num_kv_blocks=400)
    out = []
    shared_peak = peak_blocks_during(llm, lambda: out.extend(llm.generate([prompt], params, use_tqdm=False)))
    samples = [c.token_ids for c in out[0].outputs]
    assert len(samples) == 8 and all(len(s) == 32 for s in samples)
    assert len({tuple(s) for s in samples}) > 1, "n samples must differ"
    independent = make_llm(model_dir, num_kv_blocks=400, enable_prefix_caching=False)
    single = SamplingParams(temperature=1.0, seed=7, max_tokens=32, ignore_eos=True)
    indep_peak = peak_blocks_during(independent, lambda: independent.generate([prompt] * 8, single, use_tqdm=False))
    assert indep_peak == 8 * cdiv(512 + 32, 16)
    assert shared_peak <= indep_peak / 4, f"n=8 used {shared_peak} blocks vs {indep_peak} for 8 requests"
    # seed + n is reproducible
    again = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert again == samples
    assert_drained(llm)


def test_beam_search_matches_transformers_and_shares_blocks(model_dir, tiny_tokenizer):
    llm = make_llm(model_dir, num_kv_blocks=400)
    hf = load_hf_model(str(model_dir))
    for length, seed in [(9, 15), (40, 16), (130, 17)]:
        prompt = base(length, seed)
        params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
        result = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), num_beams=4, do_sample=False, max_new_tokens=10,
                              eos_token_id=None, length_penalty=1.0, early_stopping=False)
        assert result.sequences[0].tokens == ref[0].tolist()
    assert_drained(llm)
    prompt = base(512, 18)
    peak = peak_blocks_during(llm, lambda: llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8,
                                                                                         ignore_eos=True)))
    independent = 4 * cdiv(512 + 8, 16)
    assert peak <= independent / 2, f"beam search held {peak} blocks; 4 unshared beams hold {independent}"


def test_priority_preempts_lower_priority(model_dir):
    llm = make_llm(model_dir, num_kv_blocks=cdiv(200 + 40, 16), scheduling_policy="priority")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("low", base(200, 19), params, priority=10)
    for _ in range(3):
        engine.step()
    engine.add_request("high", base(200, 20), params, priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]
    assert engine.get_stats().scheduler.num_preemptions >= 1
    assert_drained(llm)


def test_priority_ignored_by_fcfs_is_an_error(model_dir):
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match="priority"):
        llm.llm_engine.add_request("x", [5, 6, 7], GREEDY, priority=1)
