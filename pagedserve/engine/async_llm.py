"""AsyncLLM: the engine steps continuously in a background thread; asyncio callers get per-request streams.

Design
------
* One engine thread owns the `LLMEngine` (the engine is not thread-safe; nothing else touches it).
  It loops: take queued adds/aborts -> `engine.add_request` / `engine.abort_request` -> `engine.step()`
  -> hand the step's outputs to the event loop with ONE `loop.call_soon_threadsafe` per step.
  With no work it sleeps on a `threading.Condition` (no busy spin); `add_request`/`abort` notify it.
  While there is unlogged activity it wakes up at most every `log_interval_s` for the periodic
  stats line.
* Per request the asyncio side holds a `RequestStream`: outputs are requested as DELTA from the engine
  and merged while the consumer lags (like vLLM's RequestOutputCollector), so a slow SSE client gets
  fewer, larger chunks instead of an unbounded queue, and `get()` never blocks the engine.
* `add_request` is awaited until the engine thread has really called `engine.add_request`, so a
  `ValueError` there (bad params, prompt too long, can never fit in the KV pool) reaches the HTTP layer
  before a streaming response has started: it becomes a 400, not a broken stream.
* Failure isolation: a failure of one request (`engine.add_request` raising, or a RequestOutput with
  `error` set) fails that request only.  If `engine.step()` itself raises, the exception is logged with
  its traceback, every in-flight request is aborted in the engine and failed with
  `EngineRequestError` (their streams end with an error), and the loop keeps serving new requests.
* Cancellation: a consumer that stops early (client disconnected -> the StreamingResponse task is
  cancelled -> `generate()`'s finally) aborts the request, and the engine frees its KV blocks on the
  engine thread's next iteration (it is woken at once; at most one in-flight step away).

Tokenization happens in the HTTP layer (the serving code passes token ids): the server needs the token
counts anyway (length validation, usage), and tokenizing on the engine thread would stall every
running request's next step behind the tokenizer.

Thread vs process separation
----------------------------
vLLM runs the engine core in a separate process (ZMQ + msgpack) so that the API server's Python work
never contends for the GIL with the scheduler.  Here the engine runs in a thread of the server
process: torch releases the GIL inside the forward pass (where most of a step's time goes for any real
model) and the per-step hand-off is a single `call_soon_threadsafe` with object references — no
serialization, no copies, no second process holding a second copy of the tokenizer/model config, and
aborts take effect without an IPC round trip.  The cost is GIL contention between the HTTP layer
(SSE framing + JSON, ~250 us of event-loop time per chunk with uvicorn's h11) and the scheduler's Python.

Measured on the shared 2-core CPU box, 32 concurrent streaming clients (64 prompt + 64 output tokens,
`pagedserve bench serve` on the same cores), see docs/SERVING.md for the table:
  * tiny 0.2M-param Llama (Python-bound, ~2 ms forward): engine-only step loop 3.9-8.5 ms per token;
    AsyncLLM with asyncio consumers but no HTTP 4.6-6.9 ms (the thread hand-off costs nothing
    measurable); through the server 11-17 ms engine-side, 15.6-21.3 ms mean client ITL (p50 11.5-18.4).
  * smollm2-135m shape (forward-bound): engine-only 310-410 ms, through the server 355 ms mean client
    ITL (p50 351 ms), i.e. within noise.
So the HTTP layer only matters when the forward is negligible; a process split would overlap it only
given a spare core, and would serialize every output.  For real models the thread is as fast and much
simpler; this class's queue interface (add / abort / per-step outputs) is the boundary to move into a
process if hundreds of streams on a fast GPU ever make the event loop the bottleneck.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable

from pagedserve.metrics.loggers import (FinishedRequestStats, LoggingStatLogger, StatLoggerBase,
                                        StatLoggerManager, StepStats, split_engine_stats)
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedserve.engine")


class EngineRequestError(RuntimeError):
    """The engine failed this one request (its RequestOutput carried `error`, or step() raised)."""


class EngineShuttingDown(RuntimeError):
    """The server is shutting down; in-flight and new requests end with this."""


class EngineDeadError(RuntimeError):
    """The engine loop is gone (it cannot serve anything any more)."""


class RequestAborted(EngineRequestError):
    """The request was aborted (by `AsyncLLM.abort`) before it finished."""


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

    # ---- called (via call_soon_threadsafe) by the engine thread
    def _accept(self, error: BaseException | None = None) -> None:
        if not self.accepted.done():
            self.accepted.set_result(error)
        if error is not None:
            self._close()

    def _put(self, out: RequestOutput) -> None:
        if self.closed:
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
            await self._event.wait()
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


# ------------------------------------------------------------------------------------------- the loop
@dataclass
class _PendingAdd:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float  # time.time(), handed to the engine
    arrival_mono: float  # time.monotonic(), for our own latency metrics
    stream: RequestStream


@dataclass
class _ReqState:
    stream: RequestStream
    arrival: float  # monotonic
    n: int
    max_tokens: int | None
    output_kind: RequestOutputKind
    num_prompt_tokens: int = 0
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    tokens_per_index: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)


class AsyncLLM:
    def __init__(self, engine: Any, *, log_stats: bool = True, log_interval_s: float = 10.0,
                 stat_loggers: Iterable[StatLoggerBase] = (), start: bool = True) -> None:
        self.engine = engine
        loggers: list[StatLoggerBase] = list(stat_loggers)
        if log_stats:
            loggers.insert(0, LoggingStatLogger(log_interval_s))
        self.stat_logger_manager = StatLoggerManager(loggers, log_interval_s)
        self._cond = threading.Condition()
        self._adds: deque[_PendingAdd] = deque()
        self._aborts: deque[str] = deque()
        self._fail_all_exc: BaseException | None = None
        self._stop = False
        self._draining = False
        self._dead: BaseException | None = None
        self._reqs: dict[str, _ReqState] = {}  # engine thread only
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Callable[..., None], tuple]] = []
        self._thread: threading.Thread | None = None
        self.num_step_failures = 0
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> "AsyncLLM":
        from pagedserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(engine_args), **kwargs)

    # ---------------------------------------------------------------------------------- properties
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop and self._dead is None

    @property
    def accepting(self) -> bool:
        return self.is_running and not self._draining

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        with self._cond:
            self.stat_logger_manager.loggers.append(stat_logger)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- asyncio API
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                          priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it (ValueError if it rejected it)."""
        self._check_accepting()
        loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in flight.")
        stream = RequestStream(request_id, loop, params.output_kind, on_close=self._forget)
        self._streams[request_id] = stream
        add = _PendingAdd(request_id, prompt, params, priority, cache_salt, time.time(), time.monotonic(), stream)
        with self._cond:
            if self._stop or self._draining:
                self._streams.pop(request_id, None)
                raise EngineShuttingDown("The server is shutting down; not accepting new requests.")
            self._adds.append(add)
            self._cond.notify()
        try:
            error = await stream.accepted
        except asyncio.CancelledError:
            self.abort_nowait(request_id)
            raise
        if error is not None:
            raise error
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs for one request (shaped by params.output_kind).  Leaving the loop early
        (break, cancellation, client disconnect) aborts the request and frees its KV blocks."""
        request_id = request_id or uuid.uuid4().hex
        stream = await self.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt)
        try:
            while not stream.finished:
                try:
                    out = await stream.get()
                except RequestAborted:
                    return
                yield out
        finally:
            if not stream.closed:
                self.abort_nowait(request_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str | Iterable[str]) -> None:
        """Abort from the event-loop thread: the stream ends now, the engine frees the KV blocks at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream._fail(RequestAborted(f"Request {rid} was aborted."))
        with self._cond:
            self._aborts.extend(ids)
            self._cond.notify()

    def fail_all(self, exc: BaseException) -> None:
        """Thread-safe: end every in-flight request with `exc` (used for shutdown)."""
        with self._cond:
            self._fail_all_exc = exc
            self._cond.notify()

    def begin_drain(self) -> None:
        """Thread-safe: stop accepting new requests; the in-flight ones keep running."""
        with self._cond:
            self._draining = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread: in-flight requests end with EngineShuttingDown."""
        with self._cond:
            self._draining = True
            self._stop = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"The engine loop died: {self._dead!r}")
        if self._stop or self._draining:
            raise EngineShuttingDown("The server is shutting down; not accepting new requests.")
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("The engine loop is not running.")

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # --------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stop or self._adds or self._aborts or self._fail_all_exc is not None
                               or self._has_work()):
                        timeout = self.stat_logger_manager.next_log_in(time.monotonic())
                        if timeout is not None and timeout <= 0:
                            break
                        self._cond.wait(timeout)
                    if self._stop:
                        break
                    adds, aborts = list(self._adds), list(self._aborts)
                    self._adds.clear()
                    self._aborts.clear()
                    fail_exc, self._fail_all_exc = self._fail_all_exc, None
                try:
                    self._iteration(adds, aborts, fail_exc)
                except Exception as exc:  # a bug in this loop, not in a request: keep serving
                    logger.exception("Engine loop iteration failed; failing the in-flight requests")
                    self._fail_everything(EngineRequestError(f"engine loop error: {type(exc).__name__}: {exc}"))
                finally:
                    self._flush()
        except BaseException as exc:  # pragma: no cover - truly fatal
            self._dead = exc
            logger.exception("Engine loop died")
        finally:
            with self._cond:
                adds = list(self._adds)
                self._adds.clear()
            err = EngineShuttingDown("The server is shutting down.") if self._dead is None else \
                EngineDeadError(f"The engine loop died: {self._dead!r}")
            for add in adds:
                self._post(add.stream, add.stream._accept, err)
            try:
                self._fail_everything(err)
            except Exception:  # pragma: no cover
                logger.exception("failing in-flight requests at shutdown")
            self._flush()

    def _has_work(self) -> bool:
        try:
            return bool(self.engine.has_unfinished_requests())
        except Exception:
            logger.exception("LLMEngine.has_unfinished_requests() failed")
            return False

    def _iteration(self, adds: list[_PendingAdd], aborts: list[str], fail_exc: BaseException | None) -> None:
        if fail_exc is not None:
            self._fail_everything(fail_exc)
        aborted = set(aborts)
        if aborts:
            self._process_aborts(aborts)
        if adds:
            self._process_adds([a for a in adds if a.request_id not in aborted])
            self._flush()  # let the HTTP layer start responding before this step runs
        if self._has_work():
            self._step()
        elif aborts or fail_exc is not None:
            # Idle after freeing blocks: publish fresh gauges (running 0, KV usage ~0) right away.
            self._refresh_scheduler_stats()
        self.stat_logger_manager.maybe_log(time.monotonic())

    def _process_aborts(self, aborts: list[str]) -> None:
        states = [(rid, self._reqs.pop(rid)) for rid in dict.fromkeys(aborts) if rid in self._reqs]
        if not states:
            return
        try:
            self.engine.abort_request([rid for rid, _ in states])
        except Exception:
            logger.exception("LLMEngine.abort_request failed")
        now = time.monotonic()
        step = StepStats(finished=[self._finished_stats(st, None, now) for _, st in states])
        self.stat_logger_manager.record(step)

    def _process_adds(self, adds: list[_PendingAdd]) -> None:
        for add in adds:
            stream = add.stream
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params, arrival_time=add.arrival_time,
                                        priority=add.priority, cache_salt=add.cache_salt)
            except ValueError as exc:
                self._post(stream, stream._accept, exc)
                continue
            except Exception as exc:
                logger.exception("LLMEngine.add_request failed for %s", add.request_id)
                self._post(stream, stream._accept,
                           EngineRequestError(f"add_request failed: {type(exc).__name__}: {exc}"))
                continue
            n_prompt = len(add.prompt) if isinstance(add.prompt, list) else 0
            self._reqs[add.request_id] = _ReqState(stream, add.arrival_mono, add.params.n, add.params.max_tokens,
                                                   add.params.output_kind, num_prompt_tokens=n_prompt)
            self._post(stream, stream._accept, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.num_step_failures += 1
            logger.exception("LLMEngine.step() raised; failing its %d in-flight request(s) and continuing",
                             len(self._reqs))
            self._fail_everything(EngineRequestError(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        now = time.monotonic()
        step = StepStats()
        for out in outputs:
            st = self._reqs.get(out.request_id)
            if st is None:
                continue  # aborted while the step ran
            new_tokens = self._count_new_tokens(st, out)
            if new_tokens:
                if st.first_token_ts is None:
                    st.first_token_ts = now
                    step.ttfts.append(now - st.arrival)
                    step.num_prompt_tokens += len(out.prompt_token_ids or ())
                else:
                    step.itls.append(now - (st.last_token_ts or now))
                st.last_token_ts = now
                step.num_generation_tokens += new_tokens
            if not st.num_prompt_tokens:
                st.num_prompt_tokens = len(out.prompt_token_ids or ())
            for c in out.outputs:
                if c.finish_reason is not None:
                    st.finish_reasons[c.index] = c.finish_reason
            if out.error is not None:
                out = dataclasses.replace(out, finished=True)
                self._reqs.pop(out.request_id, None)
                step.finished.append(self._finished_stats(st, out, now))
                self._post(st.stream, st.stream._fail, EngineRequestError(out.error))
                continue
            if out.finished:
                self._reqs.pop(out.request_id, None)
                step.finished.append(self._finished_stats(st, out, now))
            self._post(st.stream, st.stream._put, out)
        try:
            step.scheduler, step.iteration = split_engine_stats(self.engine.get_stats())
        except Exception:
            logger.exception("LLMEngine.get_stats() failed")
        self.stat_logger_manager.record(step)
        if not outputs and step.iteration is not None and step.iteration.num_scheduled_tokens == 0:
            # The scheduler could not run anything (should not happen: requests that can never fit
            # are rejected by add_request).  Do not spin at 100% CPU; an add/abort wakes us early.
            with self._cond:
                if not (self._adds or self._aborts or self._stop):
                    self._cond.wait(0.005)

    @staticmethod
    def _count_new_tokens(st: _ReqState, out: RequestOutput) -> int:
        new = 0
        for c in out.outputs:
            if st.output_kind == RequestOutputKind.DELTA:
                n = len(c.token_ids)
                st.tokens_per_index[c.index] = st.tokens_per_index.get(c.index, 0) + n
                new += n
            else:
                prev = st.tokens_per_index.get(c.index, 0)
                st.tokens_per_index[c.index] = len(c.token_ids)
                new += max(0, len(c.token_ids) - prev)
        return new

    def _finished_stats(self, st: _ReqState, out: RequestOutput | None, now: float) -> FinishedRequestStats:
        # Samples that finished keep their reason; the rest of an aborted/failed request count as "abort".
        reasons = [st.finish_reasons.get(i, "abort") for i in range(st.n)]
        m = out.metrics if out is not None else None
        queue = prefill = decode = inference = None
        if m is not None:
            if m.first_scheduled_time is not None and m.arrival_time:
                queue = max(0.0, m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None and m.first_scheduled_time is not None:
                prefill = max(0.0, m.first_token_time - m.first_scheduled_time)
            if m.last_token_time is not None and m.first_token_time is not None:
                decode = max(0.0, m.last_token_time - m.first_token_time)
            end = m.finished_time or m.last_token_time
            if end is not None and m.first_scheduled_time is not None:
                inference = max(0.0, end - m.first_scheduled_time)
        per_seq = max(st.tokens_per_index.values(), default=0)
        tpot = None
        if per_seq > 1 and st.first_token_ts is not None and st.last_token_ts is not None:
            tpot = (st.last_token_ts - st.first_token_ts) / (per_seq - 1)
        return FinishedRequestStats(
            finish_reasons=reasons, e2e_latency=now - st.arrival, num_prompt_tokens=st.num_prompt_tokens,
            num_generation_tokens=sum(st.tokens_per_index.values()), queue_time=queue, prefill_time=prefill,
            decode_time=decode, inference_time=inference, mean_time_per_output_token=tpot,
            num_cached_tokens=(out.num_cached_tokens if out is not None else 0), n=st.n, max_tokens=st.max_tokens)

    def _fail_everything(self, exc: BaseException) -> None:
        states = list(self._reqs.items())
        self._reqs.clear()
        if states:
            try:
                self.engine.abort_request([rid for rid, _ in states])
            except Exception:
                logger.exception("LLMEngine.abort_request failed while failing in-flight requests")
        now = time.monotonic()
        for rid, st in states:
            self._post(st.stream, st.stream._fail, exc)
        if states:
            self.stat_logger_manager.record(StepStats(finished=[self._finished_stats(st, None, now)
                                                                for _, st in states]))
        self._refresh_scheduler_stats()

    def _refresh_scheduler_stats(self) -> None:
        try:
            sched, _ = split_engine_stats(self.engine.get_stats())
        except Exception:
            logger.exception("LLMEngine.get_stats() failed")
            return
        self.stat_logger_manager.update_scheduler_stats(sched)

    # ----------------------------------------------------------------------- hand-off to asyncio
    def _post(self, stream: RequestStream, fn: Callable[..., None], *args: Any) -> None:
        self._outbox.append((stream.loop, fn, args))

    def _flush(self) -> None:
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[..., None], tuple]]] = {}
        for loop, fn, args in outbox:
            by_loop.setdefault(loop, []).append((fn, args))
        for loop, calls in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_calls, calls)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _run_calls(calls: list[tuple[Callable[..., None], tuple]]) -> None:
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:  # pragma: no cover - a bug in the delivery code must not kill the others
            logger.exception("delivering an engine output failed")
