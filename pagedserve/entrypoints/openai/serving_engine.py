"""What /v1/completions and /v1/chat/completions share: model check, tokenization, length checks,
SamplingParams, submitting several engine requests at once, merging their streams, logprob shapes,
and finishing a non-streaming request early when its client goes away."""
from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.engine.async_llm import AsyncLLM, RequestStream
from pagedserve.entrypoints.openai.errors import BadRequest, OpenAIError
from pagedserve.entrypoints.openai.protocol import (ChatLogProb, ChatLogProbsContent, CompletionLogProbs,
                                                    _SamplingFields)
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedserve.api")
T = TypeVar("T")

# Prompts above this many characters are tokenized in a worker thread, not on the event loop.
_TOKENIZE_INLINE_CHARS = 8192
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop",
                    "stop_token_ids", "logprobs", "priority", "cache_salt", "prompt")


class SSEResponse(StreamingResponse):
    """text/event-stream response that aborts its engine requests however it ends.

    The generator's own `finally` covers cancellation mid-stream; this also covers a client that
    disconnects before the generator was first iterated (an unstarted generator has no finally to run).
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


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

    def add(self, delta: CompletionOutput) -> None:
        """Append one DELTA output of this choice."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class OpenAIServing:
    def __init__(self, async_llm: AsyncLLM, served_model_name: str, max_model_len: int,
                 log_requests: bool = False) -> None:
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.log_requests = log_requests

    @property
    def tokenizer(self) -> Any:
        return self.async_llm.tokenizer

    @property
    def vocab_size(self) -> int:
        cfg_vocab = getattr(self.async_llm.model_config, "vocab_size", None)
        return int(cfg_vocab) if cfg_vocab else len(self.tokenizer)

    # ------------------------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist. This server serves "
                                   f"`{self.served_model_name}`.", param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"Token ids must be in [0, {vocab}); got {bad[:5]}.", param=param)

    def check_length(self, num_prompt: int, max_tokens: int | None, what: str, param: str) -> int:
        """Returns the effective max_tokens: the request's, or when it gave none the room left in
        max_model_len (capped by what the KV pool can hold, so the default never makes a request that
        could never be scheduled)."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your {what} "
                             f"has {num_prompt} tokens, which leaves no room for a completion. Please reduce "
                             f"the length of the {what}.", param=param, code="context_length_exceeded")
        if max_tokens is None:
            return self.async_llm.engine.default_max_tokens(num_prompt)
        if num_prompt + max_tokens > limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in the "
                             f"completion). Please reduce the length of the {what} or completion "
                             f"(max_tokens <= {limit - num_prompt}).", param="max_tokens",
                             code="context_length_exceeded")
        return max_tokens

    # ------------------------------------------------------------------------------ tokenizing
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Same call as LLMEngine.tokenize (tokenizer.encode), off the event loop for long inputs."""
        if len(text) > _TOKENIZE_INLINE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[Any], add_generation_prompt: bool, continue_final_message: bool,
                    chat_template_kwargs: dict[str, Any] | None) -> str:
        if not messages:
            raise BadRequest("'messages' must contain at least one message.", param="messages")
        if add_generation_prompt and continue_final_message:
            raise BadRequest("add_generation_prompt and continue_final_message cannot both be true.",
                             param="continue_final_message")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise BadRequest("This model's tokenizer has no chat template; use /v1/completions.", param="messages")
        conversation = []
        for m in messages:
            item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                item["name"] = m.name
            conversation.append(item)
        kwargs = dict(chat_template_kwargs or {})
        reserved = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                    "return_dict", "return_tensors", "chat_template", "tools", "documents"}
        clash = sorted(reserved & kwargs.keys())
        if clash:
            raise BadRequest(f"chat_template_kwargs may not set {clash}.", param="chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **kwargs)
        except Exception as exc:  # jinja TemplateError (raise_exception in templates), ValueError, ...
            raise BadRequest(f"Could not apply the chat template: {exc}", param="messages") from exc
        if not isinstance(text, str):  # some tokenizers return a list when batched
            text = text[0]
        return text

    async def encode_chat(self, messages: list[Any], add_generation_prompt: bool = True,
                          continue_final_message: bool = False,
                          chat_template_kwargs: dict[str, Any] | None = None,
                          add_special_tokens: bool = False) -> tuple[str, list[int]]:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
        # The template already has BOS & co: like vLLM, do not add special tokens again.
        return text, await self.encode(text, add_special_tokens=add_special_tokens)

    # ------------------------------------------------------------------------- sampling params
    def sampling_params(self, req: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        top_k = req.top_k if req.top_k is not None else 0
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if top_k == -1 else top_k,
                min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens, output_kind=RequestOutputKind.DELTA)
        except ValueError as exc:
            raise bad_param(exc) from exc

    # ------------------------------------------------------------------------------ submitting
    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                     req: _SamplingFields) -> list[RequestStream]:
        """Add one engine request per prompt; all or nothing (a rejection aborts the accepted ones)."""
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if self.log_requests:
            logger.info("Received request %s: prompts=%d, prompt_tokens=%s, params=%s, user=%r", request_id,
                        len(prompts), [len(p) for p in prompts], per_prompt[0], req.user)
        tasks = [asyncio.ensure_future(self.async_llm.add_request(rid, p, sp, priority=req.priority,
                                                                  cache_salt=req.cache_salt))
                 for rid, p, sp in zip(ids, prompts, per_prompt)]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            self.async_llm.abort_nowait(ids)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.async_llm.abort_nowait([rid for rid, r in zip(ids, results) if not isinstance(r, BaseException)])
            err = errors[0]
            if isinstance(err, ValueError) and not isinstance(err, OpenAIError):
                raise bad_param(err) from err
            raise err
        return list(results)  # type: ignore[arg-type]

    def abort_streams(self, streams: list[RequestStream]) -> None:
        live = [s.request_id for s in streams if not s.closed]
        if live:
            self.async_llm.abort_nowait(live)


def bad_param(exc: ValueError) -> BadRequest:
    """ValueError from SamplingParams / LLMEngine.add_request -> 400, naming the field when the text does."""
    msg = str(exc)
    head = msg.split(" ", 1)[0].strip(":,.'\"`")
    param = head if head in _SAMPLING_FIELDS else None
    if "max_model_len" in msg or "context length" in msg:
        return BadRequest(msg, param=param or "max_tokens", code="context_length_exceeded")
    return BadRequest(msg, param=param)


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
