"""POST /v1/completions: one engine request per prompt, choices indexed prompt_idx * n + sample index."""
from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedserve.entrypoints.openai.errors import BadRequest, exception_to_openai, sse_error
from pagedserve.errors import InvalidRequestError
from pagedserve.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                    CompletionResponseChoice, CompletionStreamChoice,
                                                    CompletionStreamResponse, PromptTokensDetails, UsageInfo)
from pagedserve.entrypoints.openai.direct_write import ChunkPush
from pagedserve.entrypoints.openai.sse import StreamChunkEncoder
from pagedserve.entrypoints.openai.serving_engine import (SSE_DONE, ChoiceState, OpenAIServing, SSEResponse,
                                                          completion_logprobs, merge_streams, new_request_id,
                                                          run_unless_disconnected, vllm_prompt_logprobs)
from pagedserve.engine.request_stream import RequestStream
from pagedserve.outputs import RequestOutput
from pagedserve.entrypoints.openai.serving_beam_search import (check_beam_search_request, plan_beam_search,
                                                               run_beam_search)


class OpenAIServingCompletion(OpenAIServing):
    async def prepare(self, req: CompletionRequest) -> tuple[list[str], list[list[int]]]:
        """-> (prompt texts for echo, prompt token ids). Text is tokenized here; the engine validates."""
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            prompts: list = [p]
        else:
            prompts = list(p)
        # Before any tokenizing: refuse 1,000 prompts x n=128 at once.
        self.input_processor.check_num_sequences(len(prompts), max(req.n, req.best_of or 0))
        if not prompts:
            raise InvalidRequestError("prompt must not be empty.", param="prompt")
        texts, token_ids = [], []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                if not prompt:
                    raise InvalidRequestError(f"{param} must not be empty.", param=param)
                tokens = await self.encode(prompt)
            else:
                tokens = list(prompt)
                self.input_processor.check_token_ids(tokens, param)
                prompt = self.tokenizer.decode(tokens) if req.echo else ""
            if not tokens:
                raise InvalidRequestError(f"{param} tokenizes to zero tokens.", param=param)
            texts.append(prompt)
            token_ids.append(tokens)
        return texts, token_ids

    async def create_completion(self, req: CompletionRequest, raw_request: Request | None = None):
        lora_request = self.check_model(req.model)
        if req.use_beam_search:
            check_beam_search_request(req)
            if lora_request is not None:  # the search's steps run on the base model
                raise BadRequest("use_beam_search is not supported with a LoRA adapter.", param="model")
            return await self._beam_search(req, raw_request)
        best_of = req.best_of or req.n
        if best_of < req.n:
            raise BadRequest(f"best_of ({best_of}) must be >= n ({req.n}).", param="best_of")
        if best_of > req.n and req.stream:
            raise BadRequest("best_of > n cannot be streamed (the best are known only at the end).",
                             param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise BadRequest("max_tokens must be >= 1 (0 only with echo).", param="max_tokens")
        if req.stream_options is not None and not req.stream:
            raise BadRequest("stream_options is only allowed with stream=true.", param="stream_options")
        # max_tokens=null: up to max_model_len; 0 (echo: score the prompt, as lm-evaluation-harness asks) samples
        # one token that the response leaves out
        params = self.sampling_params(req, req.max_tokens or (1 if req.max_tokens == 0 else None), req.logprobs)
        if req.echo and req.logprobs is not None:  # the echoed prompt tokens carry their logprobs too
            params.prompt_logprobs = max(params.prompt_logprobs or 0, req.logprobs)
        if best_of > req.n:  # ranked by cumulative logprob: every sample needs its tokens' logprobs
            params = dataclasses.replace(params, n=best_of, logprobs=params.logprobs or 0)
        texts, prompts = await self.prepare(req)
        if params.truncate_prompt_tokens is not None:  # here too, so that usage and echo count what runs
            prompts = [self.input_processor.truncate_prompt(p, params.truncate_prompt_tokens) for p in prompts]
            texts = [self.tokenizer.decode(p) for p in prompts] if req.echo else texts
        request_id = new_request_id("cmpl")
        created = int(time.time())
        model = req.model if lora_request is not None else self.served_model_name
        streams = await self.submit(request_id, prompts, params, req, lora_request=lora_request)
        if req.stream:
            push = ChunkPush(self.engine_client.profile)
            gen = self._stream(req, request_id, created, model, texts, prompts, streams, push)
            return SSEResponse(gen, on_close=lambda: self.abort_streams(streams), profile=self.engine_client.profile,
                               push=push)
        return await run_unless_disconnected(
            raw_request, self._full(req, request_id, created, model, texts, prompts, streams),
            lambda: self.abort_streams(streams))

    async def _beam_search(self, req: CompletionRequest, raw_request: Request | None):
        """use_beam_search: the n beams of each prompt, best first, indexed prompt_idx * n + rank."""
        _, prompts = await self.prepare(req)
        search = plan_beam_search(self, prompts, req, req.max_tokens)
        request_id = new_request_id("cmpl")
        created = int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)

        def choices_and_usage(results) -> tuple[list[CompletionResponseChoice], UsageInfo]:
            choices = [CompletionResponseChoice(index=p * req.n + rank, text=seq.text, finish_reason=seq.finish_reason)
                       for p, result in enumerate(results) for rank, seq in enumerate(result.sequences)]
            completion_tokens = sum(len(seq.logprobs) for result in results for seq in result.sequences)
            return choices, UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                       total_tokens=prompt_tokens + completion_tokens)

        async def stream() -> AsyncIterator[str]:
            try:
                choices, usage = choices_and_usage(await run_beam_search(self, request_id, search, req, "prompt"))
                for c in choices:
                    chunk = CompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                     choices=[CompletionStreamChoice(
                                                         index=c.index, text=c.text, finish_reason=c.finish_reason)])
                    yield f"data: {chunk.model_dump_json()}\n\n"
                if req.stream_options and req.stream_options.include_usage:
                    final = CompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                     choices=[], usage=usage)
                    yield f"data: {final.model_dump_json()}\n\n"
                yield SSE_DONE
            except Exception as exc:
                yield sse_error(exception_to_openai(exc))
                yield SSE_DONE

        if req.stream:
            return SSEResponse(stream(), on_close=lambda: None,  # the search aborts its step requests itself
                               profile=self.engine_client.profile)
        choices, usage = choices_and_usage(await run_unless_disconnected(
            raw_request, run_beam_search(self, request_id, search, req, "prompt"), lambda: None))
        return JSONResponse(CompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                               choices=choices, usage=usage).model_dump())

    # -------------------------------------------------------------------------------- non-streaming
    async def _full(self, req: CompletionRequest, request_id: str, created: int, model: str, texts: list[str],
                    prompts: list[list[int]], streams: list[RequestStream]) -> JSONResponse:
        n = req.best_of or req.n
        states = [ChoiceState(index=i) for i in range(len(prompts) * n)]
        prompt_lps: list = [None] * len(prompts)
        cached = 0
        try:
            async for idx, out in merge_streams(streams):
                if out.prompt_logprobs is not None:
                    prompt_lps[idx] = out.prompt_logprobs
                for c in out.outputs:
                    if req.max_tokens == 0:  # echo only: the one sampled token is not part of the answer
                        c = dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs else c.logprobs)
                    states[idx * n + c.index].add(c)
                if out.finished:
                    cached += out.num_cached_tokens or 0
        finally:
            self.abort_streams(streams)
        if n > req.n:
            states = best_states(states, n, req.n)
            n = req.n
        choices = []
        for st in states:
            prompt_idx = st.index // n
            text = (texts[prompt_idx] + st.text) if req.echo else st.text
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._logprobs(req, prompts[prompt_idx], prompt_lps[prompt_idx], st.token_ids,
                                          st.logprobs, 0)[0]
            choices.append(CompletionResponseChoice(
                index=st.index, text=text, logprobs=logprobs, finish_reason=st.finish_reason,
                stop_reason=st.stop_reason,
                prompt_logprobs=vllm_prompt_logprobs(self.tokenizer, prompt_lps[prompt_idx])
                if req.prompt_logprobs is not None else None))
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(st.token_ids) for st in states)  # the returned ones, as vLLM counts
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens,
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        resp = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
        return JSONResponse(resp.model_dump())

    def _logprobs(self, req: CompletionRequest, prompt: list[int] | None, prompt_logprobs: list | None,
                  token_ids: list[int], steps: list, offset: int) -> tuple[CompletionLogProbs, int]:
        """OpenAI's legacy logprobs of the output tokens, preceded with echo by the prompt's (given `prompt`)."""
        if req.echo and prompt is not None and prompt_logprobs is not None:
            token_ids, steps = prompt + list(token_ids), list(prompt_logprobs) + list(steps)
        return completion_logprobs(self.tokenizer, token_ids, steps, req.logprobs, offset)

    # ------------------------------------------------------------------------------------ streaming
    async def _stream(self, req: CompletionRequest, request_id: str, created: int, model: str, texts: list[str],
                      prompts: list[list[int]], streams: list[RequestStream],
                      push: ChunkPush | None = None) -> AsyncIterator[str]:
        n = req.n
        states = [ChoiceState(index=i) for i in range(len(prompts) * n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        prompt_tokens = sum(len(p) for p in prompts)
        prompt_lps: list = [None] * len(prompts)  # sent once per request; each of its n choices needs them
        cached = 0
        profile = self.engine_client.profile
        encoder = StreamChunkEncoder("text_completion", request_id, created, model)
        # chunks of text alone (no logprobs or usage in them) skip the pydantic models
        text_only = req.logprobs is None and req.prompt_logprobs is None and not continuous

        def render(idx: int, out: RequestOutput) -> list[str]:
            """The SSE events of one output of prompt `idx` (and the choices' state after it)."""
            nonlocal cached
            events = []
            if out.prompt_logprobs is not None:
                prompt_lps[idx] = out.prompt_logprobs
            for c in out.outputs:
                st = states[idx * n + c.index]
                if req.max_tokens == 0:  # echo only: the one sampled token is not part of the answer
                    c = dataclasses.replace(c, text="", token_ids=[], logprobs=[])
                delta = c.text
                first = req.echo and not st.started
                if first:
                    delta = texts[idx] + delta
                st.token_ids.extend(c.token_ids)
                if c.finish_reason is not None:
                    st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
                if not delta and c.finish_reason is None and not (req.logprobs is not None and c.token_ids):
                    continue  # nothing to say yet (e.g. text held back while matching a stop string)
                t = time.perf_counter()
                st.started = True
                if text_only:
                    events.append(encoder.completion(st.index, delta, c.finish_reason, c.stop_reason))
                    profile.record_chunk(time.perf_counter() - t)
                    continue
                logprobs = None
                if req.logprobs is not None:
                    logprobs, st.text_offset = self._logprobs(
                        req, prompts[idx] if first else None, prompt_lps[idx], c.token_ids, c.logprobs or [],
                        st.text_offset)
                choice = CompletionStreamChoice(index=st.index, text=delta, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                if req.prompt_logprobs is not None and prompt_lps[idx] is not None and not st.sent_prompt:
                    choice.prompt_logprobs = vllm_prompt_logprobs(self.tokenizer, prompt_lps[idx])
                    st.sent_prompt = True
                chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
                if continuous:
                    done = sum(len(s.token_ids) for s in states)
                    chunk.usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=done,
                                            total_tokens=prompt_tokens + done)
                events.append(f"data: {chunk.model_dump_json()}\n\n")
                profile.record_chunk(time.perf_counter() - t)
            if out.finished:
                cached += out.num_cached_tokens or 0
            return events

        try:
            if push is not None and len(streams) == 1:  # several prompts: their outputs merge in this task
                push.attach(streams[0], lambda out: render(0, out))
            async for idx, out in merge_streams(streams):
                for data in render(idx, out):
                    yield data
            if include_usage:
                completion_tokens = sum(len(s.token_ids) for s in states)
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens,
                                  prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
                final = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                 usage=usage)
                yield f"data: {final.model_dump_json()}\n\n"
            yield SSE_DONE
        except Exception as exc:  # the engine failed this request / server shutting down
            yield sse_error(exception_to_openai(exc))
            yield SSE_DONE
        finally:
            self.abort_streams(streams)  # no-op when all finished; frees KV at once on disconnect


def best_states(states: list[ChoiceState], best_of: int, n: int) -> list[ChoiceState]:
    """best_of: per prompt, the n of its best_of samples with the highest cumulative logprob, best first, indexed
    prompt_idx * n + rank."""
    best = []
    for start in range(0, len(states), best_of):
        group = sorted(states[start:start + best_of], key=lambda st: -sum(
            step[t].logprob for t, step in zip(st.token_ids, st.logprobs)))[:n]
        for rank, st in enumerate(group):
            best.append(dataclasses.replace(st, index=start // best_of * n + rank))
    return best
