"""Structured output's grammars, compiled once per request before the engine sees it.

A constraint (JSON schema, regex, Lark grammar, choice list) becomes a `CompiledGrammar`: the validated llguidance
grammar and a template matcher whose first token mask is already computed. Building that matcher is the expensive
part (0.4 s for a 20k-value choice list, plus as much for the first mask), so it runs on this module's own worker
thread: never on the engine thread (where it stalled every stream) nor on the event loop. Every sequence of the
request (n of them) then starts from a deep copy of the template, which costs microseconds and shares the lexer
state the first mask built.

Limits, each a 400 naming the field: the constraint's size in bytes (`max_grammar_bytes`), llguidance's own work
limits (grammar symbols and lexer fuel, so a compile cannot run away), and a wall-clock `grammar_compile_timeout`.
Compiled grammars are cached (LRU) within `grammar_cache_bytes`, counted as the constraint's text, the grammar's
text and an estimate of the matcher (the grammar's size again): bounded in bytes, not in entries.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedserve.config import RequestLimits
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams

# JSON whitespace: free, but in bounded runs (enough for pretty-printed nesting), so that a weak model cannot
# spend all of max_tokens on whitespace between two tokens; disable_any_whitespace makes it compact instead.
_JSON_WHITESPACE = {"whitespace_pattern": "[ \\t\\n\\r]{0,24}"}
_JSON_COMPACT = {"whitespace_flexible": False}
# llguidance's defaults are 500k grammar symbols and 1M initial lexer fuel (~20 ms of regex analysis): kept, they
# already bound a compile's work; stated here so that they are ours and not a library default that may move.
_MAX_GRAMMAR_SYMBOLS = 500_000
_INITIAL_LEXER_FUEL = 1_000_000


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint ready for the engine: `matcher` is a template, never advanced; sequences get deep copies."""
    source: str  # the llguidance grammar
    matcher: Any  # llguidance.LLMatcher, first mask computed
    nbytes: int  # what it is counted as in the cache

    def new_matcher(self) -> Any:
        return self.matcher.deep_copy()


def _lark_choice(choices: list[str]) -> str:
    # JSON string literals are valid Lark literals: quotes and escapes come out right.
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """Thread-safe: the server's event loop and offline callers both ask it."""

    def __init__(self, ll_tokenizer_source: Any, limits: RequestLimits) -> None:
        self._tokenizer_source = ll_tokenizer_source  # has .ll_tokenizer (built lazily by the owner)
        self.limits = limits
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self.cache_bytes = 0
        self.num_compiled = 0  # grammars built (cache misses that succeeded or failed)

    # ------------------------------------------------------------------------------ the two ways in
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking, for offline callers (LLM / LLMEngine.add_request)."""
        future = self._submit(params)
        try:
            return future.result(timeout=self.limits.grammar_compile_timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self._timed_out(params) from None

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """For the server: the event loop waits without blocking."""
        future = self._submit(params)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.limits.grammar_compile_timeout)
        except asyncio.TimeoutError:
            future.cancel()  # a compile not started yet is dropped; a running one finishes and is cached
            raise self._timed_out(params) from None

    # ------------------------------------------------------------------------------ internals
    def _submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        key = params.key()
        size = len(key[1].encode())
        if size > self.limits.max_grammar_bytes:
            raise InvalidRequestError(
                f"The {params.kind} is {size} bytes; the limit is {self.limits.max_grammar_bytes} "
                f"(--max-grammar-bytes).", param=params.param(params.kind), code="grammar_too_large")
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_result(cached)
                return future
        return self._executor.submit(self._build, key, params)

    def _timed_out(self, params: StructuredOutputsParams) -> InvalidRequestError:
        return InvalidRequestError(
            f"Compiling the {params.kind} took longer than {self.limits.grammar_compile_timeout} s "
            f"(--grammar-compile-timeout); simplify it.", param=params.param(params.kind),
            code="grammar_compile_timeout")

    def _build(self, key: tuple[str, str], params: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        with self._lock:
            self.num_compiled += 1
        kind, text = key
        param = params.param(kind)
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, dict) and "x-guidance" not in schema:
                schema = {**schema, "x-guidance": _JSON_COMPACT if params.disable_any_whitespace else _JSON_WHITESPACE}
            text = json.dumps(schema)
            kind = "json"
        try:
            if kind == "choice":
                source = llguidance.grammar_from("lark", _lark_choice(params.choice or []))
            else:
                source = llguidance.grammar_from({"json": "json", "regex": "regex", "grammar": "grammar"}[kind], text)
        except Exception as exc:  # e.g. a GBNF grammar that does not parse
            raise InvalidRequestError(f"Invalid {kind}: {exc}", param=param, code="invalid_grammar") from exc
        ll_tokenizer = self._tokenizer_source.ll_tokenizer
        limits = llguidance.LLParserLimits(max_grammar_size=_MAX_GRAMMAR_SYMBOLS,
                                           initial_lexer_fuel=_INITIAL_LEXER_FUEL, verbose_errors=False)
        error = llguidance.LLMatcher.validate_grammar(source, ll_tokenizer, limits=limits)
        if error:
            raise InvalidRequestError(f"Invalid {kind}: {error}", param=param, code="invalid_grammar")
        matcher = llguidance.LLMatcher(ll_tokenizer, source, limits=limits)
        matcher.compute_bitmask()  # the first mask builds the lexer states every copy shares
        if matcher.is_error():
            raise InvalidRequestError(f"Invalid {kind}: {matcher.get_error()}", param=param, code="invalid_grammar")
        compiled = CompiledGrammar(source, matcher, len(key[1].encode()) + 2 * len(source.encode()))
        self._remember(key, compiled)
        return compiled

    def _remember(self, key: tuple[str, str], compiled: CompiledGrammar) -> None:
        budget = self.limits.grammar_cache_bytes
        if compiled.nbytes > budget:
            return  # used by its own request only
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self.cache_bytes += compiled.nbytes
            while self.cache_bytes > budget:
                _, evicted = self._cache.popitem(last=False)
                self.cache_bytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._cache)
