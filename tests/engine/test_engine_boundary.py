"""The engine's edges, with the real engine: one input processor (typed errors naming the parameter), failure
isolation (a failed forward fails only its step's requests, leaves no trace in the prefix cache), exact finish
reasons, beam-width limits, limits on a request's size, warm-up before the first request."""
from __future__ import annotations

import pytest
import torch

from server_helpers import stops_ending_with_last_token

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.engine.fault_injection import FaultInjector
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import RequestOutputKind


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 128)
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("dtype", "float32")  # outputs are compared across batch shapes: no bf16 near-ties
    return LLM(str(model_dir), num_threads=1, **kwargs)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 700, (n,), generator=g).tolist()


def assert_drained(llm: LLM) -> None:
    engine = llm.llm_engine
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished_requests()


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


# ------------------------------------------------------------------------------------ one input processor
@pytest.mark.parametrize("kwargs, param", [
    (dict(stop_token_ids=[10**7], min_tokens=1), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=["x"] * 65), "stop"),
    (dict(stop=["y" * 5000, "z" * 5000]), "stop"),
    (dict(n=300), "n"),
    (dict(max_tokens=600), "max_tokens"),
])
def test_bad_params_raise_typed_errors_before_any_work(model_dir, kwargs, param):
    llm = make_llm(model_dir)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompt_token_ids=[prompt(8, 0)], sampling_params=SamplingParams(**kwargs), use_tqdm=False)
    assert info.value.param == param and isinstance(info.value, ValueError)
    assert_drained(llm)


def test_oov_stop_id_next_to_a_running_request_fails_alone(model_dir):
    """Before: stop_token_ids=[10**7] with min_tokens passed validation and the sampler's IndexError failed the
    whole batch. Now it is refused at add_request, and the running request finishes as if alone."""
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    alone = llm.generate(prompt_token_ids=[prompt(20, 1)], sampling_params=GREEDY, use_tqdm=False)[0]
    engine.add_request("victim", prompt(20, 1), GREEDY)
    engine.step()
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request("bad", prompt(5, 2), SamplingParams(stop_token_ids=[10**7], min_tokens=1))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["victim"]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids and outs[0].error is None
    assert_drained(llm)


def test_limits_per_request_are_configurable(model_dir):
    llm = make_llm(model_dir, max_sequences_per_request=4, max_stop_strings=2, max_stop_chars=10, max_logprobs=4)
    ok = dict(prompt_token_ids=[prompt(6, 3)], use_tqdm=False)
    llm.generate(sampling_params=SamplingParams(n=4, stop=["ab", "cd"], logprobs=4, max_tokens=2), **ok)
    for kwargs, param in [(dict(n=5), "n"), (dict(stop=["a", "b", "c"]), "stop"), (dict(stop=["a" * 11]), "stop"),
                          (dict(logprobs=5), "logprobs")]:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(sampling_params=SamplingParams(max_tokens=2, **kwargs), **ok)
        assert info.value.param == param
    assert_drained(llm)


def test_beam_width_at_and_past_the_limit(model_dir):
    llm = make_llm(model_dir)  # max_logprobs 20: beam search asks for 2 x width
    out = llm.beam_search([prompt(12, 4)], BeamSearchParams(beam_width=10, max_tokens=3))
    assert len(out[0].sequences) == 10
    for width in (11, 64, 128):
        with pytest.raises(InvalidRequestError, match="beam_width") as info:
            llm.beam_search([prompt(12, 4)], BeamSearchParams(beam_width=width, max_tokens=3))
        assert info.value.param == "beam_width"
    assert_drained(llm)


def test_chat_goes_through_the_one_renderer(model_dir):
    llm = make_llm(model_dir)
    with pytest.raises(InvalidRequestError) as info:
        llm.chat([], SamplingParams(max_tokens=2), use_tqdm=False)
    assert info.value.param == "messages"
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# ------------------------------------------------------------------------------------ exact finish reasons
def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(model_dir):
    llm = make_llm(model_dir)
    k = 12
    for seed in range(5, 40):
        p = prompt(10, seed)
        full = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(temperature=0, max_tokens=k,
                                                                                 ignore_eos=True), use_tqdm=False)
        text = full[0].outputs[0].text
        prev = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(temperature=0, max_tokens=k - 1,
                                                                                 ignore_eos=True), use_tqdm=False)
        stops = stops_ending_with_last_token(prev[0].outputs[0].text, text)
        if stops:
            break
    else:
        pytest.skip("no usable stop string in these greedy outputs")
    stop = stops[0]
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
        out = llm.generate(prompt_token_ids=[p], use_tqdm=False, sampling_params=SamplingParams(
            temperature=0, max_tokens=k, ignore_eos=True, stop=[stop], output_kind=kind))[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop), (text, stop)
        assert out.text == text[: len(text) - len(stop)] and len(out.token_ids) == k
    assert_drained(llm)


