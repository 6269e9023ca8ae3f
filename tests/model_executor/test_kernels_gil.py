"""The native kernels that run a step's heavy work (decode_layers, small_gemm, small_gemm_int8, the two attention
kernels) let go of the GIL while they compute, so the server's event loop (SSE chunks, new requests) runs during the
forward instead of waiting for it.

The check counts events, not time: the switch interval is raised so that the calling thread never hands the GIL
over on its own between reading a counter and reading it again around one kernel call; another thread counts (and
lets go of the GIL after each count). The counter can move between the two reads only where the calling thread
lets go of the GIL. The call path itself (pybind11 and torch around any entry point) does so once per call, which
lets a count or two through (measured: at most 3 in any of 500 calls of these kernels while they held the GIL); a
kernel that computes without the GIL lets the counting thread run on and on (tens to hundreds of counts per call
on these inputs, each a millisecond or more of work). So a kernel passes when some call let at least ten counts
through; one that holds the GIL fails every one of the tries."""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable

import pytest
import torch
from kernel_capabilities import default_build

from pagedserve.model_executor.kernels import cpu_kernels

ops = cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no native kernels for this CPU")


def _counts_during(call: Callable[[], object], tries: int = 200) -> bool:
    """Whether another Python thread ran on (ten counts or more) during one of `tries` calls of `call()`."""
    count = 0
    started, stop = threading.Event(), threading.Event()

    def counter() -> None:
        nonlocal count
        started.set()
        while not stop.is_set():
            count += 1
            time.sleep(0)  # lets go of the GIL: the calling thread gets it back between two counts

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)  # no forced hand-over: only a blocking call (the kernel's release) lets it run
    thread = threading.Thread(target=counter, daemon=True)
    thread.start()
    try:
        started.wait()
        for _ in range(tries):
            before = count
            call()
            if count - before >= 10:
                return True
        return False
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()


def test_the_check_sees_a_call_that_holds_the_gil():
    """The check itself: a pure-Python busy call (which never lets go of the GIL) is never overlapped."""
    assert not _counts_during(lambda: sum(range(20_000)), tries=50)
    assert _counts_during(lambda: time.sleep(0.005), tries=50)  # and a call that releases it is seen


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gemm_case(dtype: torch.dtype):
    assert ops.native_small_gemm(dtype)
    n, k = 8192, 8192
    w = torch.randn(n, k)
    x = torch.randn(4, k)
    if dtype == torch.int8:
        scale = w.abs().amax(dim=1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        packed, shift = ops.pack_small_gemm_weight(q), 128 * q.sum(dim=1, dtype=torch.int32)
        return lambda: ops.small_gemm_int8(x, packed, scale, shift, n)
    packed = ops.pack_small_gemm_weight(w.to(dtype))
    x = x.to(dtype)
    return lambda: ops.small_gemm(x, packed, n)


def _attention_case(kind: str):
    heads, kvh, d, bs, blocks = 8, 2, 64, 16, 4096
    k_cache, v_cache = torch.randn(blocks, bs, kvh, d), torch.randn(blocks, bs, kvh, d)
    if kind == "decode":
        q = torch.randn(16, heads, d)
        tables = torch.arange(blocks).view(16, blocks // 16)
        lens = torch.full((16,), blocks // 16 * bs)
        return lambda: ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    assert ops.native_prefill(d)
    n = 128
    q, out = torch.randn(n, heads, d), torch.empty(n, heads, d)
    return lambda: ops.paged_prefill_attention(q, k_cache, v_cache, torch.arange(blocks), blocks * bs - n,
                                               d ** -0.5, out)


BUILD = default_build()
GEMM_CASES = {"small_gemm_fp32": torch.float32, "small_gemm_bf16": torch.bfloat16, "small_gemm_int8": torch.int8}
# the kernels the engine's build has on this CPU
CASES = ([case for case, dtype in GEMM_CASES.items() if dtype in BUILD.gemm_dtypes] + ["decode_attention"]
         + (["prefill_attention"] if BUILD.prefill else []))


@pytest.mark.parametrize("case", CASES)
def test_kernel_releases_the_gil(case, one_thread):
    call = _gemm_case(GEMM_CASES[case]) if case in GEMM_CASES else _attention_case(case.removesuffix("_attention"))
    call()  # first-call set-up (thread pools, packing caches) outside the check
    assert _counts_during(call), f"{case} held the GIL for the whole call"


@pytest.mark.slow
# only where the build's small GEMM runs float32 (elsewhere the Python layers run every step)
@pytest.mark.parametrize("dtype", ["float32"] if torch.float32 in BUILD.gemm_dtypes else [])
def test_decode_layers_releases_the_gil(dtype, tiny_model_dir, one_thread, monkeypatch):
    """The whole-stack decode, called by a real model's decode steps (a Llama of 4 layers, hidden size 1024: ~70 MB of
    float32 weights per step, so a step is long enough to count in)."""
    from pagedserve import LLM, SamplingParams

    model = tiny_model_dir("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=4)
    llm = LLM(str(model), dtype=dtype, num_threads=1, num_kv_blocks=128, max_model_len=256)
    stack = llm.llm_engine.runner.model.fused_decode
    assert stack is not None
    kernels, seen = stack.kernels, []

    class Checked:  # the module, with decode_layers run under the check (one try per call: the steps are the tries)
        def __getattr__(self, name):
            return getattr(kernels, name)

        def decode_layers(self, *args, **kwargs):
            result = []
            seen.append(_counts_during(lambda: result.append(kernels.decode_layers(*args, **kwargs)), tries=1))
            return result[0]

    monkeypatch.setattr(stack, "kernels", Checked())
    prompts = [[3 + i, 40 + 7 * i, 90, 17 + i] * 4 for i in range(4)]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=40,
                                                                          ignore_eos=True), use_tqdm=False)
    assert seen and any(seen), f"decode_layers held the GIL in all {len(seen)} decode steps"
