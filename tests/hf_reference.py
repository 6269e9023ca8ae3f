"""Hugging Face transformers reference for token-for-token greedy correctness tests.

    hf = hf_greedy(model_dir, prompts, max_new_tokens=32)          # list[HFResult]
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=32,
                                                       ignore_eos=True, logprobs=2))
    assert_greedy_match(outs, hf)          # RequestOutputs accepted directly (token ids + logprobs)
    # or: assert_greedy_match([o.outputs[0].token_ids for o in outs], hf,
    #                         our_logprobs=[o.outputs[0].logprobs for o in outs])

EOS handling: HF runs with ``eos_token_id=None`` (model.generation_config is replaced by one with no
eos), so generation never stops early and always returns exactly ``max_new_tokens`` tokens.  We do
NOT use ``min_new_tokens``: that suppresses the eos logit, which changes the greedy choice and the
log-probs, whereas our engine's ``ignore_eos=True`` (like vLLM's) leaves the logits alone and
just does not stop.  Every greedy token is checked to be the argmax of the raw logits, i.e. no
logits processor was active.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["HFResult", "hf_greedy", "load_hf_model", "assert_greedy_match", "mixed_prompts"]


@dataclass(frozen=True)  # cached and shared between tests (hf_greedy): a test derives, never edits one
class HFResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # exactly max_new_tokens generated ids
    logprobs: torch.Tensor  # [max_new_tokens, vocab] float32 log_softmax of the raw logits per step

    def logprob(self, step: int, token_id: int) -> float:
        return float(self.logprobs[step, token_id])

    def rank(self, step: int, token_id: int) -> int:
        """1-based rank of token_id at step (1 = argmax); ties count in the token's favour."""
        row = self.logprobs[step]
        return int((row > row[token_id]).sum()) + 1

    def top(self, step: int, k: int = 2) -> list[tuple[int, float]]:
        vals, idx = torch.topk(self.logprobs[step], k)
        return [(int(i), float(v)) for i, v in zip(idx, vals)]


def _gguf_config(path: Path):
    """transformers' config of a GGUF file, with the MoE experts' widths its GGUF map does not read (it keeps the
    config class's defaults) taken from the file's metadata."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    fields = gguf.GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents()
    for key, attr in (("expert_feed_forward_length", "moe_intermediate_size"),
                      ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        if f"{arch}.{key}" in fields:
            setattr(config, attr, int(fields[f"{arch}.{key}"].contents()))
    return config


@functools.lru_cache(maxsize=4)
def load_hf_model(model_dir: str):
    """Load a checkpoint (or a GGUF file) in float32, eval mode, with eos disabled in its generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(model_dir)
    if path.suffix == ".gguf":  # transformers dequantizes a GGUF file itself
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     config=_gguf_config(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    if pad is None:
        pad = 0
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=pad)
    return model


_HF_CACHE: dict[tuple, HFResult] = {}


def hf_greedy(model_dir, prompts_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[HFResult]:
    """Greedy-decode each prompt alone (batch 1, no padding) with transformers ``generate``.

    float32, ``do_sample=False, num_beams=1``; returns exactly ``max_new_tokens`` tokens per prompt
    (eos disabled, see module docstring) and the per-step log-softmax of the raw logits.
    Results are memoized per (model_dir, prompt, max_new_tokens) for the process, so several tests
    may compare against the same reference cheaply (the checkpoint dir must not change meanwhile).
    """
    key_dir = str(Path(model_dir).resolve())
    keys = [(key_dir, tuple(int(t) for t in p), int(max_new_tokens)) for p in prompts_token_ids]
    missing = [k for k in dict.fromkeys(keys) if k not in _HF_CACHE]
    if missing:
        # Tiny matrices: one intra-op thread is ~10x faster than several on a busy shared CPU.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            results = _hf_greedy_uncached(key_dir, [list(k[1]) for k in missing], max_new_tokens)
        finally:
            torch.set_num_threads(threads)
        _HF_CACHE.update(zip(missing, results))
    return [_HF_CACHE[k] for k in keys]


@torch.inference_mode()
def _hf_greedy_uncached(model_dir: str, prompts_token_ids, max_new_tokens: int) -> list[HFResult]:
    from transformers import GenerationConfig

    model = load_hf_model(model_dir)
    gen_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        eos_token_id=None,
        pad_token_id=model.generation_config.pad_token_id,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    results = []
    for prompt in prompts_token_ids:
        prompt = [int(t) for t in prompt]
        input_ids = torch.tensor([prompt], dtype=torch.long)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=gen_config,
        )
        gen = out.sequences[0, len(prompt):].tolist()
        assert len(gen) == max_new_tokens, f"HF stopped early: {len(gen)} of {max_new_tokens} tokens"
        logits = torch.stack([l[0] for l in out.logits]).float()  # raw logits, [steps, vocab]
        assert logits.shape[0] == max_new_tokens
        argmax = logits.argmax(dim=-1).tolist()
        assert argmax == gen, "HF greedy tokens are not the argmax of the raw logits (a logits processor ran?)"
        results.append(HFResult(prompt, gen, torch.log_softmax(logits, dim=-1)))
    return results


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


