"""Structured output: per-sequence grammar state (llguidance) -> the token masks of the next step.

Constrained and free requests share one step, and only constrained requests pay for their masks: the manager fills
one bitmask row per constrained sequence that samples this step (free rows stay all-ones), turns the bits into an
additive logit bias (0 allowed, -inf not), and the sampler adds it to the logits in one vectorized op. Two ways to
run it, chosen per engine (`overlap_masks`):
- overlapped: every constrained row's mask is filled on a worker thread while the forward runs, in one llguidance
  call and one numpy lookup that both release the GIL. Right when the forward leaves a core free (an accelerator,
  or fewer torch threads than cores).
- checked first: when torch's threads hold every core, a worker thread only competes with them (and a parallel
  region waits for its slowest thread). So a row is sampled without its mask, its grammar checks the token (a few
  us), and only a rejected row fills its mask, on the engine thread, and samples again. That is exact for greedy
  rows and for plain random sampling (see ModelRunner._resample_rejected). Rows cut by top-k / top-p / min-p need
  the whole mask first and get it before the forward, on the engine thread. Filling the masks of often-rejected
  sequences up front instead measured slower (2351 vs 2977 tok/s on the demo model), so every row is checked.

Grammars are compiled once per request, before the engine takes it, on a worker thread of their own with a time
limit (grammar_compiler.py): a bad schema is a 400 naming the field and never blocks a step. Each sequence's matcher
is a deep copy of the request's compiled template (microseconds).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from pagedserve.engine.grammar_compiler import CompiledGrammar
from pagedserve.model_executor.model_runner import StepMasks

logger = logging.getLogger("pagedserve")

# Byte value -> its 8 tokens' logit bias (bit b of a byte is token 8 * byte_index + b: llguidance's little-endian
# bitmask). A table lookup is ~40x faster here than torch's masked_fill with a bool mask.
_BYTE_TO_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)


def _done(value: torch.Tensor) -> "Future[torch.Tensor]":
    future: Future[torch.Tensor] = Future()
    future.set_result(value)
    return future


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, overlap_masks: bool = True) -> None:
        self.tokenizer = tokenizer
        # The grammar's token space: the wider of the model's logits and the tokenizer (vLLM's guidance backend).
        # A tokenizer with fewer tokens than the logits (Qwen pads its embedding to a multiple of 128): the ids past
        # it are never allowed. One with more (added tokens the model has no row for, as transformers' GGUF tokenizer
        # adds `<|endoftext|>`): llguidance refuses an n_vocab below the tokenizer's, and the sampler drops the mask's
        # columns past the logits, so those ids are never sampled.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.overlap_masks = overlap_masks  # False: sample first, fill only rejected rows' masks (module docstring)
        self._ll_tokenizer = None  # built on first use (~0.1-1 s)
        self.matchers: dict[str, Any] = {}  # sequence id -> llguidance.LLMatcher
        # sequences whose grammar starts after a marker (the end of reasoning): id -> (grammar, marker, last tokens)
        self.pending: dict[str, tuple[CompiledGrammar, tuple[int, ...], list[int]]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._ll_executor = None  # llguidance's batch executor: one GIL-free call for all rows
        # statistics: seconds spent filling masks; rows filled; rows checked first, and how many of those rejected
        self.mask_time = 0.0
        self.masked_rows = self.checked_rows = self.rejected_rows = 0

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    @property
    def active(self) -> bool:
        """Whether any live sequence has a grammar (running, or waiting for its marker)."""
        return bool(self.matchers or self.pending)

    # ------------------------------------------------------------------------------ per sequence
    def add(self, sequence_id: str, grammar: CompiledGrammar, start_after: tuple[int, ...] | None = None) -> None:
        """start_after: the grammar takes over from the token after this sequence in the output; until then the
        sequence samples freely (no mask, nothing consumed)."""
        if start_after:
            self.pending[sequence_id] = (grammar, tuple(start_after), [])
        else:
            self.matchers[sequence_id] = grammar.new_matcher()  # a copy of the request's template: no compile here

    def retain(self, live_sequence_ids) -> None:
        """Drop the state of every sequence that is no longer live (finished, aborted or failed)."""
        for state in (self.matchers, self.pending):
            for sid in [sid for sid in state if sid not in live_sequence_ids]:
                del state[sid]

    def _watch(self, sequence_id: str, token: int) -> None:
        """A pending sequence's token: once its output ends with the marker, its grammar starts."""
        grammar, marker, last = self.pending[sequence_id]
        last.append(token)
        del last[:-len(marker)]
        if tuple(last) == marker:
            del self.pending[sequence_id]
            self.matchers[sequence_id] = grammar.new_matcher()

    @property
    def ll_executor(self):
        if self._ll_executor is None:
            import llguidance

            # One thread: it runs beside the forward, whose threads own the other cores.
            self._ll_executor = llguidance.LLExecutor(num_threads=1)
        return self._ll_executor

    def accept(self, sampled: list[tuple[str, int]]) -> list[str]:
        """Advance each constrained sequence's grammar by its sampled token (free sequences are skipped).
        Returns the sequences that should stop: their grammar is complete or the token broke it."""
        # One consume_token call per sequence: ~10 us each, cheaper than llguidance's consume_token_par here.
        to_stop = []
        for sid, token in sampled:
            matcher = self.matchers.get(sid)
            if matcher is None:
                if sid in self.pending:
                    self._watch(sid, token)
                continue
            ok = matcher.consume_token(token)
            if not ok:
                logger.warning("structured output: token %d rejected for %s (%s)", token, sid, matcher.get_error())
            if not ok or matcher.is_stopped():
                to_stop.append(sid)
        return to_stop

    # ------------------------------------------------------------------------------ masks
    def start_masks(self, sequence_ids: list[str], needs_whole_mask: Sequence[bool]) -> StepMasks | None:
        """This step's masks (row i <-> sequence_ids[i]); None when no row is constrained. needs_whole_mask[i]: row i
        cannot be checked after sampling (top-k / top-p / min-p, or a speculative batch), so its mask comes first."""
        rows = [(i, self.matchers[sid]) for i, sid in enumerate(sequence_ids) if sid in self.matchers]
        if not rows:
            return None
        if self.overlap_masks:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
            return StepMasks(self._executor.submit(self._fill, len(sequence_ids), rows, True), [])
        first = [(i, matcher) for i, matcher in rows if needs_whole_mask[i]]
        return StepMasks(_done(self._fill(len(sequence_ids), first, False)) if first else None,
                         [i for i, _ in rows if not needs_whole_mask[i]])

    def allows(self, sequence_ids: list[str], tokens: list[int]) -> list[bool]:
        """Whether each sequence's grammar accepts its token now (no state change)."""
        allowed = [self.matchers[sid].validate_tokens([token]) == 1 for sid, token in zip(sequence_ids, tokens)]
        self.checked_rows += len(allowed)
        self.rejected_rows += allowed.count(False)
        return allowed

    def masks_now(self, sequence_ids: list[str]) -> torch.Tensor:
        """These sequences' masks as a logit bias ([len, >= V]), filled on this thread."""
        return self._fill(len(sequence_ids), [(i, self.matchers[sid]) for i, sid in enumerate(sequence_ids)], False)

    def _fill(self, num_rows: int, rows: list[tuple[int, Any]], one_call: bool) -> torch.Tensor:
        # llguidance.numpy, not llguidance.torch: the torch module's import pulls in torch._dynamo (its
        # @torch.compile), 4-5 s on the first constrained request of a server.
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        t0 = time.perf_counter()
        # All ones: free rows allow every token. Allocated by numpy, not torch.full: no torch op may run a parallel
        # region on the worker thread. OpenMP would give it a second thread pool, and with more pool threads than
        # cores libgomp stops spin-waiting: the engine's parallel regions would then each wake their worker by futex.
        bitmask = np.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        if one_call:  # on the worker: one GIL-free call for all rows, on llguidance's own thread
            fill_next_token_bitmask_par(self.ll_executor, [(matcher, row) for row, matcher in rows], bitmask)
        else:  # on the engine thread: no hand-off to another thread that would compete for the cores
            for row, matcher in rows:
                fill_next_token_bitmask(matcher, bitmask, row)
        # Bit t%32 of word t//32 is bit t%8 of byte t//8 (x86 and ARM are little-endian).
        bias = np.take(_BYTE_TO_BIAS, bitmask.view(np.uint8), axis=0).reshape(num_rows, -1)
        self.mask_time += time.perf_counter() - t0
        self.masked_rows += len(rows)
        return torch.from_numpy(bias)
