"""The offline API: validation, stops, seeds, chat, the engine API and the CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), num_kv_blocks=128, num_threads=1, max_model_len=512)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(n=1000), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["x"], detokenize=False), "stop"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_limits(llm):
    with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
        llm.generate(prompt_token_ids=[[5] * 600], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"requested 550 tokens \(450 in the prompt, 100 in the completion\)"):
        llm.generate(prompt_token_ids=[[5] * 450], sampling_params=SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate(prompt_token_ids=[[5, 10**6]], use_tqdm=False)
    # a request that fits max_model_len but not the whole KV pool is refused up front, never left to hang
    small = LLM(llm.llm_engine.config.model.path, num_kv_blocks=4, num_threads=1, max_model_len=512)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate(prompt_token_ids=[[5] * 60], sampling_params=SamplingParams(max_tokens=10), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and not small.llm_engine.has_unfinished_requests()


def test_stops(llm):
    prompt = [[0, 40, 41, 42, 43, 44]]
    free = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=20,
                                                                                ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    assert len(tokens) == 20 and free.outputs[0].finish_reason == "length"
    # stop_token_ids: ends at the first occurrence, token kept in ids, reason is the token
    stop_at = tokens[5]
    out = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[stop_at], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens bans the stop token until reached
    out = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=20, min_tokens=8, stop_token_ids=[tokens[0]], ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8 and tokens[0] not in out.token_ids[:8]
    # stop strings: the text ends right before the stop string's first occurrence (a window of 3 characters from
    # the middle of the free text, the first one that is not all whitespace)
    text = free.outputs[0].text
    start = next(i for i in range(len(text) // 2, len(text) - 2) if text[i:i + 3].strip())
    stop = text[start:start + 3]
    out = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=20, stop=[stop], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]


def test_eos_ends_the_request(llm, tiny_model_dir):
    """The same checkpoint with one of the tokens its free greedy run emits declared the EOS: generation stops at
    its first EOS (the token kept in the ids, finish_reason "stop", stop_reason None, as vLLM); ignore_eos runs on."""
    prompt = [[0, 40, 41, 42, 43, 44]]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate(prompt_token_ids=prompt, sampling_params=greedy, use_tqdm=False)[0].outputs[0].token_ids
    eos = tokens[6]
    eos_llm = LLM(str(tiny_model_dir("llama", eos_token_id=eos)), num_kv_blocks=128, num_threads=1,
                  max_model_len=512)
    assert eos in eos_llm.llm_engine.model_config.eos_token_ids
    first_eos = next(i for i, t in enumerate(tokens) if t in eos_llm.llm_engine.model_config.eos_token_ids)
    assert first_eos <= 6
    out = eos_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=20),
                           use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:first_eos + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = eos_llm.generate(prompt_token_ids=prompt, sampling_params=greedy, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_seeded_request_same_alone_or_batched(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = [0, 17, 18, 19, 20, 21, 22]
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s if s % 2 else None, max_tokens=24, ignore_eos=True)
              for s in range(63)]
    prompts = [[0] + [30 + (i * 7 + j) % 500 for j in range(3 + i % 40)] for i in range(63)]
    outs = llm.generate(prompt_token_ids=prompts[:20] + [prompt] + prompts[20:],
                        sampling_params=others[:20] + [params] + others[20:], use_tqdm=False)
    assert outs[20].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=other_seed,
                        use_tqdm=False)[0].outputs[0].token_ids != alone


def test_logprobs_and_text(llm):
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert out.prompt == "hello world" and out.prompt_token_ids[0] == 0  # bos
    assert len(c.logprobs) == 6
    for token, step in zip(c.token_ids, c.logprobs):
        assert token in step and len(step) >= 3
        assert step[token].rank == 1  # greedy picks the most likely
        assert step[token].decoded_token is not None
    assert c.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(c.token_ids, c.logprobs)))
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("output_kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_detokenize_false_gives_token_ids_only(llm, output_kind):
    """detokenize=False (vLLM's field): the same tokens, no text and no decoded logprob tokens."""
    params = dict(temperature=0, max_tokens=7, logprobs=2, ignore_eos=True, output_kind=output_kind)
    engine = llm.llm_engine
    runs = {}
    for detokenize in (True, False):
        engine.add_request(f"d{detokenize}", "hello world", SamplingParams(**params, detokenize=detokenize))
        tokens, texts, decoded = [], [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                c = out.outputs[0]
                tokens += c.token_ids if output_kind == RequestOutputKind.DELTA else [] if not out.finished \
                    else c.token_ids
                texts.append(c.text)
                decoded += [lp.decoded_token for step in c.logprobs for lp in step.values()]
        runs[detokenize] = tokens, texts, decoded
    assert runs[False][0] == runs[True][0] and len(runs[True][0]) == 7
    assert set(runs[False][1]) == {""} and "".join(runs[True][1])
    assert set(runs[False][2]) == {None} and None not in runs[True][2]


def test_chat(llm):
    out = llm.chat([{"role": "user", "content": "hi there"}], SamplingParams(temperature=0, max_tokens=5),
                   use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi there"}],
                                                       add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]  # BatchEncoding in transformers 5
    assert out.prompt_token_ids == list(expected)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([[]], use_tqdm=False)


def test_engine_api_delta_and_abort(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("a", [0, 5, 6, 7], params)
    engine.add_request("b", [0, 8, 9], params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [0, 1], params)
    pieces = {"a": [], "b": []}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            pieces[o.request_id] += o.outputs[0].token_ids if o.outputs else []
        steps += 1
        if steps == 3:
            engine.abort_request("b")
            assert engine.kv_cache_manager.block_ids("b") == []
    assert len(pieces["a"]) == 10 and 0 < len(pieces["b"]) < 10
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.slow
def test_generate_cli(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "generate", str(tiny_model_dir("llama")),
                             "--prompt", "def f(x):", "--max-tokens", "8", "--num-kv-blocks", "64", "--num-threads", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def f(x):") and len(result.stdout) > len("def f(x):")


@pytest.mark.parametrize("field, value", [("kv_cache_dtype", "fp4"), ("dtype", "int3"), ("linear_backend", "blas"),
                                          ("block_size", 3), ("scheduling_policy", "lifo")])
def test_invalid_engine_args(field, value):
    from pagedserve.config import EngineArgs

    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: value})
