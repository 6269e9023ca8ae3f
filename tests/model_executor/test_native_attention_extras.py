"""Gemma 2 (soft-capped and windowed layers), Gemma 3 (windowed layers) and gpt-oss (sinks, windowed layers) end to
end on the native CPU attention kernels: greedy token for token with transformers in float32, prompts past the
32-token window, a 32-token budget so chunked prefills cross the window's edge, and a second pass from the prefix
cache. The reference attention paths are made to fail meanwhile: a layer that silently fell back to them (as
windowed prefills, soft caps and sinks did before the kernels had them) fails the test.
"""
from __future__ import annotations

import pytest
from test_correctness import check_prefix_cache_hits_match_transformers, count_native_calls

from pagedserve.model_executor import kernels
from pagedserve.model_executor.attention.torch_sdpa import TorchSDPABackend


@pytest.fixture
def reference_attention_refused(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a layer ran the reference attention instead of the native kernels")

    monkeypatch.setattr(TorchSDPABackend, "decode", staticmethod(refuse))
    monkeypatch.setattr(TorchSDPABackend, "prefill", staticmethod(refuse))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gpt-oss"])
def test_windows_soft_caps_and_sinks_on_the_native_kernels_match_transformers(
        arch, tiny_model_dir, tiny_tokenizer, monkeypatch, reference_attention_refused):
    module = kernels.cpu_kernels()
    if module is None or not module.native_prefill(16):
        pytest.skip("the native prefill attention needs an AVX-512 build")
    calls = count_native_calls(monkeypatch, module)
    check_prefix_cache_hits_match_transformers(tiny_model_dir(arch), tiny_tokenizer, max_num_batched_tokens=32,
                                                attention_backend="cpu")
    assert calls["paged_prefill_attention"] > 0 and calls["paged_decode_attention"] > 0