def _lp(v: Any) -> float:
    return float(getattr(v, "logprob", v))


def _unpack_ours(ours, our_logprobs):
    """Accept list[list[int]], list[CompletionOutput] or list[RequestOutput]."""
    ids, lps = [], []
    for o in ours:
        if hasattr(o, "outputs"):  # RequestOutput
            o = o.outputs[0]
        if hasattr(o, "token_ids"):  # CompletionOutput
            ids.append([int(t) for t in o.token_ids])
            lps.append(getattr(o, "logprobs", None))
        else:
            ids.append([int(t) for t in o])
            lps.append(None)
    if our_logprobs is None and any(lp is not None for lp in lps):
        our_logprobs = lps
    return ids, our_logprobs


def _logprob_errors(p: int, mine: list[int], ref: HFResult, steps: Sequence[dict] | None, atol: float) -> list[str]:
    """Our returned logprobs against HF's log-softmax, up to and including the first divergence."""
    if steps is None:
        return [f"prompt {p}: no logprobs of ours to compare with HF's (request logprobs)"]
    diverged = next((k for k, (a, b) in enumerate(zip(mine, ref.token_ids)) if a != b), None)
    last = min(len(mine), len(ref.token_ids)) - 1 if diverged is None else diverged
    if len(steps) <= last:
        return [f"prompt {p}: {len(steps)} steps of logprobs for {last + 1} compared tokens"]
    worst = max(((abs(_lp(v) - ref.logprob(i, t)), i, t, _lp(v)) for i in range(last + 1)
                 for t, v in steps[i].items()), default=None)
    if worst is None or worst[0] > atol:
        return [f"prompt {p}: logprob |ours - HF| = {worst[0]:.2e} > {atol:g} at step {worst[1]}, token {worst[2]} "
                f"(ours {worst[3]:.6f}, HF {ref.logprob(worst[1], worst[2]):.6f})" if worst else
                f"prompt {p}: no logprobs returned"]
    return []


def _our_rank(step_lps: dict, token_id: int) -> int | None:
    """1-based rank of token_id among our returned logprobs at one step (None if absent)."""
    if token_id not in step_lps:
        return None
    mine = _lp(step_lps[token_id])
    return sum(1 for t, v in step_lps.items() if t != token_id and _lp(v) > mine) + 1


