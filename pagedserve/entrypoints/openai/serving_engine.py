"""What /v1/completions and /v1/chat/completions share: model check, tokenization, chat rendering,
SamplingParams, submitting several engine requests at once, merging their streams, logprob shapes,
and finishing a non-streaming request early when its client goes away.

Validation is the engine's (its InputProcessor, reached through the EngineClient protocol): this layer only
turns HTTP fields into engine inputs; typed errors become 4xx in errors.py."""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.engine.request_stream import RequestStream
from pagedserve.engine.input_processor import render_chat
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai.direct_write import ChunkPush, body_writer
from pagedserve.entrypoints.openai.errors import OpenAIError
from pagedserve.entrypoints.openai.tool_calls import template_message
from pagedserve.entrypoints.openai.protocol import (ChatLogProb, ChatLogProbsContent, CompletionLogProbs,
                                                    _SamplingFields)
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.errors import InvalidRequestError
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics.server_profile import ServerProfile
from pagedserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedserve.api")
T = TypeVar("T")

# Prompts above this many characters are tokenized in a worker thread, not on the event loop.
_TOKENIZE_INLINE_CHARS = 8192


class SSEResponse(StreamingResponse):
    """text/event-stream response that aborts its engine requests however it ends.

    The generator's own `finally` covers cancellation mid-stream; this also covers a client that
    disconnects before the generator was first iterated (an unstarted generator has no finally to run).
    Under uvicorn's h11 protocol the body's chunks go straight to the connection (direct_write.py), with `push`
    from the engine's delivery callback while the client keeps up; the start and the end go through ASGI send.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], profile: ServerProfile,
                 push: ChunkPush | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close
        self._profile = profile
        self._push = push  # given: the generator may write its chunks from the engine's delivery (ChunkPush)
        self._scope: dict = {}

    async def __call__(self, scope, receive, send) -> None:
        self._scope = scope
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    async def stream_response(self, send) -> None:
        profile = self._profile
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        writer = body_writer(self._scope)
        if self._push is not None:
            self._push.writer = writer
        async for chunk in self.body_iterator:
            data = chunk.encode() if isinstance(chunk, str) else chunk
            t = time.perf_counter()  # each chunk's HTTP framing and socket write
            if writer is not None:
                await writer.write(data)
            else:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            profile.record_send(time.perf_counter() - t)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ClientDisconnected(Exception):
    """The HTTP client went away before its (non-streaming) response was ready."""


def clamp_logprob(value: float) -> float:
    """JSON has no -inf: OpenAI (and vLLM) clamp to -9999.0."""
    if value is None or math.isnan(value):
        return -9999.0
    return max(value, -9999.0)


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceState:
    """Accumulates one choice (one sample of one prompt) across outputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # running character offset (completion logprobs)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    started: bool = False  # streaming: first chunk sent
    sent_prompt: bool = False  # streaming: prompt_logprobs sent (with the first chunk that has them)

    def add(self, delta: CompletionOutput) -> None:
        """Append one DELTA output of this choice."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class OpenAIServing:
    # set by build_app from `serve`: --served-model-name's other names, and --chat-template (text) if given
    served_model_aliases: frozenset[str] = frozenset()
    chat_template: str | None = None
    default_sampling: dict[str, Any] = {}  # --generation-config: defaults for fields a request leaves unset
    models: Any = None  # serving_models.OpenAIServingModels where LoRA is enabled: adapter names resolve there

    def __init__(self, engine_client: EngineClient, served_model_name: str, log_requests: bool = False) -> None:
        self.engine_client = engine_client
        self.served_model_name = served_model_name
        self.log_requests = log_requests

    @property
    def tokenizer(self) -> Any:
        return self.engine_client.tokenizer

    @property
    def input_processor(self):
        return self.engine_client.input_processor

    # ------------------------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a model this server does not serve."""
        if model is not None and model != self.served_model_name and model not in self.served_model_aliases:
            if self.models is not None and self.models.enable_lora:
                return self.models.resolve(model)
            raise OpenAIError(404, f"The model `{model}` does not exist. This server serves "
                                   f"`{self.served_model_name}`.", param="model", code="model_not_found")

    # ------------------------------------------------------------------------------ tokenizing
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Same call as the engine's tokenize (tokenizer.encode), off the event loop for long inputs."""
        if len(text) > _TOKENIZE_INLINE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def encode_chat(self, messages: list[Any], add_generation_prompt: bool = True,
                          continue_final_message: bool = False,
                          chat_template_kwargs: dict[str, Any] | None = None,
                          add_special_tokens: bool = False,
                          tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        text = render_chat(self.tokenizer, [template_message(m) for m in messages],
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           chat_template=self.chat_template, chat_template_kwargs=chat_template_kwargs, tools=tools)
        # The template already has BOS & co: like vLLM, do not add special tokens again.
        return text, await self.encode(text, add_special_tokens=add_special_tokens)

    # ------------------------------------------------------------------------- sampling params
    def sampling_params(self, req: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """HTTP fields -> SamplingParams (its own range checks raise InvalidRequestError naming the field);
        max_tokens None: the engine resolves it from max_model_len and the KV pool."""
        unset = {k: v for k, v in self.default_sampling.items() if k not in req.model_fields_set}
        if unset:
            req = req.model_copy(update=unset)
        top_k = req.top_k if req.top_k is not None else 0
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if top_k == -1 else top_k,
            min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs(req), logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, prompt_logprobs=req.prompt_logprobs,
            truncate_prompt_tokens=req.truncate_prompt_tokens)

    # ------------------------------------------------------------------------------ submitting
    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams | list,
                     req: _SamplingFields, prompt_param: str = "prompt",
                     lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Add one engine request per prompt (params: for all, or a list with one per prompt); all or nothing (a
        rejection aborts the accepted ones)."""
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        if self.log_requests:
            logger.info("Received request %s: prompts=%d, prompt_tokens=%s, params=%s, user=%r", request_id,
                        len(prompts), [len(p) for p in prompts], params, req.user)
        tasks = [asyncio.ensure_future(self.engine_client.add_request(
                     rid, p, params[i] if isinstance(params, list) else params, priority=req.priority,
                     cache_salt=req.cache_salt,
                     prompt_param=prompt_param if len(prompts) == 1 else f"{prompt_param}[{i}]",
                     lora_request=lora_request))
                 for i, (rid, p) in enumerate(zip(ids, prompts))]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            self.engine_client.abort_nowait(ids)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.engine_client.abort_nowait([rid for rid, r in zip(ids, results) if not isinstance(r, BaseException)])
            raise errors[0]
        return list(results)  # type: ignore[arg-type]

    def abort_streams(self, streams: list[RequestStream]) -> None:
        live = [s.request_id for s in streams if not s.closed]
        if live:
            self.engine_client.abort_nowait(live)


def structured_outputs(req: _SamplingFields) -> StructuredOutputsParams | None:
    """OpenAI's response_format, vLLM's structured_outputs or the older guided_* fields -> one constraint."""
    sources: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        sources.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema.",
                                      param="response_format.json_schema")
        sources.append(("response_format", {"json": fmt.json_schema.schema_}))
    so = req.structured_outputs
    if so is not None:
        sources.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                               "grammar": so.grammar, "json_object": so.json_object,
                                               "disable_any_whitespace": so.disable_any_whitespace}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            sources.append((name, {kind: getattr(req, name)}))
    if not sources:
        return None
    if len(sources) > 1:
        raise InvalidRequestError(f"Give one output constraint; got {[name for name, _ in sources]}.",
                                  param=sources[1][0])
    source, kwargs = sources[0]
    return StructuredOutputsParams(**kwargs, source=source)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as outputs arrive: yields (stream index, output)."""
    if len(streams) == 1:
        s = streams[0]
        while not s.finished:
            yield 0, await s.get()
        return
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending.keys(), return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f]):
                i = pending.pop(fut)
                out = fut.result()  # raises the request's error
                if not streams[i].finished:
                    pending[asyncio.ensure_future(streams[i].get())] = i
                yield i, out
    finally:
        for fut in pending:
            fut.cancel()


