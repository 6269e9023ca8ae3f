"""Mixture of experts: the grouped expert computation against a naive per-token loop, and Mixtral / Qwen2-MoE /
Qwen3-MoE greedy token for token against transformers in float32, with and without chunked prefill."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from kernel_capabilities import default_build
from test_correctness import GREEDY, LOGPROB_ATOL, MAX_TOKENS, _configs, check_engine_drained, run
from tiny_models import MOE_ARCHS

from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.layers.fused_moe import FusedMoE, SparseMoeBlock, fused_experts, select_experts
from pagedserve.model_executor.layers.fused_moe import experts as experts_module
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.models.gpt_oss import GptOssMoeBlock
from pagedserve.model_executor.parallel_state import SINGLE
from pagedserve.model_executor.quantization.int8 import Int8Config, quantize_per_channel
from pagedserve.model_executor.quantization.unquantized import UnquantizedConfig, UnquantizedLinearMethod, onednn_takes


@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_experts_matches_naive(renormalize):
    gen = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 37, 24, 16, 8, 3
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
    logits = torch.randn(t, e, generator=gen)
    weights, ids = select_experts(logits, k, renormalize)
    probs = logits.softmax(-1)
    ref = torch.zeros_like(x)
    for i in range(t):  # naive: every token, every chosen expert
        top = probs[i].topk(k)
        ws = top.values / top.values.sum() if renormalize else top.values
        for w, j in zip(ws, top.indices):
            g, u = (w13[j] @ x[i]).chunk(2)
            ref[i] += w * (w2[j] @ (F.silu(g) * u))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=1e-5)


def _experts(quant_config, dtype, bias, gen, e=8, h=64, inter=48):
    layer = FusedMoE(e, h, inter, quant_config, "layers.0.mlp.experts", bias=bias)
    layer.w13_weight.data = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
    layer.w2_weight.data = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
    if bias:
        layer.w13_bias.data = torch.randn(e, 2 * inter, generator=gen) * 0.3
        layer.w2_bias.data = torch.randn(e, h, generator=gen) * 0.3
    ref = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer.to(dtype)
    layer.process_weights_after_loading()
    return layer, ref


def _reference(x, ref, weights, ids, dequantize=False):
    """Every token's experts one by one in float32 (on the int8-rounded weights where the layer quantizes)."""
    w13, w2 = ref["w13_weight"], ref["w2_weight"]
    if dequantize:
        w13, w2 = ([(lambda qs: qs[0].double() * qs[1][:, None])(quantize_per_channel(w[j])).float()
                    for j in range(w.shape[0])] for w in (w13, w2))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, j in zip(weights[t], ids[t].tolist()):
            g, u = (x[t] @ w13[j].T + (ref["w13_bias"][j] if "w13_bias" in ref else 0)).chunk(2)
            out[t] += w * ((F.silu(g) * u) @ w2[j].T + (ref["w2_bias"][j] if "w2_bias" in ref else 0))
    return out


# the expert weights' dtype each kind runs the native small GEMM on (None: F.linear)
EXPERT_WEIGHTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "int8-bfloat16": torch.int8,
                  "torch": None}
NATIVE_GEMM_DTYPES = default_build().gemm_dtypes


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("kind", [k for k, w in EXPERT_WEIGHTS.items() if w is None or w in NATIVE_GEMM_DTYPES])
def test_native_experts_match_reference(kind, rows):
    """The experts on the native small GEMM (packed float32 / bfloat16, int8 under --quantization int8) and on
    F.linear (--linear-backend torch) against a per-token loop, with expert biases (gpt-oss) and without."""
    if EXPERT_WEIGHTS[kind] is not None and cpu_kernels() is None:
        pytest.skip("native kernels disabled (PAGEDSERVE_CPU_KERNELS=0)")
    gen = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if kind.endswith("bfloat16") else torch.float32
    config = Int8Config() if "int8" in kind else UnquantizedConfig("torch" if kind == "torch" else "native")
    for bias in (False, True):
        layer, ref = _experts(config, dtype, bias, gen)
        assert (layer.native13 is not None) == (kind != "torch")
        if layer.native13 is not None:
            assert layer.w13_weight.numel() == 0  # only the packed copy is kept
        x = torch.randn(rows, 64, generator=gen)
        weights, ids = select_experts(torch.randn(rows, 8, generator=gen), 3, True)
        got = layer(x.to(dtype), weights, ids).float()
        want = _reference(x, ref, weights, ids, dequantize="int8" in kind)
        # bfloat16: the weights' and activations' rounding; int8: the activations' per-row quantization
        tol = {"bfloat16": 5e-2, "int8": 3e-2, "int8-bfloat16": 5e-2}.get(kind, 1e-5)
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


