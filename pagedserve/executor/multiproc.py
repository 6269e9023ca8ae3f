"""`mp` backend: one process per worker rank on this machine."""
from __future__ import annotations

import multiprocessing
import weakref

from pagedserve.executor.distributed import DistributedExecutor
from pagedserve.executor.worker import WorkerSpec, multiproc_worker_main

JOIN_TIMEOUT_S = 5.0


class MultiprocExecutor(DistributedExecutor):
    backend = "mp"

    def _store_host(self) -> str:
        return "127.0.0.1"

    def _launch(self, specs: list[WorkerSpec]) -> None:
        # never fork the engine process (it holds torch's thread pools): a fork server, started once per process
        # with torch and this package imported, forks clean workers (the second engine starts in a fraction)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["pagedserve.executor.worker"])
        self._procs = {spec.rank: ctx.Process(target=multiproc_worker_main, args=(spec,), daemon=True,
                                              name=f"pagedserve-rank{spec.rank}") for spec in specs}
        for proc in self._procs.values():
            proc.start()
        # an engine dropped without shutdown() (or failing after start-up) must not leave workers behind
        weakref.finalize(self, _kill, list(self._procs.values()))

    def _dead_workers(self) -> list[str]:
        return [f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                for rank, proc in self._procs.items() if not proc.is_alive()]

    def _stop_workers(self, graceful: bool) -> None:
        for proc in self._procs.values():
            proc.join(JOIN_TIMEOUT_S if graceful else 0)
        _kill(list(self._procs.values()))

    @property
    def worker_pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self._procs.items()}


def _kill(procs: list[multiprocessing.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
