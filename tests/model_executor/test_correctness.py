"""Greedy outputs match Hugging Face transformers token for token, in every engine configuration.

Each configuration stresses one mechanism: chunked prefill (a 32-token budget), preemption (a KV pool
that fits only the longest request), block sizes 8 and 32, prefix caching on and off.
"""
from __future__ import annotations

import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from tiny_models import ARCHS

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_cache_manager import cdiv

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def run(model_dir, prompts, params: SamplingParams = GREEDY, **engine_kwargs):
    engine_kwargs.setdefault("dtype", "float32")  # token for token with HF's float32: not `auto` (bf16 on some CPUs)
    llm = LLM(str(model_dir), num_threads=1, **engine_kwargs)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def check_engine_drained(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked after every request finished"
    assert all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=8)
    llm, ours = run(model_dir, prompts, num_kv_blocks=512)
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS))
    check_engine_drained(llm)


def _configs(prompts):
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    return {
        "prefix-caching-off": dict(num_kv_blocks=512, enable_prefix_caching=False),
        "budget-32-chunked": dict(num_kv_blocks=512, max_num_batched_tokens=32),
        "pool-fits-longest-only": dict(num_kv_blocks=cdiv(longest, 16)),
        "block-size-8": dict(num_kv_blocks=1024, block_size=8),
        "block-size-32": dict(num_kv_blocks=256, block_size=32),
        "chunk-threshold-48": dict(num_kv_blocks=512, long_prefill_token_threshold=48),
        "linear-onednn": dict(num_kv_blocks=512, linear_backend="onednn"),
        "no-native-kernels": dict(num_kv_blocks=512),  # run with the C++ kernels disabled, below
        "avx2-kernels": dict(num_kv_blocks=512),  # run on the AVX2 build of the kernels (no small GEMM), below
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("config", ["prefix-caching-off", "budget-32-chunked", "pool-fits-longest-only",
                                    "block-size-8", "block-size-32", "chunk-threshold-48", "linear-onednn",
                                    "no-native-kernels", "avx2-kernels"])
def test_greedy_same_in_every_config(arch, config, tiny_model_dir, tiny_tokenizer, monkeypatch):
    if config == "no-native-kernels":  # the pure PyTorch path: attention, norms, rotary, silu
        monkeypatch.setattr("pagedserve.model_executor.attention.cpu_kernels", lambda: None)
        monkeypatch.setattr("pagedserve.model_executor.layers.cpu_kernels", lambda: None)
    if config == "avx2-kernels":  # what an AVX2-only CPU (AMD Zen 1) runs: its attention, oneDNN GEMMs
        from pagedserve.model_executor import kernels

        if "avx2" not in kernels.supported_isas():
            pytest.skip("this CPU has no AVX2")
        avx2 = kernels.load_cpu_kernels("avx2")
        assert avx2 is not None and not avx2.native_small_gemm(torch.float32)
        monkeypatch.setattr("pagedserve.model_executor.attention.cpu_kernels", lambda: avx2)
        monkeypatch.setattr("pagedserve.model_executor.layers.cpu_kernels", lambda: avx2)
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=8)
    llm, ours = run(model_dir, prompts, **_configs(prompts)[config])
    hf = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert_greedy_match(ours, hf)
    _, reference = run(model_dir, prompts, num_kv_blocks=512)
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference], "outputs changed with the config"
    stats = llm.llm_engine.get_stats().scheduler
    if config == "pool-fits-longest-only":
        assert stats.num_preemptions > 0, "the small pool should have forced preemption"
    check_engine_drained(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_kv_cache_matches_transformers(arch, tiny_model_dir, tiny_tokenizer):
    """A float32 model over a bfloat16 KV cache: half the cache bytes, greedy still HF's up to near-ties."""
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=8)
    llm, ours = run(model_dir, prompts, num_kv_blocks=512, kv_cache_dtype="bfloat16")
    runner = llm.llm_engine.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16 and runner.dtype == torch.float32
    fp32_llm = LLM(str(model_dir), num_threads=1, num_kv_blocks=4, dtype="float32")
    assert runner.kv_bytes_per_block * 2 == fp32_llm.llm_engine.runner.kv_bytes_per_block
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS))
    check_engine_drained(llm)
