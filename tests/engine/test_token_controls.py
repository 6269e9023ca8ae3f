"""Token controls (logit_bias, allowed_token_ids, bad_words) against HF transformers' logits, with and without
speculative decoding, and their validation."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.model_executor.token_controls import bad_word_bans
from tests.hf_reference import load_hf_model, mixed_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}
STEPS = 8


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", num_threads=1, num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return mixed_prompts(tiny_tokenizer, n=3, lengths=(6, 40))


def hf_greedy_with(model_dir: str, prompt: list[int], steps: int, bias: torch.Tensor) -> list[int]:
    """HF greedy decoding with `bias` ([V], may hold -inf) added to every step's float32 logits."""
    model = load_hf_model(model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int((logits + bias).argmax()))
    return ids[len(prompt):]


def hf_next_logits(model_dir: str, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_model(model_dir)(torch.tensor([prompt])).logits[0, -1].float()


def generate(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                          use_tqdm=False)]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_logit_bias_matches_hf(model_dir, llm, prompts, spec):
    """+100 forces an unlikely token (its logit gap is far below 100), -100 bans the argmax: the outputs equal HF
    greedy decoding on logits + bias; a batch neighbour without a bias is untouched."""
    engine = LLM(model_dir, dtype="float32", num_threads=1, num_kv_blocks=256, max_model_len=512,
                 speculative_config=NGRAM) if spec else llm
    vocab = hf_next_logits(model_dir, prompts[0]).shape[0]
    first = hf_next_logits(model_dir, prompts[0])
    unlikely, top = int(first.argmin()), int(first.argmax())
    cases = [{unlikely: 100.0}, {top: -100.0, 7: 3.5}]
    params = [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                             logit_bias={str(k): v for k, v in c.items()}) for c in cases] + [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)]
    outs = generate(engine, [prompts[0], prompts[0], prompts[1]], params)
    for case, out in zip(cases, outs):
        bias = torch.zeros(vocab)
        for k, v in case.items():
            bias[k] = v
        assert out == hf_greedy_with(model_dir, prompts[0], STEPS, bias)
    assert outs[0] == [unlikely] * STEPS
    assert top not in outs[1]
    assert outs[2] == hf_greedy_with(model_dir, prompts[1], STEPS, torch.zeros(vocab))


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_allowed_token_ids_match_hf(model_dir, llm, prompts, spec):
    engine = LLM(model_dir, dtype="float32", num_threads=1, num_kv_blocks=256, max_model_len=512,
                 speculative_config=NGRAM) if spec else llm
    allowed = [5, 40, 41, 99, 300]
    vocab = hf_next_logits(model_dir, prompts[2]).shape[0]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, allowed_token_ids=allowed)
    out, = generate(engine, [prompts[2]], params)
    mask = torch.full((vocab,), float("-inf"))
    mask[allowed] = 0.0
    assert out == hf_greedy_with(model_dir, prompts[2], STEPS, mask)
    # random sampling stays inside the set too
    sampled, = generate(engine, [prompts[2]], SamplingParams(temperature=1.5, seed=3, max_tokens=32,
                                                             ignore_eos=True, allowed_token_ids=allowed))
    assert set(sampled) <= set(allowed)


def test_bad_words(llm, prompts, tiny_tokenizer):
    """A word of several tokens that the greedy output had never appears once banned."""
    plain, = generate(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    word = next(w for k in (2, 3, 4) if "\ufffd" not in (w := tiny_tokenizer.decode(plain[:k]).strip()))

    def occurs(seq, out):
        return any(out[i:i + len(seq)] == seq for i in range(len(out) - len(seq) + 1))

    # the engine bans both spellings, at a word start and after a space (vLLM's rule)
    seqs = [tiny_tokenizer.encode(s, add_special_tokens=False) for s in (word, " " + word)]
    assert any(len(seq) > 1 and occurs(seq, plain) for seq in seqs)
    out, = generate(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                                                      bad_words=[word]))
    assert not any(occurs(seq, out) for seq in seqs), (seqs, out)


def test_bad_word_bans_rule():
    words = [[7], [3, 4, 5], [9, 9]]
    assert bad_word_bans(words, []) == [7]
    assert bad_word_bans(words, [1, 3, 4]) == [7, 5]
    assert bad_word_bans(words, [3, 4, 1]) == [7]
    assert bad_word_bans(words, [9]) == [7, 9]


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={"5": 100.5}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias=[1]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_invalid_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
])
def test_out_of_vocabulary_ids(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=2, **kwargs),
                     use_tqdm=False)


def test_truncate_prompt_tokens(llm, prompts):
    long = prompts[1]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate(prompt_token_ids=[long], use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=5))[0]
    tail = llm.generate(prompt_token_ids=[long[-5:]], sampling_params=params, use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-5:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate(prompt_token_ids=[long], use_tqdm=False,
                     sampling_params=SamplingParams(truncate_prompt_tokens=512))


def test_logit_bias_with_structured_output(llm, prompts, tiny_tokenizer):
    """The grammar's mask applies on top of the bias: banning the first token of the choice the model picks gives
    the other choice, never text outside the grammar."""
    choices = ["the book", "a dog"]
    firsts = [tiny_tokenizer.encode(c, add_special_tokens=False)[0] for c in choices]
    assert firsts[0] != firsts[1]

    def run(bias):
        so = StructuredOutputsParams(choice=choices)
        out = llm.generate(prompt_token_ids=[prompts[0]], use_tqdm=False, sampling_params=SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=so, logit_bias=bias))[0]
        return out.outputs[0].text

    picked = run(None)
    assert picked in choices
    other = run({str(firsts[choices.index(picked)]): -100})
    assert other in choices and other != picked
