"""host_allocator.keep_freed_memory: freed activations are reused, not faulted back in every step."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from pagedserve.model_executor.host_allocator import keep_freed_memory

ENV_KEEP_FREED_MEMORY = "PAGEDSERVE_KEEP_FREED_MEMORY"

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

# Each round allocates (and touches) three 20 MiB tensors and frees them, as a step does with its activations; the
# page faults of rounds 2-4 are printed. glibc's defaults hand the 60 MiB back to the OS after each round.
SCENARIO = """
import resource, sys, torch
from pagedserve.model_executor.host_allocator import keep_freed_memory
print(keep_freed_memory(), file=sys.stderr)
def step():
    activations = [torch.ones(5 << 20) for _ in range(3)]
    del activations
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_three_steps(keep: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120,
                          env={**os.environ, ENV_KEEP_FREED_MEMORY: keep, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip()), done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@glibc
def test_freed_activations_are_reused_not_faulted_in_again():
    kept, applied = faults_of_three_steps("1")
    default, not_applied = faults_of_three_steps("0")
    assert (applied, not_applied) == ("True", "False")
    # 3 rounds x 60 MiB is 46,080 pages; the kept heap faults a fraction of them (measured 5-10k, against ~41k)
    assert kept * 2 < default, (kept, default)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_KEEP_FREED_MEMORY, "0")
    assert keep_freed_memory() is False