def assert_greedy_match(
    ours,
    hf: Sequence[HFResult],
    min_identical_frac: float = 0.9,
    our_logprobs: Sequence[Sequence[dict]] | None = None,
    logprob_atol: float | None = None,
) -> None:
    """Check our greedy outputs against HF's, vLLM-style.

    ``ours``: per prompt, our generated token ids (or the RequestOutput / CompletionOutput objects,
    from which token ids and, unless ``our_logprobs`` is given, ``.logprobs`` are taken).
    ``our_logprobs``: per prompt, per step, a dict token_id -> logprob (float or Logprob).

    Each prompt must be identical to HF, OR at the first divergence position i: our token is in
    HF's top-2 at step i, and (if our logprobs are known) HF's token is in our top-2 at step i.
    After a divergence the contexts differ, so later tokens are not compared.  In addition at least
    ``min_identical_frac`` of the prompts must be fully identical (note: with 8 prompts, 0.9 means
    all 8).

    ``logprob_atol`` (float32 runs: 1e-4): every logprob we returned (the top-k and the sampled token), at every step
    up to and including the first divergence (the contexts are equal until then), is within it of HF's
    log-softmax of the raw logits; our logprobs must then be known.
    """
    ours_ids, our_logprobs = _unpack_ours(ours, our_logprobs)
    assert len(ours_ids) == len(hf), f"{len(ours_ids)} outputs of ours vs {len(hf)} HF results"
    if our_logprobs is not None:
        assert len(our_logprobs) == len(hf)

    errors: list[str] = []
    divergences: list[str] = []
    n_identical = 0
    for p, (mine, ref) in enumerate(zip(ours_ids, hf)):
        theirs = ref.token_ids
        if logprob_atol is not None:
            errors.extend(_logprob_errors(p, mine, ref, our_logprobs[p] if our_logprobs else None, logprob_atol))
        if mine == theirs:
            n_identical += 1
            continue
        head = f"prompt {p} (prompt len {len(ref.prompt_token_ids)})"
        i = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if i is None:  # one is a prefix of the other
            errors.append(
                f"{head}: length mismatch, ours {len(mine)} tokens vs HF {len(theirs)} "
                f"(identical up to position {min(len(mine), len(theirs))})"
            )
            continue
        a, b = mine[i], theirs[i]
        hf_rank = ref.rank(i, a)
        lp_a, lp_b = ref.logprob(i, a), ref.logprob(i, b)
        msg = (
            f"{head}: first divergence at generated position {i}: ours={a} hf={b}; "
            f"HF logprobs hf_tok={lp_b:.5f} our_tok={lp_a:.5f} gap={lp_b - lp_a:.5f}, "
            f"our token's HF rank={hf_rank}; HF top-3 {[(t, round(v, 5)) for t, v in ref.top(i, 3)]}"
        )
        ok = hf_rank <= 2
        if our_logprobs is not None and our_logprobs[p] is not None:
            steps = our_logprobs[p]
            if i >= len(steps) or steps[i] is None:
                msg += "; our logprobs missing at this step"
                ok = False
            else:
                step = steps[i]
                r = _our_rank(step, b)
                ours_gap = (
                    f"{_lp(step[a]) - _lp(step[b]):.5f}" if (a in step and b in step) else "n/a"
                )
                msg += (
                    f"; our logprobs {{{', '.join(f'{t}: {_lp(v):.5f}' for t, v in step.items())}}}, "
                    f"HF token's rank in ours={r} (our gap {ours_gap})"
                )
                if r is None:
                    msg += " (HF token not among our returned logprobs; request logprobs>=2)"
                    ok = False
                elif r > 2:
                    ok = False
        if ok:
            divergences.append(msg)
        else:
            errors.append("NOT a near-tie: " + msg)

    n = len(hf)
    frac = n_identical / n if n else 1.0
    if frac + 1e-9 < min_identical_frac:
        errors.append(
            f"only {n_identical}/{n} prompts ({frac:.0%}) fully identical to HF, "
            f"need >= {min_identical_frac:.0%}"
        )
    if errors:
        detail = "\n  ".join(errors + [f"(tolerated) {d}" for d in divergences])
        raise AssertionError(f"greedy outputs differ from HF transformers:\n  {detail}")


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def mixed_prompts(tokenizer_or_vocab_size, n: int = 8, lengths: tuple[int, int] = (5, 300), seed: int = 0) -> list[list[int]]:
    """``n`` deterministic prompts (token ids) with lengths spread geometrically over ``lengths``
    (both ends included), in a seed-shuffled order.

    With a tokenizer: ``<s>`` followed by a window of tokenized English+code text (``tiny_corpus``
    with another seed than the tokenizer was trained on).  With an int vocab size: uniformly random
    ids in ``[3, vocab_size)`` (ids 0-2 are the special tokens of the tiny tokenizer).
    """
    lo, hi = lengths
    assert 1 <= lo <= hi and n >= 1
    if n == 1:
        lens = [lo]
    else:
        lens = [round(lo * (hi / lo) ** (k / (n - 1))) for k in range(n)]
    rng = random.Random(seed)
    rng.shuffle(lens)

    if isinstance(tokenizer_or_vocab_size, int):
        vocab = tokenizer_or_vocab_size
        return [[rng.randrange(3, vocab) for _ in range(L)] for L in lens]

    from tiny_models import tiny_corpus

    tok = tokenizer_or_vocab_size
    docs = tiny_corpus(seed=10_000 + seed, n_lines=600)
    stream: list[int] = []
    for d in docs:
        stream.extend(tok.encode(d + "\n", add_special_tokens=False))
    assert len(stream) > hi
    bos = tok.bos_token_id
    prompts = []
    for L in lens:
        body = L - 1 if bos is not None else L
        start = rng.randrange(0, len(stream) - body)
        prompts.append(([bos] if bos is not None else []) + stream[start:start + body])
    return prompts
