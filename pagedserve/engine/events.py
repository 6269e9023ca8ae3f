"""Engine events: what each step did, as a compact, versioned stream (SSE at /v1/events, JSONL with --trace-file).

Recording is on only while someone listens (an SSE subscriber, a trace file): otherwise `begin_step` is one
attribute test and the block pool has no observer. Events are serialized once, on the engine thread, into a
bounded ring (`EventRing`) that readers on other threads poll by sequence number; the trace file gets the same
lines.

Two views, because the events show other clients' traffic. The redacted view (every API key, the trace file) has
no prompt-derived data: no token ids, no block hashes (a hash of a guessed prompt would confirm it), and the config
without credentials. The full view adds the vLLM KV-cache events (`kv_events`: BlockStored with its token ids and
hashes) for a KV-aware router; it is built only while a full-view reader (the admin key) is connected, so nobody
pays for it otherwise. The config is redacted in both views: no reader needs a password.

Event types (every event has "v" = EVENTS_VERSION, "type", "seq", "t" = wall-clock seconds):
  snapshot  config, the whole block pool ("blocks": one digit per block, a BlockState), running and waiting
            requests. Emitted when recording starts, when a reader fell behind, and every SNAPSHOT_EVERY steps,
            so a reader can always start from one.
  step      one engine step, derived from its SchedulerOutput: duration, forward time, budget and tokens used,
            prefill chunks [[id, new tokens, computed before, total tokens]], decodes [id] (and, for decodes that
            verified speculative drafts, spec [[id, drafts, tokens out]]), admissions with their
            prefix-cache hit [[id, hit tokens]], arrivals, preemptions, finishes [[id, reason]], queue depths,
            KV counts, the blocks whose state changed [[block id, BlockState]] (absolute states: applying them to
            any earlier snapshot gives the pool now) and, in the full view only, the vLLM-compatible KV-cache
            events of the step (`kv_events`).
  abort     requests aborted between steps (client gone, stop string in another sequence): ids, queue depths and
            the blocks their release changed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from pagedserve.config import EngineConfig, KVCacheConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventCollector, block_state,
                                       encode_block_hash)
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.engine.redaction import redact_secrets

EVENTS_VERSION = 1
DEFAULT_BUFFER_SIZE = 4096
SNAPSHOT_EVERY = 512  # steps: the ring always holds a snapshot to start from
# A reader that fell behind the ring asks for a snapshot; a whole-pool snapshot costs O(blocks) on the engine
# thread, so asking again within this many steps of the last one gets none (the ring's own do).
MIN_STEPS_BETWEEN_REQUESTED_SNAPSHOTS = 64
# A new reader finding no snapshot in the ring (recording just started) gets one built off the event loop, shared
# with every reader arriving while the pool did not change or within this many seconds.
SNAPSHOT_REUSE_S = 1.0
TRACE_FLUSH_INTERVAL_S = 1.0


def config_dict(config: EngineConfig, kv_cache: KVCacheConfig) -> dict[str, Any]:
    """The served config as plain JSON (what the dashboard shows and `diagnose` reasons about), secrets redacted:
    of the model what it is as served, and the cache with the block count the engine allocated."""
    out = dataclasses.asdict(dataclasses.replace(config, model=None))
    m = config.model
    out["model"] = {"path": m.path, "served_model_name": m.served_model_name, "is_default_model": m.is_default_model,
                    "architecture": m.architecture, "dtype": m.dtype, "max_model_len": m.max_model_len,
                    "vocab_size": m.vocab_size, "eos_token_ids": sorted(m.eos_token_ids)}
    out["cache"]["num_blocks"] = kv_cache.num_blocks
    return redact_secrets(out)


def open_private_file(path: str | Path) -> TextIO:
    """A new or truncated file only its owner can read (0600, whatever the umask or an earlier file's mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w", encoding="utf-8")


class EventRing:
    """A bounded, thread-safe buffer of serialized events; readers poll with the last sequence number they saw.
    Each event is kept in the redacted view and, when one was built, the full view; a full-view reader gets the
    full line where there is one (events from before a full-view reader connected have none)."""

    def __init__(self, capacity: int = DEFAULT_BUFFER_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"the event buffer needs room for at least one event, got {capacity}.")
        # (seq, type, redacted JSON line, full JSON line or None)
        self._items: deque[tuple[int, str, str, str | None]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.last_seq = 0

    def append(self, event: dict[str, Any], private: dict[str, Any] | None = None) -> str:
        """Add an event (its redacted view) and optionally its full view; returns the redacted line."""
        with self._lock:
            self.last_seq += 1
            event["seq"] = self.last_seq
            line = json.dumps(event, separators=(",", ":"))
            full = None
            if private is not None:
                private["seq"] = self.last_seq
                full = json.dumps(private, separators=(",", ":"))
            self._items.append((self.last_seq, event["type"], line, full))
        return line

    @staticmethod
    def _view(items, private: bool) -> list[tuple[int, str, str]]:
        return [(seq, kind, (full or line) if private else line) for seq, kind, line, full in items]

    def since(self, seq: int, private: bool = False) -> tuple[list[tuple[int, str, str]], bool]:
        """Events after `seq`, and whether some were already dropped (the reader fell behind the ring)."""
        with self._lock:
            if not self._items or self._items[-1][0] <= seq:
                return [], False
            missed = self._items[0][0] > seq + 1
            first = max(seq + 1 - self._items[0][0], 0)
            items = [self._items[i] for i in range(first, len(self._items))]
        return self._view(items, private), missed

    def from_oldest_snapshot(self, private: bool = False) -> list[tuple[int, str, str]]:
        """The backlog a new reader can apply: everything from the oldest snapshot still in the ring."""
        with self._lock:
            items = list(self._items)
        start = next((i for i, item in enumerate(items) if item[1] == "snapshot"), None)
        return [] if start is None else self._view(items[start:], private)

    def __len__(self) -> int:
        return len(self._items)


class EngineEventRecorder:
    """Owned by the LLMEngine; its `begin_step` / `on_scheduled` / `end_step` / `on_arrival` run on the engine
    thread. `subscribe` / `unsubscribe` / `request_snapshot` / `shared_snapshot` may be called from any thread."""

    def __init__(self, config: EngineConfig, kv_cache: KVCacheConfig, scheduler: Scheduler, kv: KVCacheManager,
                 buffer_size: int = DEFAULT_BUFFER_SIZE) -> None:
        self.config = config_dict(config, kv_cache)
        self.scheduler = scheduler
        self.kv = kv
        self.ring = EventRing(buffer_size)
        self._lock = threading.Lock()
        self._num_subscribers = 0
        self._num_private_subscribers = 0  # full-view readers: while any, steps also carry kv_events
        self._snapshot_wanted = False  # at the next step: recording (re)started or a trace was opened
        self._snapshot_requested = False  # a reader fell behind: granted unless one was taken recently
        self._trace: TextIO | None = None
        self._last_flush = 0.0
        self.active = False  # engine thread's view: recording this step
        self._collector = KVEventCollector(())
        self._step_id = 0
        self._steps_since_snapshot = 0
        self._t0 = 0.0
        self._wall0 = 0.0
        self._running_before: set[str] = set()
        self._scheduled: dict[str, Any] = {}
        self._drafts: dict[str, tuple[int, int]] = {}  # request id -> (draft tokens, outputs before the step)
        self._arrived: list[list[Any]] = []
        self._engine_steps = 0  # every step, recorded or not: tells whether a shared snapshot is still current
        self._shared_lock = threading.Lock()
        self._shared: tuple[tuple, float, int, str] | None = None  # (pool key, built at, seq, JSON line)
        self.num_snapshots_built = 0  # whole-pool snapshots serialized (engine thread and shared ones)

    # ------------------------------------------------------------------ listeners (any thread)
    @property
    def num_subscribers(self) -> int:
        return self._num_subscribers

    @property
    def wanted(self) -> bool:
        return self._num_subscribers > 0 or self._trace is not None

    def subscribe(self, private: bool = False) -> None:
        """A new reader. It needs no snapshot of its own: the ring holds one (taken when recording started, then
        every SNAPSHOT_EVERY steps), or else `shared_snapshot` serves it."""
        with self._lock:
            self._num_subscribers += 1
            self._num_private_subscribers += private

    def unsubscribe(self, private: bool = False) -> None:
        with self._lock:
            self._num_subscribers = max(self._num_subscribers - 1, 0)
            self._num_private_subscribers = max(self._num_private_subscribers - private, 0)

    def request_snapshot(self) -> None:
        self._snapshot_requested = True

    def open_trace(self, path: str | Path) -> None:
        """Write every event from the next step on to `path` (JSONL, redacted view, mode 0600), starting with a
        snapshot."""
        self._trace = open_private_file(path)
        self._snapshot_wanted = True

    def close(self) -> None:
        trace, self._trace = self._trace, None
        if trace is not None:
            trace.close()

    # ------------------------------------------------------------------ the engine thread
    def begin_step(self) -> None:
        self._engine_steps += 1
        if self.wanted != self.active:
            self._set_active(self.wanted)
        if not self.active:
            return
        if self._snapshot_requested and self._steps_since_snapshot >= MIN_STEPS_BETWEEN_REQUESTED_SNAPSHOTS:
            self._snapshot_wanted = True
        if self._snapshot_wanted or self._steps_since_snapshot >= SNAPSHOT_EVERY:
            self._emit(self.snapshot(exact=True))
        self._t0, self._wall0 = time.perf_counter(), time.time()
        self._running_before = {r.request_id for r in self.scheduler.running}

    def on_arrival(self, request: Request) -> None:
        self._arrived.append([request.request_id, request.num_prompt_tokens, request.arrival_time])

    def on_aborted(self, requests: list[Request]) -> None:
        """Aborts happen between steps (and may leave the engine idle): reported at once."""
        self._emit({"v": EVENTS_VERSION, "type": "abort", "t": time.time(), "step": self._step_id,
                    "finished": [[r.request_id, "abort"] for r in requests],
                    "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                    "blocks": self._collector.take().changed})

    def on_scheduled(self, out: SchedulerOutput) -> None:
        """Capture each scheduled request's progress before the step advances it."""
        prefill, decode, admitted = [], [], []
        self._drafts = {}
        for item in out.scheduled:
            r = item.request
            if r.num_computed_tokens == r.num_tokens - 1 and r.num_computed_tokens >= r.num_prompt_tokens:
                decode.append(r.request_id)
                if item.num_new_tokens > 1:  # the next token plus speculative drafts to verify
                    self._drafts[r.request_id] = (item.num_new_tokens - 1, r.num_output_tokens)
            else:
                prefill.append([r.request_id, item.num_new_tokens, r.num_computed_tokens, r.num_tokens])
            if r.request_id not in self._running_before:
                admitted.append([r.request_id, r.num_computed_tokens])  # computed = the prefix hit, at admission
        self._scheduled = {"prefill": prefill, "decode": decode, "admitted": admitted}

    def end_step(self, out: SchedulerOutput, forward_time: float, failed: bool = False) -> None:
        duration = time.perf_counter() - self._t0
        finished = [[item.request.request_id, item.request.status.finish_reason] for item in out.scheduled
                    if item.request.is_finished]
        delta = self._collector.take()
        pool = self.kv.block_pool
        scheduled = self._scheduled
        num_prefill = sum(p[1] for p in scheduled.get("prefill", ()))
        # decodes that verified drafts: [id, drafts, tokens this step] (accepted drafts + the sampled token)
        spec = [[item.request.request_id, self._drafts[item.request.request_id][0],
                 item.request.num_output_tokens - self._drafts[item.request.request_id][1]]
                for item in out.scheduled if item.request.request_id in self._drafts]
        event: dict[str, Any] = {
            "v": EVENTS_VERSION, "type": "step", "t": self._wall0, "step": self._step_id,
            "dur": round(duration, 6), "fwd": round(forward_time, 6), "failed": failed,
            "budget": self.scheduler.config.max_num_batched_tokens, "tokens": out.num_scheduled_tokens,
            "prefill_tokens": num_prefill, "decode_tokens": out.num_scheduled_tokens - num_prefill,
            **scheduled, "spec": spec,
            "arrived": self._arrived, "preempted": out.preempted_request_ids, "finished": finished,
            "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
            "kv": {"allocated": delta.num_allocated, "freed": delta.num_freed, "stored": delta.num_stored,
                   "evicted": delta.num_evicted, "hit_blocks": delta.num_hit_blocks,
                   "used": pool.num_used_blocks, "total": pool.num_blocks,
                   "states": list(self._collector.counts)},  # blocks per BlockState: free, cached, in use, shared
            "blocks": delta.changed,
        }
        # the full view only: the token ids and hashes of other clients' prompts
        private = {**event, "kv_events": self._kv_events(delta, out)} if self._num_private_subscribers else None
        self._arrived = []
        self._scheduled = {}
        self._step_id += 1
        self._steps_since_snapshot += 1
        self._emit(event, private)
        if self._trace is not None and not self.scheduler.has_unfinished_requests():
            self._trace.flush()  # idle now: a reader of the trace sees every step so far

    def snapshot(self, exact: bool) -> dict[str, Any]:
        """The whole state. `exact=False` reads from another thread: block states may be one step stale (the
        following step events carry absolute states, which heal it) and the request lists are left out."""
        if exact:
            self._snapshot_wanted = self._snapshot_requested = False
            self._steps_since_snapshot = 0
        self.num_snapshots_built += 1
        pool = self.kv.block_pool
        event = {
            "v": EVENTS_VERSION, "type": "snapshot", "t": time.time(), "step": self._step_id, "exact": exact,
            "config": self.config,
            "blocks": "".join(str(int(block_state(b))) for b in pool.blocks),
            "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
        }
        if exact:
            event["requests"] = [[r.request_id, r.status.name.lower(), r.num_prompt_tokens, r.num_computed_tokens,
                                  r.num_output_tokens, r.arrival_time]
                                 for r in [*self.scheduler.running, *self.scheduler.waiting]]
        return event

    def shared_snapshot(self) -> tuple[int, str]:
        """(seq, JSON line) of an inexact snapshot for a reader that finds none in the ring. Built at most once
        while the pool is unchanged (or within SNAPSHOT_REUSE_S): a crowd of new readers costs one O(blocks)
        build, not one each. Blocking: call it off the event loop."""
        with self._shared_lock:
            key = (self._engine_steps, self.ring.last_seq, self.kv.block_pool.num_free_blocks)
            shared = self._shared
            if shared is None or (shared[0] != key and time.monotonic() - shared[1] > SNAPSHOT_REUSE_S):
                seq = self.ring.last_seq
                event = self.snapshot(exact=False)
                event["seq"] = seq
                shared = self._shared = (key, time.monotonic(), seq, json.dumps(event, separators=(",", ":")))
            return shared[2], shared[3]

    # ------------------------------------------------------------------ internals
    def _set_active(self, active: bool) -> None:
        self.active = active
        pool = self.kv.block_pool
        if active:
            self._collector = KVEventCollector(pool.blocks)
            pool.observer = self._collector
            self._snapshot_wanted = True
        else:
            pool.observer = None
            self._arrived = []

    def _kv_events(self, delta, out: SchedulerOutput) -> list[dict[str, Any]]:
        events: list[Any] = []
        if delta.cleared:
            events.append(AllBlocksCleared())
        if delta.removed_hashes:
            events.append(BlockRemoved([encode_block_hash(h) for h in delta.removed_hashes]))
        if delta.stored_hashes:
            events += self._stored_events(set(delta.stored_hashes), out)
        return [{"type": type(e).__name__, **dataclasses.asdict(e)} for e in events]

    def _stored_events(self, stored: set, out: SchedulerOutput) -> list[BlockStored]:
        """One BlockStored per request and run of consecutive blocks, with their tokens and parent (as vLLM)."""
        bs = self.kv.block_size
        events = []
        for item in out.scheduled:
            hashes = item.request.block_hashes
            lora = item.request.lora_request
            indices = [i for i, h in enumerate(hashes) if h in stored]
            stored.difference_update(hashes[i] for i in indices)
            while indices:
                n = 1
                while n < len(indices) and indices[n] == indices[0] + n:
                    n += 1
                first, last = indices[0], indices[n - 1]
                parent = encode_block_hash(hashes[first - 1]) if first else None
                events.append(BlockStored([encode_block_hash(h) for h in hashes[first:last + 1]], parent,
                                          item.request.all_token_ids[first * bs:(last + 1) * bs], bs,
                                          lora.lora_int_id if lora is not None else None))
                indices = indices[n:]
        return events

    def _emit(self, event: dict[str, Any], private: dict[str, Any] | None = None) -> None:
        line = self.ring.append(event, private)
        if self._trace is not None:
            self._trace.write(line + "\n")
            now = time.monotonic()
            if now - self._last_flush > TRACE_FLUSH_INTERVAL_S:
                self._trace.flush()
                self._last_flush = now
