"""Prompt logprobs against HF transformers' float32 log_softmax over the prompt: whole prefills, chunked prefill,
with the prefix cache holding the prompt (requests asking them bypass the hit), n > 1, and batch neighbours that do
not ask (no entries, unchanged outputs)."""
from __future__ import annotations

import pytest
import torch
from hf_reference import load_hf_model, mixed_prompts
from test_correctness import check_engine_drained

from pagedserve import LLM, SamplingParams

ATOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return mixed_prompts(tiny_tokenizer, n=3, lengths=(5, 70))


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row j is log_softmax of the logits at position j (scoring prompt[j + 1])."""
    with torch.no_grad():
        logits = load_hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_against_hf(model_dir, prompt, prompt_logprobs, k=TOP):
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for j, entry in enumerate(prompt_logprobs[1:]):
        token = prompt[j + 1]
        row = ref[j]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=ATOL)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_lps, top_ids = row.topk(k)
        for rank, (tid, tlp) in enumerate(zip(top_ids.tolist(), top_lps.tolist()), start=1):
            assert tid in entry and entry[tid].logprob == pytest.approx(tlp, abs=ATOL)
            if tid != token:
                assert entry[tid].rank == rank
        assert len(entry) <= k + 1


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_hf(model_dir, prompts, chunk):
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(model_dir, dtype="float32", num_threads=1, num_kv_blocks=256, max_model_len=512, **kwargs)
    asking = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[prompts[2]], sampling_params=plain, use_tqdm=False)[0]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[asking, asking, plain], use_tqdm=False)
    for prompt, out in zip(prompts[:2], outs[:2]):
        check_against_hf(model_dir, prompt, out.prompt_logprobs)
    assert outs[2].prompt_logprobs is None
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    check_engine_drained(llm)


def test_prompt_logprobs_bypass_prefix_cache(model_dir, prompts):
    """The prompt is cached by a first request; a second asking prompt logprobs computes it again (no hit) and
    still gets every entry; one that does not ask hits the cache as before."""
    llm = LLM(model_dir, dtype="float32", num_threads=1, num_kv_blocks=256, max_model_len=512,
              enable_prefix_caching=True, max_num_batched_tokens=32)
    prompt = prompts[1]
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=plain, use_tqdm=False)
    out = llm.generate(prompt_token_ids=[prompt], use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    check_against_hf(model_dir, prompt, out.prompt_logprobs, k=0)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    check_engine_drained(llm)


def test_prompt_logprobs_with_n_and_streaming_kinds(model_dir, prompts):
    llm = LLM(model_dir, dtype="float32", num_threads=1, num_kv_blocks=256, max_model_len=512)
    out = llm.generate(prompt_token_ids=[prompts[0]], use_tqdm=False, sampling_params=SamplingParams(
        n=2, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=1))[0]
    assert len(out.outputs) == 2
    check_against_hf(model_dir, prompts[0], out.prompt_logprobs, k=1)
    check_engine_drained(llm)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_invalid_prompt_logprobs(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_above_limit(model_dir):
    llm = LLM(model_dir, dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=512, max_logprobs=5)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(prompt_logprobs=6),
                     use_tqdm=False)
