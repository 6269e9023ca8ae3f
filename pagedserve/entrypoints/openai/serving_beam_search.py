"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the offline search (engine/beam_search.py)
driven through the async engine client, each step's live beams one batch of one-token requests sharing their
parents' KV blocks through the prefix cache, exactly as `LLM.beam_search`.  The `n` beams come back ranked
(best first) by cum_logprob / len**length_penalty.  With stream, the response starts at once and the beams go out
as chunks when the search ends (as vLLM streams a beam search: its beams are known only at the end)."""
from __future__ import annotations

from pagedserve.engine.beam_search import BeamSearch
from pagedserve.entrypoints.openai.errors import BadRequest
from pagedserve.entrypoints.openai.protocol import _SamplingFields
from pagedserve.entrypoints.openai.serving_engine import OpenAIServing, merge_streams
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import BeamSearchOutput
from pagedserve.sampling_params import BeamSearchParams

# What a beam-search request may set besides its prompt: the search is deterministic and returns text only.
BEAM_SEARCH_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "ignore_eos", "length_penalty",
    "use_beam_search", "temperature", "cache_salt", "priority", "user", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "stream", "stream_options"})


def check_beam_search_request(req: _SamplingFields) -> None:
    """400 naming the first field beam search cannot honour."""
    for name in sorted(req.model_fields_set - BEAM_SEARCH_FIELDS):
        if getattr(req, name) != type(req).model_fields[name].default:
            raise BadRequest(f"{name} is not supported with use_beam_search.", param=name,
                             code="unsupported_parameter")
    if req.temperature:
        raise BadRequest("use_beam_search is deterministic: temperature must be 0 or unset.", param="temperature",
                         code="unsupported_parameter")


def plan_beam_search(serving: OpenAIServing, prompts: list[list[int]], req: _SamplingFields,
                     max_tokens: int | None) -> BeamSearch:
    """The search over `prompts`, `req.n` beams each (max_tokens None: up to max_model_len); a 400 for what it
    cannot run, before anything is sent."""
    config = serving.engine_client.config.model
    try:
        serving.input_processor.check_beam_width(req.n)
    except InvalidRequestError as exc:
        raise BadRequest(f"use_beam_search: n is the beam width; {exc}", param="n") from None
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = config.max_model_len - longest
    if longest + max_tokens > config.max_model_len:  # a later step would be refused half-way
        raise BadRequest(f"The prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds max_model_len "
                         f"({config.max_model_len}).", param="max_tokens")
    params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                              length_penalty=req.length_penalty)
    return BeamSearch(prompts, params, config.eos_token_ids, config.vocab_size)


async def run_beam_search(serving: OpenAIServing, request_id: str, search: BeamSearch, req: _SamplingFields,
                          prompt_param: str) -> list[BeamSearchOutput]:
    step = 0
    while live := search.live_prompts():
        streams = await serving.submit(f"{request_id}-beam{step}", live, search.step_params, req, prompt_param)
        outputs: list = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                outputs[i] = out
        finally:
            serving.abort_streams(streams)  # a gone client: the step's requests end at once
        search.advance(outputs)
        step += 1
    return search.results(serving.tokenizer)
