"""Benchmark workloads: lists of SampleRequest (prompt token ids + how many tokens to generate).

Every dataset builds prompts as *token ids*: the engine (ours or another OpenAI-compatible one)
gets exactly `prompt_len` tokens, with no tokenizer round trip changing the length.

* ``random``        - vLLM's random dataset: input/output lengths uniform in
                      ``[len*(1-r), len*(1+r)]`` (``--random-range-ratio r``), a shared random
                      prefix of ``--random-prefix-len`` tokens in front of every prompt (so
                      prompt_len = prefix + sampled input len), the rest random token ids drawn
                      per request (identical prompts would hit the prefix cache and measure a
                      speed the hardware cannot deliver - seed 004's warning).
* ``shared-prefix`` - N random prefixes x M random suffixes, shuffled: the prefix-caching workload.
* ``sharegpt``      - a ShareGPT JSON file: the first human turn is the prompt, the length of the
                      gpt turn that answers it is the output length (filtered like vLLM: prompt
                      and output >= 4 tokens, prompt <= 1024, prompt+output <= 2048).
* ``mixed``         - the project's standard mixed workload: prompt lengths 32..1024 and output
                      lengths 16..512, each drawn log-uniformly (long-tailed: most requests are
                      short, a few are long; median prompt ~181, median output ~90), seeded.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "shared-prefix", "sharegpt", "mixed")

MIXED_PROMPT_RANGE = (32, 1024)
MIXED_OUTPUT_RANGE = (16, 512)


@dataclass
class SampleRequest:
    prompt: list[int] | str  # token ids (all built-in datasets) or text
    prompt_len: int
    expected_output_len: int
    request_id: str | None = None


@dataclass
class TokenSpace:
    """Which token ids a random prompt may use: [0, vocab_size) minus special tokens."""
    vocab_size: int
    special_ids: frozenset[int] = frozenset()

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if n <= 0:
            return []
        ids = rng.integers(0, self.vocab_size, size=n)
        if self.special_ids:
            bad = np.isin(ids, np.fromiter(self.special_ids, dtype=np.int64))
            while bad.any():
                ids[bad] = rng.integers(0, self.vocab_size, size=int(bad.sum()))
                bad = np.isin(ids, np.fromiter(self.special_ids, dtype=np.int64))
        return ids.tolist()


def token_space_from_tokenizer(tokenizer) -> TokenSpace:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    try:
        special |= set(tokenizer.added_tokens_decoder.keys())  # chat markers etc.
    except Exception:
        pass
    return TokenSpace(len(tokenizer), frozenset(special))


def load_tokenizer(name_or_path: str | None):
    if not name_or_path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception:
        return None


def resolve_token_space(tokenizer=None, model_path: str | None = None, vocab_size: int | None = None) -> TokenSpace:
    """Tokenizer if we have one; else config.json's vocab_size; else a safe small range."""
    if vocab_size:
        return TokenSpace(vocab_size)
    if tokenizer is not None:
        return token_space_from_tokenizer(tokenizer)
    if model_path and os.path.isfile(os.path.join(model_path, "config.json")):
        with open(os.path.join(model_path, "config.json")) as f:
            return TokenSpace(int(json.load(f)["vocab_size"]))
    # Ids below 1000 are ordinary tokens in every vocabulary we know of except a few specials at 0..2.
    return TokenSpace(1000, frozenset({0, 1, 2}))


# ---------------------------------------------------------------------------------------


def _uniform_lens(rng: np.random.Generator, length: int, ratio: float, n: int, minimum: int) -> np.ndarray:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {ratio}")
    lo = max(minimum, int(math.floor(length * (1 - ratio))))
    hi = max(lo, int(math.ceil(length * (1 + ratio))))
    return rng.integers(lo, hi + 1, size=n)


