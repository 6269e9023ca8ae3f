"""The closed loop of the in-process drivers (openvino_cb_driver.py, pagedserve_engine_driver.py): C requests in
flight over an engine's step(), and each request's timings the way `bench serve` measures them over HTTP.

After every step the driver reports each request's new tokens (one read that yields tokens = one "chunk", as one
streamed SSE chunk is for a server): TTFT = submit -> first chunk, ITL = the gaps between a request's chunks,
latency = submit -> last chunk (pagedserve/benchmarks/metrics.py's definitions). Standard library only: the
OpenVINO driver runs in the peer's own virtualenv, without pagedserve.
"""
from __future__ import annotations

import time
from collections import deque


class ClosedLoop:
    def __init__(self, requests: list[dict], conc: int) -> None:
        self.requests, self.conc = requests, conc
        self.pending = deque(range(len(requests)))
        self.active: dict[int, dict] = {}
        self.records: list[dict | None] = [None] * len(requests)
        self.t0 = time.perf_counter()

    def running(self) -> bool:
        return bool(self.pending or self.active)

    def to_submit(self) -> list[int]:
        """The requests to add now (their index in `requests`): as many as keep C in flight."""
        out = []
        while self.pending and len(self.active) + len(out) < self.conc:
            out.append(self.pending.popleft())
        return out

    def submitted(self, i: int, t: float) -> None:
        self.active[i] = {"start": t, "last": t, "chunks": 0, "tokens": 0, "ttft": 0.0, "itl": []}

    def new_tokens(self, i: int, n: int, now: float) -> None:
        if not n:
            return
        a = self.active[i]
        if a["chunks"] == 0:
            a["ttft"] = now - a["start"]
        else:
            a["itl"].append(now - a["last"])
        a["last"] = now
        a["chunks"] += 1
        a["tokens"] += n

    def finished(self, i: int, ok: bool, why: str = "") -> None:
        """Request i ended; ok also needs a first token (the exact output length is checked with the results)."""
        a = self.active.pop(i)
        want = int(self.requests[i]["output_len"])
        ok = ok and a["chunks"] > 0
        self.records[i] = {"success": ok, "prompt_len": len(self.requests[i]["prompt"]),
                           "output_tokens": a["tokens"], "ttft": a["ttft"], "itl": a["itl"],
                           "latency": a["last"] - a["start"], "start_time": a["start"],
                           "error": "" if ok else f"{why or 'ended early'}, {a['tokens']}/{want} tokens"}

    def result(self) -> dict:
        return {"duration": time.perf_counter() - self.t0, "requests": self.records}
