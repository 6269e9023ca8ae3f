"""RequestStream: the asyncio side of one engine request (what EngineClient.add_request returns).

The engine thread delivers outputs with `loop.call_soon_threadsafe`; DELTA outputs are merged while the
consumer lags (like vLLM's RequestOutputCollector), so a slow SSE client gets fewer, larger chunks instead of
an unbounded queue, and `get()` never blocks the engine. A streamed response can take its outputs in the delivery
callback itself (`push_to`): one loop callback per engine step writes every stream's chunk, no task is woken per
token.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable

from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import RequestOutputKind


# --------------------------------------------------------------------------------------- output merge
def _own_copy(out: RequestOutput) -> RequestOutput:
    outputs = [dataclasses.replace(c, token_ids=list(c.token_ids),
                                   logprobs=list(c.logprobs) if c.logprobs is not None else None)
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)


def merge_delta(prev: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold DELTA output `new` into `prev` (which the caller owns): texts, token ids and logprobs append."""
    by_index = {c.index: c for c in prev.outputs}
    for c in new.outputs:
        p = by_index.get(c.index)
        if p is None:
            c = dataclasses.replace(c, token_ids=list(c.token_ids),
                                    logprobs=list(c.logprobs) if c.logprobs is not None else None)
            prev.outputs.append(c)
            by_index[c.index] = c
            continue
        p.text += c.text
        p.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if p.logprobs is None:
                p.logprobs = []
            p.logprobs.extend(c.logprobs)
        if c.cumulative_logprob is not None:
            p.cumulative_logprob = c.cumulative_logprob
        if c.finish_reason is not None:
            p.finish_reason = c.finish_reason
            p.stop_reason = c.stop_reason
    prev.finished = new.finished
    prev.metrics = new.metrics
    prev.num_cached_tokens = new.num_cached_tokens
    if new.error is not None:
        prev.error = new.error
    return prev


class RequestStream:
    """The asyncio side of one engine request.  All methods run on the event loop's thread."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, output_kind: RequestOutputKind,
                 on_close: Callable[[str], None] | None = None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.output_kind = output_kind
        self._on_close = on_close
        self._pending: RequestOutput | None = None
        self._pending_owned = False
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.accepted: asyncio.Future = loop.create_future()  # result: None or the rejection exception
        self.closed = False  # the engine side is done with it (finished, failed or aborted)
        self.finished = False  # the consumer has seen the final output (or the error)
        self._sink: Callable[[RequestOutput], bool] | None = None
        self._parked = False  # the consumer waits in get() (everything it took before is handled)

    def push_to(self, sink: Callable[[RequestOutput], bool]) -> None:
        """Hand outputs to `sink` inside the delivery callback instead of waking the consumer, while the consumer is
        parked in `get()` with nothing pending (so order is kept). Final outputs and errors still wake the consumer;
        `sink` returns False to decline an output (it is queued as before). An exception in `sink` fails the stream."""
        self._sink = sink

    # ---- called (via call_soon_threadsafe) by the engine thread
    def _accept(self, error: BaseException | None = None) -> None:
        if not self.accepted.done():
            self.accepted.set_result(error)
        if error is not None:
            self._close()

    def _put(self, out: RequestOutput) -> None:
        if self.closed:
            return
        if self._sink is not None and self._parked and self._pending is None and not out.finished:
            try:
                if self._sink(out):
                    return
            except Exception as exc:
                self._fail(exc)
                return
        if self._pending is None or self.output_kind != RequestOutputKind.DELTA:
            self._pending, self._pending_owned = out, False
        else:
            if not self._pending_owned:
                self._pending, self._pending_owned = _own_copy(self._pending), True
            merge_delta(self._pending, out)
        if out.finished:
            self._close()
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        if self.closed:
            return
        if not self.accepted.done():
            self.accepted.set_result(exc)
        self._error = exc
        self._close()
        self._event.set()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._on_close is not None:
                self._on_close(self.request_id)

    # ---- consumer side
    async def get(self) -> RequestOutput:
        """The next (merged) output; raises the request's error once the outputs before it are taken."""
        while self._pending is None and self._error is None:
            self._event.clear()
            self._parked = True
            try:
                await self._event.wait()
            finally:
                self._parked = False
        if self._pending is not None:
            out, self._pending = self._pending, None
            if out.finished:
                self.finished = True
            return out
        self.finished = True
        raise self._error  # type: ignore[misc]

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            out = await self.get()
            yield out