def sample_random(space: TokenSpace, num_prompts: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    prefix = space.sample(rng, prefix_len)
    in_lens = _uniform_lens(rng, input_len, range_ratio, num_prompts, minimum=0 if prefix_len else 1)
    out_lens = _uniform_lens(rng, output_len, range_ratio, num_prompts, minimum=1)
    out = []
    for i in range(num_prompts):
        ids = prefix + space.sample(rng, int(in_lens[i]))
        out.append(SampleRequest(ids, len(ids), int(out_lens[i]), request_id=f"random-{i}"))
    return out


def sample_shared_prefix(space: TokenSpace, num_prefixes: int, suffixes_per_prefix: int, prefix_len: int,
                         suffix_len: int, output_len: int, seed: int = 0, shuffle: bool = True) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for p in range(num_prefixes):
        prefix = space.sample(rng, prefix_len)
        for s in range(suffixes_per_prefix):
            ids = prefix + space.sample(rng, suffix_len)
            out.append(SampleRequest(ids, len(ids), output_len, request_id=f"prefix{p}-suffix{s}"))
    if shuffle:
        order = rng.permutation(len(out))
        out = [out[i] for i in order]
    return out


def _log_uniform_int(rng: np.random.Generator, lo: int, hi: int, n: int) -> np.ndarray:
    x = np.exp(rng.uniform(math.log(lo), math.log(hi + 1), size=n))
    return np.clip(np.floor(x).astype(np.int64), lo, hi)


def sample_mixed(space: TokenSpace, num_prompts: int, seed: int = 0,
                 prompt_range: tuple[int, int] | None = None,
                 output_range: tuple[int, int] | None = None) -> list[SampleRequest]:
    prompt_range = prompt_range or MIXED_PROMPT_RANGE
    output_range = output_range or MIXED_OUTPUT_RANGE
    rng = np.random.default_rng(seed)
    in_lens = _log_uniform_int(rng, *prompt_range, num_prompts)
    out_lens = _log_uniform_int(rng, *output_range, num_prompts)
    return [SampleRequest(ids := space.sample(rng, int(in_lens[i])), len(ids), int(out_lens[i]),
                          request_id=f"mixed-{i}") for i in range(num_prompts)]


def sample_sharegpt(path: str, tokenizer, num_prompts: int, seed: int = 0, output_len: int | None = None,
                    max_prompt_len: int = 1024, max_total_len: int = 2048) -> list[SampleRequest]:
    if tokenizer is None:
        raise ValueError("the sharegpt dataset needs a tokenizer (--tokenizer, or --model as a local path)")
    with open(path) as f:
        data = json.load(f)
    convs = [d.get("conversations") or d.get("conversation") or [] for d in data]
    pairs = []
    for conv in convs:
        if len(conv) < 2:
            continue
        human, gpt = conv[0], conv[1]
        if human.get("from") not in ("human", "user") or gpt.get("from") not in ("gpt", "assistant", "chatgpt"):
            continue
        pairs.append((human.get("value", ""), gpt.get("value", "")))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pairs))
    out: list[SampleRequest] = []
    for idx in order:
        prompt, completion = pairs[idx]
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out_len = output_len or len(tokenizer(completion, add_special_tokens=False)["input_ids"])
        if output_len is None:
            if len(ids) < 4 or out_len < 4 or len(ids) > max_prompt_len or len(ids) + out_len > max_total_len:
                continue
        elif not ids:
            continue
        out.append(SampleRequest(list(ids), len(ids), int(out_len), request_id=f"sharegpt-{idx}"))
        if len(out) >= num_prompts:
            break
    if not out:
        raise ValueError(f"no usable conversations in {path}")
    return out


# ---------------------------------------------------------------------------------------
# CLI


def add_dataset_args(p: argparse.ArgumentParser, default_dataset: str = "random", default_num_prompts: int = 1000,
                     with_tokenizer: bool = True) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default=default_dataset)
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=int, default=default_num_prompts)
    if with_tokenizer:  # engine benchmarks get --tokenizer from EngineArgs
        g.add_argument("--tokenizer", default=None,
                       help="tokenizer for sharegpt / for choosing token ids (default: --model if a local path)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="draw random prompt ids from [0, N) (default: the tokenizer's length minus special ids)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one random prefix shared by every prompt (added to the input length)")
    g.add_argument("--shared-prefix-num-prefixes", type=int, default=4)
    g.add_argument("--shared-prefix-suffixes-per-prefix", type=int, default=None,
                   help="default: num_prompts / num_prefixes")
    g.add_argument("--shared-prefix-len", type=int, default=512)
    g.add_argument("--shared-prefix-suffix-len", type=int, default=64)
    g.add_argument("--shared-prefix-output-len", type=int, default=64)
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="override the output length of every ShareGPT request")


def get_samples(args: argparse.Namespace, tokenizer=None, model_path: str | None = None,
                vocab_cap: int | None = None) -> list[SampleRequest]:
    """The workload the dataset flags describe. vocab_cap: the model's vocab size, if known (ids stay below it)."""
    space = resolve_token_space(tokenizer, model_path, getattr(args, "vocab_size", None))
    if vocab_cap and space.vocab_size > vocab_cap:
        space = TokenSpace(vocab_cap, space.special_ids)
    name = args.dataset_name
    if name == "random":
        return sample_random(space, args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, args.random_prefix_len, args.seed)
    if name == "shared-prefix":
        per = args.shared_prefix_suffixes_per_prefix or max(1, args.num_prompts // args.shared_prefix_num_prefixes)
        return sample_shared_prefix(space, args.shared_prefix_num_prefixes, per, args.shared_prefix_len,
                                    args.shared_prefix_suffix_len, args.shared_prefix_output_len, args.seed)
    if name == "mixed":
        return sample_mixed(space, args.num_prompts, args.seed)
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-path is required for --dataset-name sharegpt")
        return sample_sharegpt(args.dataset_path, tokenizer, args.num_prompts, args.seed, args.sharegpt_output_len)
    raise ValueError(f"unknown dataset {name!r}")


def describe(samples: list[SampleRequest]) -> str:
    p = np.array([s.prompt_len for s in samples])
    o = np.array([s.expected_output_len for s in samples])
    return (f"{len(samples)} requests; prompt len mean {p.mean():.0f} median {np.median(p):.0f} "
            f"[{p.min()}, {p.max()}]; output len mean {o.mean():.0f} median {np.median(o):.0f} [{o.min()}, {o.max()}]")
