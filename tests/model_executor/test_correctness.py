"""Greedy outputs match Hugging Face transformers token for token, in every engine configuration.

Each configuration stresses one mechanism: chunked prefill (a 32-token budget), preemption (a KV pool
that fits only the longest request), block sizes 8 and 32, prefix caching on and off.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from tiny_models import ARCHS

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_cache_manager import cdiv
from pagedserve.model_executor import kernels

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
# float32 against HF's float32: every returned logprob (top-2 and the sampled token) within this of HF's log-softmax
LOGPROB_ATOL = 1e-4


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
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
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
        "attention-torch": dict(num_kv_blocks=512, attention_backend="torch"),  # the PyTorch SDPA reference backend
        "no-native-kernels": dict(num_kv_blocks=512),  # run with the C++ kernels disabled (use_kernels)
        "avx2-kernels": dict(num_kv_blocks=512),  # run on the AVX2 build of the kernels (no small GEMM; use_kernels)
    }


_DEFAULT_OUTPUTS: dict[str, list[list[int]]] = {}


def default_outputs(arch: str, model_dir, prompts) -> list[list[int]]:
    """The default configuration's greedy token ids (native kernels of this CPU's best level), once per arch; taken
    before a test switches the kernels, so an alternative-kernel config is compared with the default one."""
    if arch not in _DEFAULT_OUTPUTS:
        _, outs = run(model_dir, prompts, num_kv_blocks=512)
        _DEFAULT_OUTPUTS[arch] = [list(o.token_ids) for o in outs]
    return _DEFAULT_OUTPUTS[arch]


def count_native_calls(monkeypatch, module) -> Counter:
    """Wraps each op of a kernels module to count its calls (undone with the test's monkeypatch)."""
    calls: Counter = Counter()
    for name in dir(module):
        op = getattr(module, name)
        if name.startswith("_") or not callable(op):
            continue

        def counted(*args, _op=op, _name=name, **kwargs):
            calls[_name] += 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def use_kernels(monkeypatch, isa: str | None):
    """Runs the engine on the `isa` build of the native kernels, or on none (the pure PyTorch path): switched where
    every caller (layers, attention, sampler) gets them, kernels.cpu_kernels(), and in the environment the engine
    reads (PAGEDSERVE_CPU_KERNELS / PAGEDSERVE_CPU_ISA). Returns that module (None without kernels)."""
    if isa is None:
        monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
        monkeypatch.setattr(kernels, "_default", None)
        return None
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    module = kernels.load_cpu_kernels(isa)
    assert module is not None and module.isa() == isa
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", isa)
    monkeypatch.setattr(kernels, "_default", module)
    return module


CONFIGS = ["prefix-caching-off", "budget-32-chunked", "pool-fits-longest-only", "block-size-8", "block-size-32",
           "chunk-threshold-48", "linear-onednn", "attention-torch", "no-native-kernels"]
# The AVX2 build as an alternative to the default: only where the default is a higher level (on an AVX2-only CPU it is
# the default build, which every other config runs).
if kernels.supported_isas()[0] not in ("avx2", "generic"):
    CONFIGS.append(pytest.param("avx2-kernels", marks=pytest.mark.kernels_build("avx2")))


@pytest.mark.slow
# mistral-sw: chunks across the window's edge; gemma2: soft caps, pre/post norms; phi3: fused checkpoint, LongRoPE
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral-sw", "gemma2", "phi3"])
@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_same_in_every_config(arch, config, tiny_model_dir, tiny_tokenizer, monkeypatch):
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=8)
    reference = default_outputs(arch, model_dir, prompts)
    best = kernels.load_cpu_kernels(kernels.supported_isas()[0])
    best_calls = count_native_calls(monkeypatch, best) if best is not None else Counter()
    alternative = None
    if config == "no-native-kernels":  # the pure PyTorch path: attention, norms, rotary, silu, the sampler's argmax
        use_kernels(monkeypatch, None)
    if config == "avx2-kernels":  # what an AVX2-only CPU (AMD Zen 1) runs: its attention, oneDNN GEMMs
        avx2 = use_kernels(monkeypatch, "avx2")
        assert not avx2.native_small_gemm(torch.float32)
        alternative = count_native_calls(monkeypatch, avx2)
    llm, ours = run(model_dir, prompts, **_configs(prompts)[config])
    assert llm.llm_engine.runner.attn_backend.name == ("torch" if config == "attention-torch" else "cpu")
    hf = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert_greedy_match(ours, hf, logprob_atol=LOGPROB_ATOL)
    assert [list(o.token_ids) for o in ours] == reference, "outputs changed with the config"
    if config in ("no-native-kernels", "avx2-kernels"):
        assert not best_calls, f"the {best.isa()} build was called: {dict(best_calls)}"
    elif best is not None:  # the probe sees the default build's calls: the sampler's argmax and the model's ops
        assert best_calls["argmax_rows"] > 0 and best_calls.total() > best_calls["argmax_rows"], dict(best_calls)
    if alternative is not None:
        assert alternative["argmax_rows"] > 0 and alternative.total() > alternative["argmax_rows"], dict(alternative)
    stats = llm.llm_engine.get_stats().scheduler
    # (windowed layers free their blocks behind the window: there the pool holds more than the longest request, and
    # test_sliding_window_kv.py forces the preemption)
    windowed = any(g.sliding_window for g in llm.llm_engine.runner.model.kv_cache_groups)
    if config == "pool-fits-longest-only" and not windowed:
        assert stats.num_preemptions > 0, "the small pool should have forced preemption"
    check_engine_drained(llm)


@pytest.mark.slow
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


def test_sliding_window_prefix_cache_hits_match_transformers(tiny_model_dir, tiny_tokenizer):
    """A window-32 model served prompts that share a 100-token prefix, the second time from the prefix cache: the
    cached blocks hold every position's K/V (the sliding layer's keys inside the window of the suffix included), so
    the hit computes what a cold run does, HF-exact."""
    check_prefix_cache_hits_match_transformers(tiny_model_dir("mistral-sw"), tiny_tokenizer)


def check_prefix_cache_hits_match_transformers(model_dir, tokenizer, **engine_kwargs) -> None:
    """Prompts sharing a 100-token prefix served twice (the second pass from the prefix cache), HF-exact both times;
    the engine drained after."""
    shared = mixed_prompts(tokenizer, n=1, lengths=(100, 100), seed=3)[0]
    prompts = [shared + tail for tail in ([5, 6, 7], [9] * 40, [11, 12])]
    llm = LLM(str(model_dir), num_threads=1, dtype="float32", num_kv_blocks=512, enable_prefix_caching=True,
              **engine_kwargs)
    hf = hf_greedy(model_dir, prompts, MAX_TOKENS)
    for _ in range(2):  # the second pass hits the first's blocks
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert_greedy_match([o.outputs[0] for o in outs], hf, logprob_atol=LOGPROB_ATOL)
    assert llm.llm_engine.get_stats().scheduler.prefix_cache_hits > 0
    check_engine_drained(llm)
