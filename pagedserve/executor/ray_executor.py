"""`ray` backend: worker ranks are Ray actors in a placement group (one bundle per worker), so they may live on
other machines of a Ray cluster. `ray.init()` joins the cluster named by RAY_ADDRESS (as `ray start` prints it),
or starts a local one. The driver stays in the engine process; collectives are torch.distributed, as with `mp`."""
from __future__ import annotations

from pathlib import Path

from pagedserve.executor.distributed import DistributedExecutor
from pagedserve.executor.worker import WorkerSpec, run_worker

PLACEMENT_TIMEOUT_S = 60.0
PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the directory holding pagedserve/


class _RayWorker:
    def run(self, spec: WorkerSpec) -> None:
        import logging

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(levelname)s %(message)s")
        run_worker(spec)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedserve[ray]'.") from None
    return ray


class RayExecutor(DistributedExecutor):
    backend = "ray"
    health_check_interval_s = 1.0  # ray.wait costs ~0.1 ms; a dead actor's closed sockets fail the step anyway

    def _store_host(self) -> str:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init()
        return ray.util.get_node_ip_address()

    def _launch(self, specs: list[WorkerSpec]) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._placement = ray.util.placement_group([{"CPU": 1}] * len(specs), strategy="PACK")
        ray.get(self._placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        # the workers import this very package (a source checkout is not necessarily installed on the nodes)
        env = {"env_vars": {"PYTHONPATH": str(PACKAGE_PARENT)}}
        actor_cls = ray.remote(num_cpus=1)(_RayWorker)
        self._actors, self._runs = {}, {}
        for i, spec in enumerate(specs):
            strategy = PlacementGroupSchedulingStrategy(self._placement, placement_group_bundle_index=i)
            actor = actor_cls.options(scheduling_strategy=strategy, runtime_env=env).remote()
            self._actors[spec.rank] = actor
            self._runs[spec.rank] = actor.run.remote(spec)

    def _dead_workers(self) -> list[str]:
        ray = import_ray()
        refs = list(self._runs.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        dead = []
        for rank, ref in self._runs.items():
            if ref in done:
                try:
                    ray.get(ref)
                    status = "returned"
                except Exception as exc:  # RayActorError when killed, the worker's exception otherwise
                    status = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                dead.append(f"rank {rank} (Ray actor) {status}")
        return dead

    def _stop_workers(self, graceful: bool) -> None:  # the driver's shutdown message already ended run()
        ray = import_ray()
        for actor in self._actors.values():
            ray.kill(actor)
        ray.util.remove_placement_group(self._placement)

    def kill_worker(self, rank: int) -> None:
        """Test hook: kill one worker's actor as a crash would."""
        import_ray().kill(self._actors[rank])