class _WithoutSmallGemm:
    """The native kernels as an AVX2 CPU has them: the small GEMM runs no `dtype` (int8 without VNNI, bfloat16
    without AVX512-BF16)."""

    def __init__(self, ops, dtype: torch.dtype) -> None:
        self._ops, self._dtype = ops, dtype

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def native_small_gemm(self, dtype: torch.dtype, k: int = 0) -> bool:
        return dtype != self._dtype and self._ops.native_small_gemm(dtype, k)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("kind", ["int8", "int8-bfloat16", "bfloat16"])
def test_experts_without_the_small_gemm_match_reference(kind, rows, monkeypatch):
    """Where the small GEMM does not run the weight dtype (AVX2 CPUs: forced here), the one native call takes int8
    experts as the same per-channel int8 weights in Q8_0 blocks (only those kept) and bfloat16 experts as stored (on
    bf16_weight_gemm); a weight Q8_0 does not fit (K not a multiple of 32) keeps the dequantized F.linear path."""
    ops = cpu_kernels()
    int8 = kind.startswith("int8")
    if ops is None or not (ops.native_gguf_type(8) if int8 else ops.native_bf16_weight_gemm(64)):
        pytest.skip(f"no native kernel for {kind} experts without the small GEMM on this CPU")
    monkeypatch.setattr(experts_module, "cpu_kernels",
                        lambda: _WithoutSmallGemm(ops, torch.int8 if int8 else torch.bfloat16))
    gen = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if kind.endswith("bfloat16") else torch.float32
    config = Int8Config() if int8 else UnquantizedConfig("native")
    for bias in (False, True):
        layer, ref = _experts(config, dtype, bias, gen, inter=64)
        assert layer.native13.packed.dtype == (torch.uint8 if int8 else torch.bfloat16)
        assert layer.w13_weight.numel() == (0 if int8 else 8 * 128 * 64)  # bfloat16: the weights are the stack
        x = torch.randn(rows, 64, generator=gen)
        weights, ids = select_experts(torch.randn(rows, 8, generator=gen), 3, True)
        with torch.inference_mode():  # as the engine runs it: the experts spread over the native call's threads
            got = layer(x.to(dtype), weights, ids).float()
        want = _reference(x, ref, weights, ids, dequantize=int8)
        # int8: the activations' per-block quantization; bfloat16: the rounding of the weights and activations
        tol = {"int8": 3e-2}.get(kind, 5e-2)
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)
    if int8:
        layer, _ = _experts(config, torch.float32, False, gen, inter=48)  # w2's K = 48
        assert layer.native13 is None and layer.w13_weight.shape == (8, 96, 64)


@pytest.mark.parametrize("rows", [1, 40])  # 1: each product on all threads; 40: the experts spread over the threads
def test_native_experts_gather_and_sum_in_the_native_call(rows, monkeypatch):
    """The native call gathers each expert's rows and sums the weighted outputs per token itself: no ATen index_add_
    (on 2 threads 50-110 ms for 8 rows on a shared CPU), and the same sums as the per-token loop, tokens that share
    an expert included."""
    ops = cpu_kernels()
    if ops is None:
        pytest.skip("no native CPU kernels")
    gen = torch.Generator().manual_seed(rows)
    # float32 experts where the small GEMM runs them, else int8 (Q8_0 blocks on AVX2: the activations' quantization)
    int8 = not ops.native_small_gemm(torch.float32, 64)
    layer, ref = _experts(Int8Config() if int8 else UnquantizedConfig("native"), torch.float32, True, gen, inter=64)
    assert layer.native13 is not None

    def no_index_add(*args, **kwargs):
        raise AssertionError("the native experts' outputs were summed by index_add_")
    monkeypatch.setattr(torch.Tensor, "index_add_", no_index_add)
    x = torch.randn(rows, 64, generator=gen)
    ids = torch.randint(0, 8, (rows, 3), generator=gen)
    ids[0] = torch.tensor([5, 5, 2]) if rows == 1 else ids[0]  # a token twice in one expert's rows
    weights = torch.rand(rows, 3, generator=gen)
    with torch.inference_mode():
        got = layer(x, weights, ids)
    want = _reference(x, ref, weights, ids, dequantize=int8)
    tol = 3e-2 if int8 else 1e-4
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


