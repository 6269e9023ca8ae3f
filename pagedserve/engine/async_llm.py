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
* `add_request` validates on the caller's thread through the engine's InputProcessor (InvalidRequestError
  -> 400 before anything is queued), refuses with QueueFullError (429) when `max_queued_requests` sequences
  already wait, and is then awaited until the engine thread has queued it, so any rejection reaches the HTTP
  layer before a streaming response has started.
* Failure isolation: the engine fails only the requests of a step in which anything raised (scheduling, KV
  connector I/O, the forward, output processing; their outputs carry `error`: those streams end with
  EngineRequestError, a 500) and keeps serving everyone else.  If the loop itself raises (a bug), every
  in-flight request is failed, the iteration counts as a failed step, and the loop goes on.  `health()` is
  unhealthy after `max_consecutive_step_failures` failed steps in a row, until a step succeeds again, and while
  a step has run longer than `step_timeout_s` (a hung store or kernel: the watchdog), until it returns.
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
import functools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable

from pagedserve.config import EngineConfig, KVCacheConfig
from pagedserve.engine.events import EngineEventRecorder
from pagedserve.engine.input_processor import InputProcessor, ProcessedRequest
from pagedserve.engine.protocol import EngineHealth
from pagedserve.engine.request_stream import RequestStream, merge_delta
from pagedserve.errors import (EngineDeadError, EngineRequestError, EngineShuttingDown, InvalidRequestError,
                               QueueFullError, RequestAborted)
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics.loggers import LoggingStatLogger, StatLoggerBase, StatLoggerManager
from pagedserve.metrics.server_profile import ServerProfile
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedserve.engine")

# vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S: a step running longer is reported by /health (it is not interrupted)
DEFAULT_STEP_TIMEOUT_S = 60.0

__all__ = ["AsyncLLM", "RequestStream", "merge_delta", "EngineDeadError", "EngineRequestError",
           "EngineShuttingDown", "QueueFullError", "RequestAborted"]


class EngineThread(threading.Thread):
    """The one thread that builds the engine and then steps it (jobs run in order; `close` ends it after them).

    OpenMP (libgomp, which torch's CPU wheel uses) keeps a thread pool per thread that runs parallel regions.
    Built on the main thread (weight packing, warm-up) and stepped on another, the engine had two pools; libgomp
    then counts more threads than cores and cuts its spin-wait to 1000 iterations, so nearly every parallel region
    of a step woke its worker with a futex: on a 2-core VM ~30% of the server's CPU time went to those wake-ups,
    and it served 0.55-0.6x the tokens/s of the same engine stepped offline. One thread, one pool."""

    def __init__(self) -> None:
        super().__init__(name="pagedserve-engine", daemon=True)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)


# ------------------------------------------------------------------------------------------- the loop
@dataclass
class _PendingAdd:
    processed: ProcessedRequest
    stream: RequestStream