# ------------------------------------------------------------------------------------ failure isolation
def test_failed_step_fails_its_requests_only_and_poisons_nothing(model_dir):
    p_bad, p_other = prompt(70, 6), prompt(40, 7)
    clean = make_llm(model_dir)
    expected = {i: o.outputs[0].token_ids for i, o in enumerate(
        clean.generate(prompt_token_ids=[p_bad, p_other], sampling_params=GREEDY, use_tqdm=False))}

    llm = make_llm(model_dir, max_num_seqs=1)  # one seat: the other request waits, outside the failing step
    engine = llm.llm_engine
    fail = {"armed": True}
    engine.fault_injector = FaultInjector(engine.runner.model, lambda out: fail["armed"] and any(
        s.request.request_id == "bad" for s in out.scheduled))
    engine.add_request("bad", p_bad, GREEDY)
    engine.add_request("other", p_other, GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert engine.fault_injector.num_injected == 1 and engine.num_step_failures == 1
    bad = outs["bad"]
    assert bad.error is not None and "InjectedFault" in bad.error and bad.outputs[0].finish_reason == "error"
    assert outs["other"].error is None and outs["other"].outputs[0].token_ids == expected[1]
    # The failed forward wrote K/V for part of the layers into `bad`'s blocks: none of them may be found by a
    # prefix lookup, so the same prompt again gives exactly the clean output.
    assert engine.get_stats().scheduler.prefix_cache_hits == 0
    fail["armed"] = False
    again = llm.generate(prompt_token_ids=[p_bad], sampling_params=GREEDY, use_tqdm=False)[0]
    assert again.error is None and again.outputs[0].token_ids == expected[0]
    assert_drained(llm)


def test_failure_after_partial_prefill_keeps_earlier_chunks_valid(model_dir):
    """A prompt prefilled in chunks: the chunks before the failing one were written and registered; the
    failing chunk's blocks were not. The retry hits only written blocks and matches the clean output."""
    p = prompt(100, 8)
    expected = make_llm(model_dir).generate(prompt_token_ids=[p], sampling_params=GREEDY,
                                            use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(model_dir, max_num_batched_tokens=32)
    engine = llm.llm_engine
    steps = {"n": 0}

    def third_chunk(out):
        steps["n"] += 1
        return steps["n"] == 3

    engine.fault_injector = FaultInjector(engine.runner.model, third_chunk)
    first = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0]
    assert first.error is not None and "injected fault" in first.error
    retry = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0]
    assert retry.error is None and retry.outputs[0].token_ids == expected
    assert retry.num_cached_tokens == 64  # the two chunks written before the failure, not the third
    assert_drained(llm)


# ------------------------------------------------------------------------------------ ready means ready
def test_warm_up_leaves_no_trace(model_dir):
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    stats = engine.get_stats().scheduler
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (0, 0, 0)
    assert not engine.kv_cache_manager.block_pool.cached_blocks
    assert_drained(llm)


@pytest.mark.parametrize("max_model_len, num_kv_blocks, expected", [
    (512, 128, 256),  # one prompt fills the budget
    (100, 128, 256),  # prompts of at most 99 tokens: three of them, scheduled in one step
    (512, 10, 144),  # a cache of 160 tokens: the budget is cut to all but one block
])
def test_warm_up_runs_one_full_budget_step(model_dir, monkeypatch, max_model_len, num_kv_blocks, expected):
    """The largest step happens at start-up, not as the first request's prefill (its activations set the heap's
    size; llm_engine._full_budget_batch)."""
    from pagedserve.core.scheduler import Scheduler

    sizes = []
    schedule = Scheduler.schedule

    def recording(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        sizes.append(out.num_scheduled_tokens)
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    llm = make_llm(model_dir, max_num_batched_tokens=256, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks)
    assert max(sizes) == expected
    assert_drained(llm)
