"""Benchmark workloads: lengths, shared prefixes, distinct prompts, seeding, ShareGPT parsing."""
import argparse
import json

import numpy as np
import pytest

from pagedserve.benchmarks import datasets as ds

SPACE = ds.TokenSpace(1000, frozenset({0, 1, 2}))


def test_random_lengths_prefix_and_distinct_prompts():
    reqs = ds.sample_random(SPACE, 200, input_len=100, output_len=50, range_ratio=0.5, prefix_len=16, seed=0)
    assert len(reqs) == 200
    for r in reqs:
        assert 16 + 50 <= r.prompt_len <= 16 + 150
        assert 25 <= r.expected_output_len <= 75
        assert r.prompt_len == len(r.prompt)
        assert all(3 <= t < 1000 for t in r.prompt)  # special ids never used
    assert len({tuple(r.prompt[:16]) for r in reqs}) == 1  # the shared prefix
    assert len({tuple(r.prompt[16:]) for r in reqs}) == 200  # the rest differs per request (seed 004)
    lens = [r.prompt_len - 16 for r in reqs]
    assert min(lens) < 70 and max(lens) > 130  # really spread over the range


def test_random_fixed_length_and_seed():
    a = ds.sample_random(SPACE, 10, 32, 8, seed=3)
    b = ds.sample_random(SPACE, 10, 32, 8, seed=3)
    c = ds.sample_random(SPACE, 10, 32, 8, seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in b] != [r.prompt for r in c]
    assert {r.prompt_len for r in a} == {32} and {r.expected_output_len for r in a} == {8}
    with pytest.raises(ValueError):
        ds.sample_random(SPACE, 1, 32, 8, range_ratio=1.0)


def test_shared_prefix():
    reqs = ds.sample_shared_prefix(SPACE, num_prefixes=3, suffixes_per_prefix=4, prefix_len=32, suffix_len=8,
                                   output_len=5, seed=0)
    assert len(reqs) == 12
    groups = {}
    for r in reqs:
        assert r.prompt_len == 40 and r.expected_output_len == 5
        groups.setdefault(tuple(r.prompt[:32]), []).append(tuple(r.prompt[32:]))
    assert len(groups) == 3 and all(len(set(v)) == 4 for v in groups.values())
    assert [r.request_id for r in reqs] != sorted(r.request_id for r in reqs)  # shuffled


def test_mixed_is_long_tailed_and_seeded():
    reqs = ds.sample_mixed(SPACE, 2000, seed=0)
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.expected_output_len for r in reqs])
    assert p.min() >= 32 and p.max() <= 1024 and o.min() >= 16 and o.max() <= 512
    assert np.median(p) < p.mean() and np.median(o) < o.mean()  # most are short, a few long
    assert np.mean(p < 256) > 0.5 and np.mean(p > 768) > 0.03
    again = ds.sample_mixed(SPACE, 2000, seed=0)
    assert [r.prompt for r in again[:5]] == [r.prompt for r in reqs[:5]]
    assert len({tuple(r.prompt) for r in reqs}) == 2000


def test_sharegpt(tmp_path):
    from pagedserve.benchmarks.shapes import build_tokenizer, get_shape

    tok = build_tokenizer(get_shape("tiny-llama"))
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is the cache for? Tell me a bit."},
                                      {"from": "gpt", "value": "It stores keys and values so they are not recomputed."}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "starts with gpt: skipped"},
                                      {"from": "human", "value": "x"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "hi"}]},  # no answer: skipped
        {"id": "d", "conversations": [{"from": "human", "value": "Please write a long answer about trains."},
                                      {"from": "gpt", "value": "Trains run on rails and carry many people each day."},
                                      {"from": "human", "value": "more"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = ds.sample_sharegpt(str(path), tok, num_prompts=10, seed=0)
    assert len(reqs) == 2
    for r in reqs:
        assert r.prompt_len == len(r.prompt) >= 4 and r.expected_output_len >= 4
    by_text = {tok.decode(r.prompt): r for r in reqs}
    ans = "It stores keys and values so they are not recomputed."
    assert by_text["What is the cache for? Tell me a bit."].expected_output_len == len(tok(ans, add_special_tokens=False)["input_ids"])
    fixed = ds.sample_sharegpt(str(path), tok, num_prompts=1, seed=0, output_len=7)
    assert len(fixed) == 1 and fixed[0].expected_output_len == 7
    with pytest.raises(ValueError):
        ds.sample_sharegpt(str(path), None, 1)


def test_get_samples_from_flags():
    p = argparse.ArgumentParser()
    ds.add_dataset_args(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(["--dataset-name", "shared-prefix", "--num-prompts", "12", "--shared-prefix-num-prefixes", "3",
                         "--shared-prefix-len", "20", "--shared-prefix-suffix-len", "4", "--vocab-size", "100"])
    reqs = ds.get_samples(args)
    assert len(reqs) == 12 and all(r.prompt_len == 24 and max(r.prompt) < 100 for r in reqs)
    args = p.parse_args(["--dataset-name", "random", "--num-prompts", "3", "--random-input-len", "10",
                         "--random-output-len", "4"])
    reqs = ds.get_samples(args, vocab_cap=50)
    assert all(r.prompt_len == 10 and max(r.prompt) < 50 for r in reqs)
    args = p.parse_args(["--dataset-name", "sharegpt"])
    with pytest.raises(ValueError):
        ds.get_samples(args)
