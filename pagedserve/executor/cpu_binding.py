"""Per-rank CPU binding, as vLLM's CPU backend does it (VLLM_CPU_OMP_THREADS_BIND="0-31|32-63"): one core list per
rank, separated by '|'. A rank pins itself to its cores and runs one torch thread per core, so two ranks on two
NUMA nodes each stream their half of the weights from local memory."""
from __future__ import annotations

import os

import torch

from pagedserve import envs

def parse_cpu_bind(spec: str, world_size: int) -> list[list[int]]:
    """'0-31|32-63' -> [[0..31], [32..63]]; a clear ValueError for a malformed spec or a core this process may not
    use."""
    allowed = os.sched_getaffinity(0)
    ranks = spec.split("|")
    if len(ranks) != world_size:
        raise ValueError(f"cpu_bind {spec!r} lists {len(ranks)} core set(s) for {world_size} rank(s) "
                         f"(tensor_parallel_size x pipeline_parallel_size); separate them with '|'.")
    result = []
    for text in ranks:
        cpus: list[int] = []
        try:
            for part in text.split(","):
                lo, _, hi = part.strip().partition("-")
                cpus.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"cpu_bind {spec!r}: {text!r} is not a core list like '0-3,8'.") from None
        if not cpus or not set(cpus) <= allowed:
            raise ValueError(f"cpu_bind {spec!r}: cores {sorted(set(cpus) - allowed) or text!r} are not available "
                             f"to this process (allowed: {sorted(allowed)}).")
        result.append(cpus)
    return result


def rank_cpus(cpu_bind: str | None, world_size: int) -> list[list[int]] | None:
    """Each rank's cores from the flag, else from the environment variable; None: no binding."""
    spec = cpu_bind or envs.PAGEDSERVE_CPU_OMP_THREADS_BIND
    return parse_cpu_bind(spec, world_size) if spec else None


def bind_threads(cpus: list[int] | None, num_threads: int) -> None:
    """Pin the calling thread (and the OpenMP threads it starts from now on) to `cpus`; set the torch pool size."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(num_threads)
