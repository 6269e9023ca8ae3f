"""Structured output after the reasoning ends (StructuredOutputsParams.start_after_token_ids, what the chat server
sets with --reasoning-parser, as vLLM applies the grammar only after the end-of-thinking marker): the thinking is
sampled free, token for token what the unconstrained model writes, and the grammar takes over after the marker."""
from __future__ import annotations

import re

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams as SO

REGEX = r"[A-Z]{2}-\d{3}"


@pytest.fixture(scope="module", params=[True, False], ids=["masks-overlapped", "checked-first"])
def llm(model_dir, request):
    llm = LLM(str(model_dir), num_threads=1, num_kv_blocks=128, max_model_len=256, dtype="float32")
    llm.llm_engine.structured_output.overlap_masks = request.param
    return llm


def test_grammar_starts_after_the_end_of_reasoning_marker(llm):
    prompt = torch.randint(3, 700, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    free = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    # two greedy tokens play the end-of-thinking marker: the first place a pair occurs that did not occur before
    k = next(i for i in range(2, 10) if (free[i - 1], free[i]) not in zip(free[:i - 1], free[1:i - 1]))
    marker = (free[k - 1], free[k])
    constrained, plain = llm.generate(prompt_token_ids=[prompt, prompt], sampling_params=[
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex=REGEX, start_after_token_ids=marker)),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex=REGEX))], use_tqdm=False)
    out = constrained.outputs[0]
    assert out.token_ids[:k + 1] == free[:k + 1]  # the thinking: unconstrained, the model's own greedy tokens
    answer = llm.get_tokenizer().decode(out.token_ids[k + 1:], skip_special_tokens=True)
    assert re.fullmatch(REGEX, answer) and out.finish_reason == "stop", answer
    assert re.fullmatch(REGEX, plain.outputs[0].text)  # without a marker the grammar holds from the first token
    assert plain.outputs[0].token_ids[:k + 1] != free[:k + 1]
    manager = llm.llm_engine.structured_output
    assert not manager.matchers and not manager.pending  # per-sequence state dropped at the end


def test_no_marker_in_the_output_means_no_constraint(llm):
    prompt = torch.randint(3, 700, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=free, use_tqdm=False)[0].outputs[0].token_ids
    never = max(alone) + 1  # a token the greedy output does not contain
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, structured_outputs=SO(regex=REGEX, start_after_token_ids=(never,))),
        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == alone
    assert not llm.llm_engine.structured_output.pending
