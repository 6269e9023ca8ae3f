"""InputProcessor: the one place where a request is validated before the engine takes it.

`LLM.generate`, `LLMEngine.add_request` and the OpenAI server all go through `InputProcessor.process`, which
checks everything the scheduler or the sampler could later trip on (token ids against the vocabulary, lengths
against max_model_len and the KV pool, logprob counts, limits) and raises `InvalidRequestError` naming the
parameter. It reads only the frozen `EngineConfig` and the tokenizer, so the server may call it on its own
thread before a request is queued: bad input costs no engine work. It also bounds what a valid request may cost
(RequestLimits): stop strings and stop token ids, sequences, n x max_tokens x logprobs, and the structured-output
grammar, compiled here once per request on the grammar compiler's worker (`process_async` awaits it without
holding the event loop).

`render_chat` is the one chat-template renderer (LLM.chat and /v1/chat/completions).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from pagedserve.config import EngineConfig, KVCacheConfig
from pagedserve.engine.grammar_compiler import CompiledGrammar, GrammarCompiler
from pagedserve.engine.structured_output import StructuredOutputManager
from pagedserve.errors import InvalidRequestError
from pagedserve.lora.adapter_config import read_adapter_config
from pagedserve.lora.request import LoRARequest
from pagedserve.model_executor.token_types import shift_token_types
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ProcessedRequest:
    """A validated request, ready for the engine."""
    request_id: str
    prompt: str | None  # the text, when the request gave text
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: a pooling request (its task resolved)
    max_tokens: int  # resolved (params.max_tokens, or what max_model_len and the KV pool leave; 0 when pooling)
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    grammar: CompiledGrammar | None = None  # structured output: compiled once for all n sequences
    lora_request: LoRARequest | None = None


class InputProcessor:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheConfig, tokenizer: Any,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache  # the blocks the engine allocated: no request may need more
        self.tokenizer = tokenizer
        self.structured_output = structured_output
        self.grammars = GrammarCompiler(structured_output, config.limits) if structured_output is not None else None

    @property
    def vocab_size(self) -> int:
        return self.config.model.vocab_size

    # ------------------------------------------------------------------------------ tokens
    def tokenize(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"{param} must not be empty.", param=param)
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError(f"{param} must be a string or a list of token ids.", param=param,
                                      code="invalid_type")
        self.check_token_ids(prompt, param)
        return list(prompt)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab}); got {bad[:5]}.", param=param)

    # ------------------------------------------------------------------------------ lengths
    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens when a request gives none: what max_model_len leaves, capped by what the whole KV pool
        holds, so that the default never makes a request that could never run."""
        room = min(self.config.model.max_model_len, self.kv_cache.num_tokens) - num_prompt_tokens
        return max(room, 1)

    def _check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> int:
        limit = self.config.model.max_model_len
        if num_prompt >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has {num_prompt} "
                f"tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
                param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.default_max_tokens(num_prompt)
        elif num_prompt + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or completion (max_tokens <= {limit - num_prompt}).",
                param="max_tokens", code="context_length_exceeded")
        cache = self.kv_cache
        need = cdiv(num_prompt + max_tokens, cache.block_size) * cache.num_kv_cache_groups
        if need > cache.num_blocks:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks but the whole "
                f"KV cache has {cache.num_blocks} ({cache.num_tokens} tokens); the request could never run.",
                param="max_tokens", code="context_length_exceeded")
        return max_tokens

    # ------------------------------------------------------------------------------ limits
    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        limit = self.config.limits.max_sequences_per_request
        if num_prompts * n > limit:
            raise InvalidRequestError(
                f"This request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; the limit is "
                f"{limit} per request (--max-sequences-per-request).", param="n", code="too_many_sequences")

    def _check_params(self, params: SamplingParams) -> None:
        limits = self.config.limits
        if params.logprobs is not None and params.logprobs > limits.max_logprobs:
            raise InvalidRequestError(f"logprobs must be <= {limits.max_logprobs} (--max-logprobs), got "
                                      f"{params.logprobs}.", param="logprobs")
        if params.prompt_logprobs is not None and params.prompt_logprobs > limits.max_logprobs:
            raise InvalidRequestError(f"prompt_logprobs must be <= {limits.max_logprobs} (--max-logprobs), got "
                                      f"{params.prompt_logprobs}.", param="prompt_logprobs")
        if len(params.stop) > limits.max_stop_strings:
            raise InvalidRequestError(f"At most {limits.max_stop_strings} stop strings are allowed "
                                      f"(--max-stop-strings), got {len(params.stop)}.", param="stop",
                                      code="too_many_stop_strings")
        total = sum(len(s) for s in params.stop)
        if total > limits.max_stop_chars:
            raise InvalidRequestError(f"The stop strings total {total} characters; the limit is "
                                      f"{limits.max_stop_chars} (--max-stop-chars).", param="stop",
                                      code="stop_strings_too_long")
        if len(params.stop_token_ids) > limits.max_stop_token_ids:
            raise InvalidRequestError(f"At most {limits.max_stop_token_ids} stop_token_ids are allowed "
                                      f"(--max-stop-token-ids), got {len(params.stop_token_ids)}.",
                                      param="stop_token_ids", code="too_many_stop_token_ids")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias), "logit_bias")
        if params.allowed_token_ids:
            self.check_token_ids(params.allowed_token_ids, "allowed_token_ids")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        self.check_num_sequences(1, params.n)

    def truncate_prompt(self, token_ids: list[int], keep: int) -> list[int]:
        """truncate_prompt_tokens (vLLM): the last `keep` tokens; -1 keeps as many as the context allows."""
        limit = self.config.model.max_model_len - 1
        if keep == -1:
            keep = limit
        if keep > limit:
            raise InvalidRequestError(f"truncate_prompt_tokens must be <= max_model_len - 1 ({limit}), got {keep}.",
                                      param="truncate_prompt_tokens")
        return token_ids[-keep:]

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it would appear at a word start and after a space (vLLM's two spellings)."""
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words needs a tokenizer (this engine has none).", param="bad_words")
        seqs: list[list[int]] = []
        for word in words:
            for spelling in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(spelling, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def _check_logprob_entries(self, params: SamplingParams, max_tokens: int) -> None:
        """Every sampled token of every sequence keeps its top-`logprobs` (and its own) until the response is
        sent: n x max_tokens x (logprobs + 1) entries, checked with max_tokens as resolved."""
        if params.logprobs is None:
            return
        entries = params.n * max_tokens * (params.logprobs + 1)
        limit = self.config.limits.max_logprob_entries
        if entries > limit:
            raise InvalidRequestError(
                f"This request asks for n={params.n} x max_tokens={max_tokens} x (logprobs={params.logprobs} + 1) = "
                f"{entries} logprob entries; the limit is {limit} per request (--max-logprob-entries). Lower n, "
                f"max_tokens or logprobs.", param="logprobs", code="too_many_logprobs")

    def check_beam_width(self, beam_width: int) -> None:
        """Beam search asks for 2 x beam_width logprobs per step."""
        limit = self.config.limits.max_logprobs // 2
        if beam_width > limit:
            raise InvalidRequestError(f"beam_width must be <= {limit} (half of --max-logprobs "
                                      f"{self.config.limits.max_logprobs}), got {beam_width}.", param="beam_width")

    # ------------------------------------------------------------------------------ the gate
    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                prompt_param: str = "prompt", lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Validate and, for structured output, compile (blocking this thread up to the compile timeout)."""
        processed = self._validate(request_id, prompt, params, arrival_time, priority, cache_salt, prompt_param,
                                   lora_request)
        if isinstance(params, PoolingParams) or params.structured_outputs is None:
            return processed
        return dataclasses.replace(processed, grammar=self._compiler().compile(params.structured_outputs))

    async def process_async(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                            arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                            prompt_param: str = "prompt", lora_request: LoRARequest | None = None
                            ) -> ProcessedRequest:
        """`process` for the event loop: the grammar compiles on its worker while the loop serves others."""
        processed = self._validate(request_id, prompt, params, arrival_time, priority, cache_salt, prompt_param,
                                   lora_request)
        if isinstance(params, PoolingParams) or params.structured_outputs is None:
            return processed
        return dataclasses.replace(processed,
                                   grammar=await self._compiler().compile_async(params.structured_outputs))

    def _compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            raise InvalidRequestError("This engine does not support structured outputs.",
                                      param="structured_outputs", code="unsupported_parameter")
        return self.grammars

    def _validate(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                  arrival_time: float | None, priority: int, cache_salt: str | None,
                  prompt_param: str, lora_request: LoRARequest | None = None) -> ProcessedRequest:
        pooling = self.config.pooler is not None
        if isinstance(params, PoolingParams) != pooling:  # vLLM's runners: an engine either generates or pools
            raise InvalidRequestError(
                "This model is a pooling model (runner 'pooling'): it serves embed / classify / score, not "
                "generation." if pooling else "This model is a generative model: it does not support pooling "
                "(embed / classify / score); start it with --runner pooling.", param="model",
                code="unsupported_task")
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise InvalidRequestError("sampling params must be a SamplingParams.", param="sampling_params")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise InvalidRequestError("priority is only supported with scheduling_policy='priority'.",
                                      param="priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string.", param="cache_salt")
        if pooling:
            return self._validate_pooling(request_id, prompt, params, arrival_time, priority, cache_salt, prompt_param)
        self._check_params(params)
        self.check_lora(lora_request)
        token_ids = self.tokenize(prompt, prompt_param)
        if not token_ids:
            raise InvalidRequestError(f"{prompt_param} must not be empty.", param=prompt_param)
        if params.truncate_prompt_tokens is not None:
            token_ids = self.truncate_prompt(token_ids, params.truncate_prompt_tokens)
            prompt = token_ids  # the text no longer matches the tokens
        max_tokens = self._check_length(len(token_ids), params.max_tokens, prompt_param)
        self._check_logprob_entries(params, max_tokens)
        return ProcessedRequest(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                                max_tokens, time.time() if arrival_time is None else arrival_time, priority,
                                cache_salt, lora_request=lora_request)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """The adapter's directory and adapter_config.json (its weights are read when the engine takes it)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError("lora_request must be a LoRARequest.", param="lora_request")
        if self.config.lora is None:
            raise InvalidRequestError("LoRA adapters need an engine started with enable_lora=True (--enable-lora).",
                                      param="lora_request")
        try:
            read_adapter_config(lora_request.lora_path, self.config.lora.max_lora_rank)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="lora_request") from exc

    def _validate_pooling(self, request_id: str, prompt: str | list[int], params: PoolingParams,
                          arrival_time: float | None, priority: int, cache_salt: str | None,
                          prompt_param: str) -> ProcessedRequest:
        """A pooling request: a task this model serves, `dimensions` only where the model allows them, and a prompt
        that fits max_model_len and the KV pool (it is prefilled, nothing is generated)."""
        pooler = self.config.pooler
        task = params.task or pooler.task
        if task not in pooler.supported_tasks:
            raise InvalidRequestError(f"This model does not support the {task!r} task; it supports "
                                      f"{', '.join(pooler.supported_tasks)}.", param="task", code="unsupported_task")
        if params.dimensions is not None:
            if task != "embed":
                raise InvalidRequestError("dimensions is only for embeddings.", param="dimensions")
            try:
                pooler.check_dimensions(params.dimensions, self.config.model.hidden_size)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="dimensions") from exc
        token_ids = self.tokenize(prompt, prompt_param)
        if not token_ids:
            raise InvalidRequestError(f"{prompt_param} must not be empty.", param=prompt_param)
        if params.truncate_prompt_tokens is not None:
            kept = self.truncate_prompt(token_ids, params.truncate_prompt_tokens)
            params = shift_token_types(params, len(token_ids) - len(kept))  # the kept tokens' types
            token_ids = prompt = kept
        limit = self.config.model.max_model_len
        if len(token_ids) > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested {len(token_ids)} "
                f"tokens in the input. Please reduce the length of the input.", param=prompt_param,
                code="context_length_exceeded")
        need = cdiv(len(token_ids), self.kv_cache.block_size) * self.kv_cache.num_kv_cache_groups
        if need > self.kv_cache.num_blocks:
            raise InvalidRequestError(f"{prompt_param} ({len(token_ids)} tokens) needs {need} KV blocks but the whole "
                                      f"KV cache has {self.kv_cache.num_blocks}; the request could never run.",
                                      param=prompt_param, code="context_length_exceeded")
        return ProcessedRequest(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                                dataclasses.replace(params, task=task), 0,
                                time.time() if arrival_time is None else arrival_time, priority, cache_salt)


# ------------------------------------------------------------------------------------------ chat
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                       "continue_final_message", "return_dict", "return_tensors", "chat_template",
                                       "tools", "documents"})


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
    """Messages -> the prompt text through the model's chat template (transformers' apply_chat_template);
    `tools` (OpenAI's function definitions) are rendered by the template, as the model was trained to see them."""
    if not messages:
        raise InvalidRequestError("messages must contain at least one message.", param="messages")
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true.",
                                  param="continue_final_message")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("This model's tokenizer has no chat template; use completions.", param="messages")
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs may not set {clash}.", param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as exc:  # jinja TemplateError (raise_exception in templates), ValueError, ...
        raise InvalidRequestError(f"Could not apply the chat template: {exc}", param="messages") from exc
    return text if isinstance(text, str) else text[0]  # some tokenizers return a list when batched