class AsyncLLM:
    """Implements the EngineClient protocol (pagedserve/engine/protocol.py) around one LLMEngine."""

    def __init__(self, engine: "LLMEngine", *, log_stats: bool = True, log_interval_s: float = 10.0,
                 stat_loggers: Iterable[StatLoggerBase] = (), start: bool = True,
                 max_queued_requests: int | None = None, max_consecutive_step_failures: int = 5,
                 step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
                 engine_thread: EngineThread | None = None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # monotonic start of the step running now (engine thread writes)
        loggers: list[StatLoggerBase] = list(stat_loggers)
        if log_stats:
            loggers.insert(0, LoggingStatLogger(log_interval_s))
        self.stat_logger_manager = StatLoggerManager(loggers, log_interval_s)
        self._cond = threading.Condition()
        self._adds: deque[_PendingAdd] = deque()
        self._num_pending_seqs = 0  # sequences in _adds
        self._num_waiting = 0  # sequences in the engine's waiting queue (engine thread's last snapshot)
        self._aborts: deque[str] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # run on the engine thread between steps
        self._fail_all_exc: BaseException | None = None
        self._stop = False
        self._draining = False
        self._dead: BaseException | None = None
        self._inflight: dict[str, RequestStream] = {}  # engine thread only
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Callable[..., None], tuple]] = []
        self.profile = ServerProfile()  # where the time goes, per step (GET /metrics: pagedserve:server_profile_*)
        self._thread: threading.Thread | None = None
        self._engine_thread = engine_thread  # the thread the engine was built on, if any: it steps there too
        self.consecutive_step_failures = 0
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> "AsyncLLM":
        """Builds the engine (model, KV cache, native kernels, warm-up) before returning: ready means ready. It is
        built on the thread that will step it (EngineThread)."""
        from pagedserve.engine.llm_engine import LLMEngine

        thread = EngineThread()
        try:
            engine = thread.submit(lambda: LLMEngine.from_engine_args(engine_args)).result()
        except BaseException:
            thread.close()
            raise
        return cls(engine, engine_thread=thread, **kwargs)

    # ---------------------------------------------------------------------------------- properties
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return self.engine.kv_cache_config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    @property
    def events(self) -> EngineEventRecorder:
        return self.engine.events

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop and self._dead is None

    @property
    def accepting(self) -> bool:
        return self.is_running and not self._draining

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    def health(self) -> EngineHealth:
        if self._dead is not None:
            return EngineHealth(False, "dead", f"the engine loop died: {self._dead!r}")
        if self.engine.dead_reason is not None:  # a worker rank is gone: no step can run any more
            return EngineHealth(False, "dead", self.engine.dead_reason)
        if self._thread is None:
            return EngineHealth(False, "starting", "the engine loop has not started")
        if not self._thread.is_alive():
            return EngineHealth(False, "dead", "the engine loop is not running")
        if self._stop or self._draining:
            return EngineHealth(False, "draining", "the server is shutting down")
        started = self._step_started
        if started is not None and self.step_timeout_s is not None:
            running_s = time.monotonic() - started
            if running_s > self.step_timeout_s:
                return EngineHealth(False, "stalled", f"the current engine step has run for {running_s:.1f} s "
                                                      f"(--step-timeout-s {self.step_timeout_s:g})")
        if self.consecutive_step_failures >= self.max_consecutive_step_failures:
            return EngineHealth(False, "failing", f"the last {self.consecutive_step_failures} engine steps failed")
        return EngineHealth(True, "ok")

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        with self._cond:
            self.stat_logger_manager.loggers.append(stat_logger)

    def start(self) -> None:
        if self._thread is not None:
            return
        if self._engine_thread is not None:
            self._thread = self._engine_thread
            self._engine_thread.submit(self._run)
            self._engine_thread.close()  # the thread ends when the loop does
            return
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- asyncio API
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                          priority: int = 0, cache_salt: str | None = None,
                          prompt_param: str = "prompt", lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate, check the queue, queue the request and wait until the engine has taken it."""
        self._check_accepting()
        processed = await self.input_processor.process_async(request_id, prompt, params, priority=priority,
                                                             cache_salt=cache_salt, prompt_param=prompt_param,
                                                             lora_request=lora_request)
        loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise InvalidRequestError(f"Request id {request_id!r} is already in flight.", param="request_id")
        stream = RequestStream(request_id, loop, params.output_kind, on_close=self._forget)
        with self._cond:
            if self._stop or self._draining:
                raise EngineShuttingDown("The server is shutting down; not accepting new requests.")
            limit = self.max_queued_requests
            if limit is not None and self._num_waiting + self._num_pending_seqs + params.n > limit:
                self.stat_logger_manager.record_rejected()
                raise QueueFullError(f"The server is overloaded: {self._num_waiting + self._num_pending_seqs} "
                                     f"sequences are already waiting (limit {limit}, --max-queued-requests). "
                                     f"Retry later.", retry_after=1)
            self._streams[request_id] = stream
            self._adds.append(_PendingAdd(processed, stream))
            self._num_pending_seqs += params.n
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

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (POST /reset_prefix_cache), between two engine steps. False while requests
        hold blocks (as LLM.reset_prefix_cache)."""
        self._check_accepting()
        return await self._between_steps(self.engine.kv_cache_manager.block_pool.reset_prefix_cache)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter's weights on the engine thread, between two steps (ValueError if it does not fit)."""
        return await self._between_steps(functools.partial(self.engine.add_lora, lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._between_steps(functools.partial(self.engine.remove_lora, lora_int_id))

    async def _between_steps(self, call: Callable[[], Any]) -> Any:
        """`call()` on the engine thread between two steps; its result or its exception."""
        future: Future = Future()
        with self._cond:
            self._calls.append((call, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

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
        self.engine.events.close()  # the trace file, if any, ends with the last step
        if self._thread is None or not self._thread.is_alive():  # the engine is idle for good: stop its workers
            self.engine.shutdown()

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"The engine loop died: {self._dead!r}")
        if self.engine.dead_reason is not None:
            raise EngineDeadError(f"The engine cannot run: {self.engine.dead_reason}")
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
                    while not (self._stop or self._adds or self._aborts or self._calls or self._fail_all_exc is not None
                               or self.engine.has_unfinished_requests()):
                        timeout = self.stat_logger_manager.next_log_in(time.monotonic())
                        if timeout is not None and timeout <= 0:
                            break
                        self.profile.idle()
                        self._cond.wait(timeout)
                    if self._stop:
                        break
                    adds, aborts = list(self._adds), list(self._aborts)
                    self._adds.clear()
                    self._aborts.clear()
                    self._num_pending_seqs = 0
                    fail_exc, self._fail_all_exc = self._fail_all_exc, None
                    calls = list(self._calls)
                    self._calls.clear()
                for fn, future in calls:  # between steps: the engine's state is the engine thread's alone
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except Exception as exc:
                            future.set_exception(exc)
                try:
                    self._iteration(adds, aborts, fail_exc)
                except Exception as exc:  # a bug in this loop, not in a request: keep serving
                    logger.exception("Engine loop iteration failed; failing the in-flight requests")
                    self.consecutive_step_failures += 1
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

    def _iteration(self, adds: list[_PendingAdd], aborts: list[str], fail_exc: BaseException | None) -> None:
        if fail_exc is not None:
            self._fail_everything(fail_exc)
        aborted = set(aborts)
        if aborts:
            ids = [rid for rid in dict.fromkeys(aborts) if self._inflight.pop(rid, None) is not None]
            self.engine.abort_request(ids)
        if adds:
            for add in adds:
                if add.processed.request_id not in aborted:
                    self._add(add)
                    self._num_waiting += add.processed.params.n  # until the step's stats say exactly
            self._flush()  # let the HTTP layer start responding before this step runs
        if self.engine.has_unfinished_requests():
            self._step()
        elif aborts or fail_exc is not None:
            # Idle after freeing blocks: publish fresh gauges (running 0, KV usage ~0) right away.
            self.stat_logger_manager.record(self.engine.take_step_stats())
            self._num_waiting = 0
        self.stat_logger_manager.maybe_log(time.monotonic())

    def _add(self, add: _PendingAdd) -> None:
        stream = add.stream
        try:
            self.engine.add_processed_request(add.processed)
        except ValueError as exc:
            self._post(stream, stream._accept, exc)
            return
        self._inflight[add.processed.request_id] = stream
        self._post(stream, stream._accept, None)

    def _step(self) -> None:
        failures_before = self.engine.num_step_failures
        self._step_started = time.monotonic()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            outputs = self.engine.step()
        finally:
            self._step_started = None
        t1 = time.perf_counter()
        it = self.engine.last_iteration
        self.profile.record_step(t1 - t0, time.thread_time() - cpu0, it.forward_time, it.output_time, t1)
        if self.engine.num_step_failures > failures_before:
            self.consecutive_step_failures += 1
        elif self.engine.last_iteration.num_scheduled_tokens:
            self.consecutive_step_failures = 0
        for out in outputs:
            stream = self._inflight.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if out.finished:
                del self._inflight[out.request_id]
            if out.error is not None:
                self._post(stream, stream._fail, EngineRequestError(out.error))
            else:
                self._post(stream, stream._put, out)
        stats = self.engine.take_step_stats()
        self._num_waiting = stats.scheduler.num_waiting_reqs
        self.stat_logger_manager.record(stats)
        if not outputs and stats.iteration.num_scheduled_tokens == 0:
            # The scheduler could not run anything (should not happen: requests that can never fit
            # are rejected by the input processor).  Do not spin at 100% CPU; an add/abort wakes us early.
            with self._cond:
                if not (self._adds or self._aborts or self._stop):
                    self._cond.wait(0.005)

    def _fail_everything(self, exc: BaseException) -> None:
        streams = list(self._inflight.items())
        self._inflight.clear()
        if streams:
            try:
                self.engine.abort_request([rid for rid, _ in streams])
            except Exception:
                logger.exception("LLMEngine.abort_request failed while failing in-flight requests")
        for _, stream in streams:
            self._post(stream, stream._fail, exc)
        self.stat_logger_manager.record(self.engine.take_step_stats())

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
        posted = time.perf_counter()
        for loop, calls in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_calls, calls, self.profile, posted)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _run_calls(calls: list[tuple[Callable[..., None], tuple]], profile: ServerProfile, posted: float) -> None:
    started = time.perf_counter()
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:  # pragma: no cover - a bug in the delivery code must not kill the others
            logger.exception("delivering an engine output failed")
    profile.record_delivery(posted, started, time.perf_counter())
