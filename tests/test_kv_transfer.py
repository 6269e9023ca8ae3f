"""KV beyond one engine: the second tier in host memory, a Redis server and a directory shared by instances.

Every output is compared token for token with an engine without a connector (float32, tiny random model)."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 24)
    return LLM(str(model_dir), num_threads=1, dtype="float32", block_size=BLOCK, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy outputs, and the prompt tokens the engine computed (loaded and cached ones are not computed)."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{id(p)}-{i}", p, GREEDY)
    outputs, computed = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        computed += engine.last_iteration.num_prompt_tokens
    return [outputs[f"r{id(p)}-{i}"] for i, p in enumerate(prompts)], computed


def assert_drained(llm: LLM) -> None:
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def test_second_tier_serves_evicted_prefix(model_dir):
    prompt, other = tokens(160, 1), tokens(376, 2)  # 10 full blocks; the other needs all 24 blocks of the pool
    plain = make_llm(model_dir)
    tiered = make_llm(model_dir, kv_offloading_size=1 / 1024)  # 1 MiB host tier
    expected = [generate(plain, [p])[0][0] for p in (prompt, other, prompt)]
    connector = tiered.llm_engine.kv_connector
    first, computed_first = generate(tiered, [prompt])
    assert first == [expected[0]] and computed_first == 160
    assert generate(tiered, [other])[0] == [expected[1]]  # evicts the prompt's blocks into the tier
    assert tiered.llm_engine.kv_cache_manager.block_pool.num_evictions >= 10
    assert len(connector.store) >= 10
    again, computed_again = generate(tiered, [prompt])
    assert again == [expected[2]]
    # all 9 full blocks before the last token were loaded from the tier: none survived in the pool
    assert computed_again == 160 - 9 * BLOCK
    assert connector.stats.num_loaded_blocks == 9
    assert_drained(tiered)
