"""glibc's malloc set for a forward loop that allocates the same large activations every step.

By default glibc serves large blocks (from 128 KiB; the threshold adapts, up to 32 MiB) with fresh mmap pages and
returns free memory at the top of the heap to the OS once it exceeds twice that threshold. A step's activations are
tens of MB (a 2048-token float32 prefill of SmolLM2 writes 25 MB out of one MLP product), so every step faulted them
back in and the kernel zeroed them: 85,000-520,000 page faults in a prefill-heavy run of 7 steps. With the mmap
threshold pinned at its maximum and the heap never trimmed, freed blocks serve the next step (18,000-21,000 faults
in the same run). Blocks of 32 MiB and more (a 2048-token prefill's QKV and gate/up outputs on Qwen3-0.6B: 32 and
48 MiB) are never served from mmap either (M_MMAP_MAX 0): they still faulted in every step, 12,000 faults and ~20 ms
per 48 MiB tensor on a 2-vCPU VM (BENCHMARKS.md section 51). The engine steps on its own thread (async_llm.py), whose
arena takes memory in heaps of 64 MiB, and glibc unmaps a heap freed whole unless it is within the top pad of the
next: with the top pad at 64 MiB more of them stay (a block larger than a heap is still mapped for itself). A run of
32 requests on Qwen3-0.6B Q4_K_M stepped on a thread faulted 14-3,400 times a round instead of 770,000-990,000
(1.12x the tokens/s). This is what a caching allocator (tcmalloc, which vLLM's CPU backend asks users to preload)
does; PAGEDSERVE_KEEP_FREED_MEMORY=0 leaves glibc's defaults.
"""
from __future__ import annotations

import ctypes
import logging

from pagedserve import envs

logger = logging.getLogger("pagedserve")

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
HEAP_PAD = 64 << 20  # a thread arena's heap size: glibc deletes an emptied heap only when that frees more than this
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit systems
NEVER_TRIM = 2**31 - 1  # the largest value mallopt's int takes


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (see the module docstring). Returns whether it did: False
    when disabled by PAGEDSERVE_KEEP_FREED_MEMORY=0 or when the C library is not glibc."""
    if not envs.PAGEDSERVE_KEEP_FREED_MEMORY:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator is left as it is
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    done = (mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
            and mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TOP_PAD, HEAP_PAD) == 1)
    if not done:
        logger.warning("mallopt refused the allocator settings; glibc's defaults stay (more page faults per step).")
    return done
