"""POST /v1/chat/completions: messages (and tools) -> tokenizer.apply_chat_template(add_generation_prompt=True)
-> one engine request with n samples; tool calls per entrypoints/openai/tool_calls.py."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedserve.engine.request_stream import RequestStream
from pagedserve.entrypoints.openai.direct_write import ChunkPush
from pagedserve.entrypoints.openai.errors import BadRequest, exception_to_openai, sse_error
from pagedserve.entrypoints.openai.protocol import (ChatCompletionLogProbs, ChatCompletionRequest,
                                                    ChatCompletionResponse, ChatCompletionResponseChoice,
                                                    ChatCompletionStreamChoice, ChatCompletionStreamResponse,
                                                    ChatResponseMessage, DeltaFunctionCall, DeltaMessage,
                                                    DeltaToolCall, PromptTokensDetails, UsageInfo)
from pagedserve.entrypoints.openai.serving_engine import (SSE_DONE, ChoiceState, OpenAIServing, SSEResponse,
                                                          chat_logprobs, vllm_prompt_logprobs,
                                                          merge_streams, new_request_id, run_unless_disconnected)
from pagedserve.entrypoints.openai.sse import StreamChunkEncoder
from pagedserve.entrypoints.openai.serving_beam_search import (check_beam_search_request, plan_beam_search,
                                                               run_beam_search)
from pagedserve.entrypoints.openai.reasoning import REASONING_PARSERS, make_reasoning_parser
from pagedserve.entrypoints.openai.tool_calls import (ToolPlan, extract_tool_calls, make_tool_call_parser, plan_tools,
                                                      template_tools)
from pagedserve.errors import InvalidRequestError
from pagedserve.metrics.server_profile import ServerProfile
from pagedserve.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 constrain_reasoning: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_call_parser = tool_call_parser  # set with --enable-auto-tool-choice --tool-call-parser
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: reasoning_content split off the content
        self.constrain_reasoning = constrain_reasoning  # vLLM's enable_in_reasoning: constraints hold from token one

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request | None = None):
        push = ChunkPush(self.engine_client.profile)
        result = await self.generate_chat(req, raw_request, encoded_text_chunks=True, push=push)
        if isinstance(result, ChatCompletionResponse):
            return JSONResponse(result.model_dump())
        chunks, close = result
        return SSEResponse(sse_chunks(chunks, self.engine_client.profile), on_close=close,
                           profile=self.engine_client.profile, push=push)

    async def generate_chat(self, req: ChatCompletionRequest, raw_request: Request | None = None,
                            encoded_text_chunks: bool = False, push: ChunkPush | None = None
                            ) -> ChatCompletionResponse | tuple[AsyncIterator[ChatCompletionStreamResponse | str],
                                                                Callable[[], None]]:
        """The whole response, or with stream (chunks, a callback that aborts the request however the stream
        ends): what /v1/chat/completions sends and /v1/responses translates. With encoded_text_chunks, a chunk
        of content alone comes as its SSE line (sse.py), without a pydantic model; with push, the chunks after the
        first output may be written from the engine's delivery callback (direct_write.ChunkPush)."""
        lora_request = self.check_model(req.model)
        if req.use_beam_search:
            check_beam_search_request(req)
            if lora_request is not None:  # the search's steps run on the base model
                raise BadRequest("use_beam_search is not supported with a LoRA adapter.", param="model")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs=true.", param="top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise BadRequest("stream_options is only allowed with stream=true.", param="stream_options")
        if (req.max_tokens is not None and req.max_completion_tokens is not None
                and req.max_tokens != req.max_completion_tokens):
            raise BadRequest("max_tokens and max_completion_tokens disagree; send only max_completion_tokens.",
                             param="max_tokens")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, requested, num_top)
        if self.reasoning_parser is not None and REASONING_PARSERS[self.reasoning_parser].needs_special_tokens:
            params.skip_special_tokens = False  # the channel markers are special tokens
        plan = plan_tools(req, self.tool_call_parser)
        if plan.constraint is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError(f"Give one output constraint: tool_choice {plan.mode!r} constrains the "
                                          f"output already.", param="tool_choice")
            params.structured_outputs = plan.constraint
        reasoner = make_reasoning_parser(self.reasoning_parser, req.chat_template_kwargs)
        if params.structured_outputs is not None and reasoner is not None and reasoner.thinking and \
                not self.constrain_reasoning:
            # as vLLM: the constraint applies once the thinking ends (gpt_oss: once the final channel opens)
            marker = reasoner.spec.content_start or reasoner.spec.end
            params.structured_outputs = dataclasses.replace(params.structured_outputs, start_after_token_ids=tuple(
                self.tokenizer.encode(marker, add_special_tokens=False)))
        _, prompt = await self.encode_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                           req.chat_template_kwargs,
                                           tools=template_tools(req) if plan.mode != "none" or req.tools else None)
        if not prompt:
            raise BadRequest("The messages render to zero tokens.", param="messages")
        if params.truncate_prompt_tokens is not None:  # here too, so that usage counts what runs
            prompt = self.input_processor.truncate_prompt(prompt, params.truncate_prompt_tokens)
        request_id = new_request_id("chatcmpl")
        created = int(time.time())
        model = req.model if lora_request is not None else self.served_model_name
        if req.use_beam_search:
            return await self._beam_search(req, raw_request, request_id, prompt, requested)
        streams = await self.submit(request_id, [prompt], params, req, prompt_param="messages",
                                    lora_request=lora_request)
        if req.stream:
            return (self._stream(req, plan, request_id, created, model, prompt, streams[0], encoded_text_chunks,
                                 push),
                    lambda: self.abort_streams(streams))
        return await run_unless_disconnected(raw_request, self._full(req, plan, request_id, created, model, prompt,
                                                                      streams[0]),
                                             lambda: self.abort_streams(streams))

    async def _beam_search(self, req: ChatCompletionRequest, raw_request: Request | None, request_id: str,
                           prompt: list[int], max_tokens: int | None):
        """use_beam_search: the n beams as n choices, best first (streamed: one chunk each when the search ends)."""
        search = plan_beam_search(self, [prompt], req, max_tokens)
        created = int(time.time())

        def usage(sequences) -> UsageInfo:
            completion_tokens = sum(len(seq.logprobs) for seq in sequences)
            return UsageInfo(prompt_tokens=len(prompt), completion_tokens=completion_tokens,
                             total_tokens=len(prompt) + completion_tokens)

        async def chunks() -> AsyncIterator[ChatCompletionStreamResponse]:
            sequences = (await run_beam_search(self, request_id, search, req, "messages"))[0].sequences
            for rank, seq in enumerate(sequences):
                yield ChatCompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                   choices=[ChatCompletionStreamChoice(
                                                       index=rank, delta=DeltaMessage(role="assistant", content=seq.text),
                                                       finish_reason=seq.finish_reason)])
            if req.stream_options and req.stream_options.include_usage:
                yield ChatCompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                   choices=[], usage=usage(sequences))

        if req.stream:
            return chunks(), lambda: None  # the search aborts its step requests itself
        sequences = (await run_unless_disconnected(raw_request, run_beam_search(self, request_id, search, req,
                                                                                "messages"), lambda: None))[0].sequences
        choices = [ChatCompletionResponseChoice(index=rank, message=ChatResponseMessage(content=seq.text),
                                                finish_reason=seq.finish_reason)
                   for rank, seq in enumerate(sequences)]
        return ChatCompletionResponse(id=request_id, created=created, model=self.served_model_name, choices=choices,
                                      usage=usage(sequences))

    def _tool_calls(self, plan: ToolPlan, st: ChoiceState, text: str) -> tuple[str | None, list, str | None]:
        """-> (content, tool calls, finish reason) of a finished choice whose content text is `text`."""
        if plan.mode in ("none",) or st.finish_reason not in ("stop", "length"):
            return text, [], st.finish_reason
        content, calls = extract_tool_calls(plan, text, self.tool_call_parser)
        return content, calls, "tool_calls" if calls and st.finish_reason == "stop" else st.finish_reason

    async def _full(self, req: ChatCompletionRequest, plan: ToolPlan, request_id: str, created: int, model: str,
                    prompt: list[int], stream: RequestStream) -> ChatCompletionResponse:
        states = [ChoiceState(index=i) for i in range(req.n)]
        cached = 0
        prompt_logprobs = None
        try:
            async for _, out in merge_streams([stream]):
                prompt_logprobs = out.prompt_logprobs or prompt_logprobs
                for c in out.outputs:
                    states[c.index].add(c)
                if out.finished:
                    cached = out.num_cached_tokens or 0
        finally:
            self.abort_streams([stream])
        num_top = req.top_logprobs or 0
        choices = []
        for st in states:
            reasoning, text = None, st.text
            if (reasoner := make_reasoning_parser(self.reasoning_parser, req.chat_template_kwargs)) is not None:
                split = reasoner.split(st.text)
                reasoning, text = split.reasoning or None, split.content
            content, calls, finish = self._tool_calls(plan, st, text)
            choices.append(ChatCompletionResponseChoice(
                index=st.index, message=ChatResponseMessage(role="assistant", content=content,
                                                            reasoning_content=reasoning, tool_calls=calls),
                logprobs=ChatCompletionLogProbs(content=chat_logprobs(self.tokenizer, st.token_ids, st.logprobs,
                                                                      num_top)) if req.logprobs else None,
                finish_reason=finish, stop_reason=st.stop_reason))
        completion_tokens = sum(len(st.token_ids) for st in states)
        usage = UsageInfo(prompt_tokens=len(prompt), completion_tokens=completion_tokens,
                          total_tokens=len(prompt) + completion_tokens,
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage,
                                      prompt_logprobs=vllm_prompt_logprobs(self.tokenizer, prompt_logprobs))

    async def _stream(self, req: ChatCompletionRequest, plan: ToolPlan, request_id: str, created: int, model: str,
                      prompt: list[int], stream: RequestStream, encoded_text_chunks: bool = False,
                      push: ChunkPush | None = None) -> AsyncIterator[ChatCompletionStreamResponse | str]:
        """Content and tool calls stream as the text grows, through the same parser as the non-streamed answer
        (tool_calls.py), so the concatenated deltas always equal it: a named or required call's arguments stream
        piece by piece (the first piece carries id and name); an "auto" call goes out whole once closed."""
        states = [ChoiceState(index=i) for i in range(req.n)]
        parsers = [make_tool_call_parser(plan, self.tool_call_parser) for _ in states]
        reasoners = [make_reasoning_parser(self.reasoning_parser, req.chat_template_kwargs) for _ in states]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        num_top = req.top_logprobs or 0
        cached = 0
        profile = self.engine_client.profile
        encoder = StreamChunkEncoder("chat.completion.chunk", request_id, created, model)
        prompt_logprobs = None  # vLLM's shape, sent once, with the first chunk after the prefill computed them

        def chunk(choice: ChatCompletionStreamChoice) -> ChatCompletionStreamResponse:
            nonlocal prompt_logprobs
            resp = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice],
                                                prompt_logprobs=prompt_logprobs)
            prompt_logprobs = None
            if continuous:
                done = sum(len(s.token_ids) for s in states)
                resp.usage = UsageInfo(prompt_tokens=len(prompt), completion_tokens=done,
                                       total_tokens=len(prompt) + done)
            return resp

        def render(out: RequestOutput) -> list[ChatCompletionStreamResponse | str]:
            """The chunks of one output (and the choices' state after it)."""
            nonlocal prompt_logprobs, cached
            chunks: list[ChatCompletionStreamResponse | str] = []
            if out.prompt_logprobs is not None:
                prompt_logprobs = vllm_prompt_logprobs(self.tokenizer, out.prompt_logprobs)
            for c in out.outputs:
                st = states[c.index]
                st.token_ids.extend(c.token_ids)
                st.text += c.text
                if c.finish_reason is not None:
                    st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
                reasoning, text = "", c.text
                if (reasoner := reasoners[c.index]) is not None:  # reasoning first; the rest is content
                    split = reasoner.feed(c.text, final=c.finish_reason is not None)
                    reasoning, text = split.reasoning, split.content
                deltas = parsers[c.index].feed(text)
                if c.finish_reason is not None:
                    deltas += parsers[c.index].finish()
                if not deltas.content and not deltas.calls and not reasoning and c.finish_reason is None \
                        and not (req.logprobs and c.token_ids):
                    continue
                finish = c.finish_reason
                if finish == "stop" and parsers[c.index].num_calls:
                    finish = "tool_calls"
                if encoded_text_chunks and not (req.logprobs or continuous or deltas.calls or reasoning
                                                or prompt_logprobs):  # content alone: no models
                    t = time.perf_counter()
                    chunks.append(encoder.chat(st.index, deltas.content or None, finish, c.stop_reason))
                    profile.record_chunk(time.perf_counter() - t)
                    continue
                logprobs = None
                if req.logprobs:
                    logprobs = ChatCompletionLogProbs(
                        content=chat_logprobs(self.tokenizer, c.token_ids, c.logprobs or [], num_top))
                calls = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                                       function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
                         for d in deltas.calls]
                chunks.append(chunk(ChatCompletionStreamChoice(
                    index=st.index, delta=DeltaMessage(content=deltas.content or None, reasoning_content=reasoning or None,
                                                  tool_calls=calls or None),
                    logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason)))
            if out.finished:
                cached = out.num_cached_tokens or 0
            return chunks

        try:
            # OpenAI's first chunk per choice: the role, empty content.
            for st in states:
                yield chunk(ChatCompletionStreamChoice(index=st.index, delta=DeltaMessage(role="assistant", content="")))
            if push is not None:
                push.attach(stream, lambda out: [sse_event(c, profile) for c in render(out)])
            async for _, out in merge_streams([stream]):
                for c in render(out):
                    yield c
            if include_usage:
                completion_tokens = sum(len(s.token_ids) for s in states)
                final = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=UsageInfo(prompt_tokens=len(prompt), completion_tokens=completion_tokens,
                                    total_tokens=len(prompt) + completion_tokens,
                                    prompt_tokens_details=PromptTokensDetails(cached_tokens=cached)))
                yield final
        finally:
            self.abort_streams([stream])


async def sse_chunks(chunks: AsyncIterator[ChatCompletionStreamResponse | str],
                     profile: ServerProfile) -> AsyncIterator[str]:
    """Chat chunks as Server-Sent Events (a chunk already encoded passes as it is), ending with [DONE]; an engine
    failure or shutdown mid-stream becomes an error event (the status line went out as 200)."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk, profile)
        yield SSE_DONE
    except Exception as exc:
        yield sse_error(exception_to_openai(exc))
        yield SSE_DONE
    finally:
        await chunks.aclose()


def sse_event(chunk: ChatCompletionStreamResponse | str, profile: ServerProfile) -> str:
    """One chat chunk as its SSE event (a chunk already encoded passes as it is)."""
    if isinstance(chunk, str):
        return chunk
    t = time.perf_counter()
    data = f"data: {chunk.model_dump_json()}\n\n"
    profile.record_chunk(time.perf_counter() - t)
    return data
