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

# Each round allocates (and touches) a step's activations and frees them: three 20 MiB tensors, or ("prefill") those
# of a 2048-token Qwen3-0.6B prefill, 32 and 48 MiB among them (past glibc's largest mmap threshold); the page faults
# of rounds 2-4 are printed. glibc's defaults hand them back to the OS after each round. THREAD: the steps run on a
# thread of their own, as the server's engine does (async_llm.EngineThread), whose arena is not the main one.
SCENARIO = """
import resource, sys, threading, torch
from pagedserve.model_executor.host_allocator import keep_freed_memory
print(keep_freed_memory(), file=sys.stderr)
mib = lambda n: torch.ones(n << 18)
def step():
    if PREFILL:
        residual, qkv = mib(8), mib(32)
        attention = mib(16)
        del qkv
        gate_up = mib(48)
        act = mib(24)
        del gate_up, act, attention, residual
    else:
        activations = [mib(20) for _ in range(3)]
        del activations
def steps():
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
if THREAD:
    thread = threading.Thread(target=steps)
    thread.start()
    thread.join()
else:
    steps()
"""


def faults_of_three_steps(keep: str, prefill: bool = False, thread: bool = False) -> tuple[int, str]:
    scenario = SCENARIO.replace("PREFILL", str(prefill)).replace("THREAD", str(thread))
    done = subprocess.run([sys.executable, "-c", scenario], capture_output=True, text=True, timeout=120,
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


@pytest.mark.slow
@glibc
@pytest.mark.parametrize("thread, at_least", [(False, 4), (True, 2)])
def test_a_prefills_activations_past_the_mmap_threshold_are_reused(thread, at_least):
    # 3 rounds x 128 MiB is 98,304 pages, all faulted again under glibc's defaults (measured 71,000-98,000); kept:
    # 2,000-10,000 on the main thread, ~29,000 on another (a thread's arena keeps fewer of its 64 MiB heaps), against
    # ~80,000 with the mmap threshold alone
    kept, applied = faults_of_three_steps("1", prefill=True, thread=thread)
    default, not_applied = faults_of_three_steps("0", prefill=True, thread=thread)
    assert (applied, not_applied) == ("True", "False")
    assert default > 50_000 and kept * at_least < default, (kept, default)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_KEEP_FREED_MEMORY, "0")
    assert keep_freed_memory() is False