def test_native_experts_refuse_a_pair_outside_the_tokens():
    ops = cpu_kernels()
    if ops is None:
        pytest.skip("no native CPU kernels")
    w13, w2 = torch.zeros(2, 8, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="names token 3 of 2"):
        ops.fused_moe_experts(torch.zeros(2, 8), torch.tensor([0, 3]), torch.ones(2), [1, 1], w13, w2, 8, 8,
                              None, None, None, None, None, None, None, None, 0, 0.0, 0.0)


def _bf16_path(ops, k: int) -> str:
    """Which kernel the float layers' method gives a bfloat16 product of width k on this CPU."""
    if ops.native_small_gemm(torch.bfloat16, k):
        return "small_gemm"
    return "onednn" if onednn_takes(torch.bfloat16) else "bf16_weight_gemm"


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("block", ["qwen2-moe", "gpt-oss"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bfloat16_router_never_runs_torch_linear(quantization, block, rows, monkeypatch):
    """The router (and Qwen2-MoE's shared-expert gate) stays in bfloat16 under every format and runs on the float
    layers' kernels - on an AVX2 CPU bf16_weight_gemm - never on PyTorch's bfloat16 F.linear (a dot product per output
    element there): no product of the whole bfloat16 MoE block may reach F.linear, and the router's logits match
    float32 on the same bfloat16 weights."""
    ops = cpu_kernels()
    if ops is None or not torch.backends.mkldnn.is_available():
        pytest.skip("no native CPU kernels")
    h, e = 64, 8
    config = Int8Config() if quantization else UnquantizedConfig("native")
    if block == "gpt-oss":
        moe = GptOssMoeBlock({"num_experts_per_tok": 2, "hidden_size": h, "num_local_experts": e,
                              "intermediate_size": 64}, SINGLE, config, "layers.0.mlp")
        routers = [moe.router]
    else:
        moe = SparseMoeBlock(h, e, 2, 64, True, 32, SINGLE, config, "layers.0.mlp")
        routers = [moe.gate, moe.shared_expert_gate]
    gen = torch.Generator().manual_seed(rows)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen) / h ** 0.5
    moe.to(torch.bfloat16)
    want_weights = [r.weight.detach().float().clone() for r in routers]
    want_biases = [None if r.bias is None else r.bias.detach().float().clone() for r in routers]
    for m in moe.modules():
        if isinstance(m, (Linear, FusedMoE)):
            m.process_weights_after_loading()
    path = _bf16_path(ops, h)
    for r in routers:
        assert isinstance(r.linear_method, UnquantizedLinearMethod)  # never quantized
        assert r.bf16_weight_gemm == (path == "bf16_weight_gemm")
        assert (r.small_gemm_weight is not None) == (path == "small_gemm")
    torch_linear = F.linear

    def no_bf16_linear(x, *args, **kwargs):
        assert x.dtype != torch.bfloat16, "a bfloat16 product of the MoE block ran PyTorch's F.linear"
        return torch_linear(x, *args, **kwargs)
    monkeypatch.setattr(F, "linear", no_bf16_linear)
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        assert moe(x).shape == (rows, h)
        for r, w, b in zip(routers, want_weights, want_biases):
            want = x.float() @ w.T + (0 if b is None else b)
            # the logits' rounding to bfloat16 (8 bits of mantissa), and float32 sums in another order
            torch.testing.assert_close(r(x).float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("config", ["default", "budget-32-chunked", "pool-fits-longest-only", "linear-torch",
                                    "ngram-speculation"])
def test_moe_greedy_matches_transformers(arch, config, tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=6)
    # pool-fits-longest-only: preemption and prefix-cache hits on resume; linear-torch: the experts on F.linear
    # instead of the native small GEMM; ngram-speculation: drafts verified as several rows per request
    configs = dict(_configs(prompts), default=dict(num_kv_blocks=512),
                   **{"linear-torch": dict(num_kv_blocks=512, linear_backend="torch"),
                      "ngram-speculation": dict(num_kv_blocks=512, speculative_config={
                          "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                          "prompt_lookup_max": 3})})
    llm, ours = run(model_dir, prompts, GREEDY, **configs[config])
    if config == "ngram-speculation":
        assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
    check_engine_drained(llm)


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_tensor_parallel_matches_transformers(arch, tiny_model_dir, tiny_tokenizer, monkeypatch):
    """2 ranks, each with half of every expert's (and the shared expert's) intermediate channels."""
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "60")  # a rank stuck on its peer fails instead of hanging
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=6)
    llm, ours = run(model_dir, prompts, GREEDY, num_kv_blocks=512, tensor_parallel_size=2)
    try:
        assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
        check_engine_drained(llm)
    finally:
        llm.llm_engine.shutdown()


# bfloat16 rounding or int8 weights may flip a near-tie of HF's float32 greedy token, or of the router's top-k (which
# moves a token's logits further than a dense layer's rounding: the tiny random models' next-token distributions are
# flat, top-3 within ~0.5 nats): a first divergence is allowed only where HF's log-prob of our token is within this
# many nats of its best, and at least MOE_MATCHED_FLOOR of the tokens must come before each prompt's divergence:
# about 10 points under the measured share (AVX512-BF16 build): Qwen3-MoE 63-64 of 96 in bfloat16 and int8, gpt-oss
# 40-47 (40 also with the experts and attention on the PyTorch paths in bfloat16: the model's, not the kernels')
MOE_NEAR_TIE = 1.0
MOE_MATCHED_FLOOR = {"qwen3-moe": 0.55, "gpt-oss": 0.32}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3-moe", "gpt-oss"])
# (bfloat16 activations on int8 experts: test_native_experts_match_reference; end to end, int8's own shift of the tiny
# models' log-probs, up to ~0.8 nats on a 300-token prompt, plus bfloat16's flips first tokens beyond any near-tie)
@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", "int8")])
def test_moe_bf16_and_int8_experts_follow_transformers(arch, dtype, quantization, tiny_model_dir, tiny_tokenizer):
    """The engine's experts on the native kernels in bfloat16 / int8 (like the dense layers): packed for the small
    GEMM, or where it does not run the dtype (AVX2) Q8_0 blocks / bfloat16 as stored: greedy output as HF's float32
    up to near-ties."""
    weight_dtype = torch.int8 if quantization else getattr(torch, dtype)
    ops = cpu_kernels()
    if ops is None:
        pytest.skip("no native CPU kernels")
    if ops.native_small_gemm(weight_dtype, 0):
        stack_dtype = weight_dtype
    elif quantization:
        # without the small GEMM's int8 the dense layers run fbgemm's int8 (one 7-bit activation scale per tensor),
        # which moves the tiny models' log-probs past these near-ties whatever runs the experts (Qwen3-MoE on AVX2:
        # first divergence 3.6 nats off HF's best with the dequantized experts, 1.5 with the Q8_0 ones): the Q8_0
        # experts are checked layer by layer (test_experts_without_the_small_gemm_match_reference)
        pytest.skip("the dense layers' int8 is fbgemm's on this CPU")
    elif ops.native_bf16_weight_gemm(64):
        stack_dtype = weight_dtype  # the bfloat16 weights as stored
    else:
        pytest.skip(f"no native kernel runs {weight_dtype} experts on this CPU")
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=6)
    llm, ours = run(model_dir, prompts, GREEDY, num_kv_blocks=512, dtype=dtype, quantization=quantization)
    experts = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.native13.packed.dtype == stack_dtype for m in experts)
    matched = 0
    for p, (mine, ref) in enumerate(zip(ours, hf_greedy(model_dir, prompts, MAX_TOKENS))):
        assert len(mine.token_ids) == MAX_TOKENS
        i = next((k for k, (a, b) in enumerate(zip(mine.token_ids, ref.token_ids)) if a != b), None)
        matched += MAX_TOKENS if i is None else i
        if i is not None:
            gap = ref.logprob(i, ref.token_ids[i]) - ref.logprob(i, mine.token_ids[i])
            assert gap < MOE_NEAR_TIE, f"prompt {p} diverged at {i}: HF's top-3 {ref.top(i, 3)}, ours {mine.token_ids[i]}"
    print(f"{arch} {dtype} {quantization}: {matched}/{len(prompts) * MAX_TOKENS} tokens before the first divergence")
    assert matched >= MOE_MATCHED_FLOOR[arch] * len(prompts) * MAX_TOKENS
    check_engine_drained(llm)


def test_experts_refuse_a_quantization_they_do_not_run():
    from pagedserve.model_executor.quantization.compressed_tensors import CompressedTensorsConfig
    w8a8 = {"config_groups": {"group_0": {
        "targets": ["Linear"], "format": "int-quantized",
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}
    with pytest.raises(ValueError, match="quantization 'compressed-tensors' is not built for them"):
        FusedMoE(4, 64, 32, CompressedTensorsConfig(checkpoint_config=w8a8), "layers.0.mlp.experts")


@pytest.mark.slow
def test_gpt_oss_mxfp4_checkpoint_matches_transformers(tiny_model_dir, tiny_tokenizer, tmp_path):
    """The hub's MXFP4 layout (expert *_blocks / *_scales, quant_method mxfp4) dequantized on load: greedy equal to HF
    on the same weights dequantized by transformers' own MXFP4 conversion."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    src = tiny_model_dir("gpt-oss")
    reference, packed = tmp_path / "reference", tmp_path / "mxfp4"
    shutil.copytree(src, reference)
    shutil.copytree(src, packed)
    tensors = load_file(src / "model.safetensors")
    ref_tensors, mx_tensors = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors[name].shape  # transformers' [E, in, out]; MXFP4 stores [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(120, 124, (e, n, k // 32), generator=gen, dtype=torch.uint8)  # values ~ 0.05-0.4
        ref_tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        del mx_tensors[name]
        mx_tensors[name + "_blocks"], mx_tensors[name + "_scales"] = blocks, scales
    save_file(ref_tensors, reference / "model.safetensors")
    save_file(mx_tensors, packed / "model.safetensors")
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (packed / "config.json").write_text(json.dumps(config))
    prompts = mixed_prompts(tiny_tokenizer, n=4)
    llm, ours = run(packed, prompts, GREEDY, num_kv_blocks=512)
    assert_greedy_match(ours, hf_greedy(reference, prompts, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
    check_engine_drained(llm)


@pytest.mark.parametrize("rows", [1, 40] if torch.float32 in NATIVE_GEMM_DTYPES else [])  # 1: each product on all
def test_native_experts_with_gpt_oss_activation_match_torch(rows):  # threads; 40: the experts spread over the threads
    """kernels/moe_experts.cpp's clamped SwiGLU (activation 1) against the same experts on F.linear + SwigluOAI."""
    if cpu_kernels() is None:
        pytest.skip("native kernels disabled (PAGEDSERVE_CPU_KERNELS=0)")
    from pagedserve.model_executor.layers.activation import SwigluOAI
    gen = torch.Generator().manual_seed(rows)
    layers = []
    for backend in ("native", "torch"):
        layer = FusedMoE(8, 64, 48, UnquantizedConfig(backend), "layers.0.mlp.experts", bias=True,
                         activation=SwigluOAI(1.702, 0.5))  # a low limit: the clamps bind
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        layer.process_weights_after_loading()
        layers.append(layer)
    assert layers[0].native13 is not None and layers[1].native13 is None
    x = torch.randn(rows, 64, generator=gen)
    weights, ids = select_experts(torch.randn(rows, 8, generator=gen), 3, False)
    torch.testing.assert_close(layers[0](x, weights, ids), layers[1](x, weights, ids), atol=1e-4, rtol=1e-4)