async def wait_for_disconnect(raw_request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(raw_request: Request | None, coro: Awaitable[T],
                                  on_disconnect: Callable[[], None]) -> T:
    """Await `coro`; if the client goes away first, cancel it, call on_disconnect (abort) and raise."""
    task = asyncio.ensure_future(coro)
    if raw_request is None:
        return await task
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        on_disconnect()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    on_disconnect()
    raise ClientDisconnected()


# ------------------------------------------------------------------------------------- logprobs
def _decoded(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _ranked(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    items = sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                  -kv[1].logprob))
    return items[:k]


def completion_logprobs(tokenizer: Any, token_ids: list[int], steps: list[dict[int, Logprob]], num_top: int,
                        initial_offset: int) -> tuple[CompletionLogProbs, int]:
    """OpenAI completions format; returns it and the text offset after the last token."""
    out = CompletionLogProbs()
    offset = initial_offset
    for tid, step in zip(token_ids, steps):
        if step is None:  # the first prompt token (echo): no logprob, as in OpenAI's legacy format
            token = tokenizer.decode([tid])
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(token)
            continue
        lp = step.get(tid)
        token = _decoded(tokenizer, tid, lp)
        out.tokens.append(token)
        out.token_logprobs.append(clamp_logprob(lp.logprob) if lp is not None else None)
        top: dict[str, float] = {}
        for t, l in _ranked(step, num_top):
            top.setdefault(_decoded(tokenizer, t, l), clamp_logprob(l.logprob))
        if lp is not None:  # the sampled token is always there (so up to num_top + 1 entries)
            top.setdefault(token, clamp_logprob(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def vllm_prompt_logprobs(tokenizer: Any, prompt_logprobs: list[dict[int, Logprob] | None] | None
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """RequestOutput.prompt_logprobs in vLLM's JSON shape (token ids as string keys)."""
    if prompt_logprobs is None:
        return None
    return [None if step is None else
            {str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                      "decoded_token": _decoded(tokenizer, t, lp)} for t, lp in step.items()}
            for step in prompt_logprobs]


def chat_logprobs(tokenizer: Any, token_ids: list[int], steps: list[dict[int, Logprob]],
                  num_top: int) -> list[ChatLogProbsContent]:
    content = []
    for tid, step in zip(token_ids, steps):
        lp = step.get(tid)
        token = _decoded(tokenizer, tid, lp)
        top = [ChatLogProb(token=(s := _decoded(tokenizer, t, l)), logprob=clamp_logprob(l.logprob),
                           bytes=list(s.encode("utf-8", errors="replace")))
               for t, l in _ranked(step, num_top)] if num_top else []
        content.append(ChatLogProbsContent(token=token, logprob=clamp_logprob(lp.logprob) if lp else -9999.0,
                                           bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=top))
    return content


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
