"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors; tests/quantized_checkpoints.py packs them in each
format's documented layout): read from config.json's quantization_config and repacked onto the int4 / int8 paths, greedy
token for token (near-tie rule) with transformers running the same weights dequantized, in float32; `--quantization`
against the checkpoint's format as vLLM decides; bad checkpoints a ValueError."""
from __future__ import annotations

import json
import os

import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy, load_hf_model, mixed_prompts
from quantized_checkpoints import (
    fake_quantize_activations_per_token,
    make_quantized_checkpoint,
)
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
WIDE = dict(hidden_size=128, intermediate_size=256)  # inputs of 128 and 256: groups of 128 fit every layer


def _check(ckpt, ref, quantization=None, hf_model_hook=None):
    llm = LLM(str(ckpt), quantization=quantization, dtype="float32", num_threads=1)
    prompts = mixed_prompts(llm.get_tokenizer(), 3, lengths=(5, 60), seed=7)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    if hf_model_hook is not None:
        hf_model_hook(load_hf_model(str(ref)))
    assert_greedy_match(outs, hf_greedy(ref, prompts, GREEDY.max_tokens))
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    return llm


@pytest.mark.parametrize("arch,group_size,symmetric,desc_act", [
    ("llama", 32, True, False),
    ("qwen2", 64, False, True),  # act-order, and q/k/v biases
])
def test_gptq_matches_hf_on_dequantized_weights(tmp_path, arch, group_size, symmetric, desc_act):
    ckpt, ref = make_quantized_checkpoint(arch, "gptq", tmp_path, group_size=group_size, symmetric=symmetric,
                                          desc_act=desc_act)
    llm = _check(ckpt, ref)
    layer = llm.llm_engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.int4_weight is not None and layer.self_attn.qkv_proj.qweight.numel() == 0
    assert (layer.mlp.down_proj.int4_input_perm is not None) == desc_act


def test_awq_matches_hf_on_dequantized_weights(tmp_path):
    _check(*make_quantized_checkpoint("llama", "awq", tmp_path, group_size=64))


def test_compressed_tensors_w4a16_matches_hf(tmp_path):
    pytest.importorskip("compressed_tensors")
    _check(*make_quantized_checkpoint("qwen3", "ct-w4a16", tmp_path, group_size=32, symmetric=True))


@pytest.mark.slow
def test_compressed_tensors_w4a16_group_act_order_matches_hf(tmp_path):
    """The older act-order "group" (weight_g_idx; packed by tests/quantized_checkpoints.py, as the package no longer
    writes it), with zero points."""
    pytest.importorskip("compressed_tensors")
    llm = _check(*make_quantized_checkpoint("llama", "ct-w4a16", tmp_path, group_size=32, desc_act=True))
    assert llm.llm_engine.runner.model.layers[1].self_attn.qkv_proj.int4_input_perm is not None


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_compressed_tensors_w8a8_int8_matches_hf_with_per_token_activations(tmp_path, per_tensor):
    pytest.importorskip("compressed_tensors")
    ckpt, ref = make_quantized_checkpoint("llama", "ct-w8a8", tmp_path, per_tensor=per_tensor)
    ops = cpu_kernels()
    if ops is None and os.environ.get("PAGEDSERVE_CPU_KERNELS") == "0":
        pytest.skip("native kernels turned off: W8A8 falls back to fbgemm, one activation scale per tensor")
    assert ops is not None, "the native kernels: W8A8's per-token activations run on them"
    hidden = json.loads((ckpt / "config.json").read_text())["hidden_size"]
    llm = _check(ckpt, ref, hf_model_hook=fake_quantize_activations_per_token)
    proj = llm.llm_engine.runner.model.layers[0].mlp.gate_up_proj
    assert proj.weight.numel() == 0 and proj.fbgemm_weight is None  # fbgemm: one activation scale per tensor
    # the int8 small GEMM where the build runs it, else (AVX2 without VNNI) Q8_0 blocks on the block-quantized kernel
    assert (proj.small_gemm_weight is not None) == ops.native_small_gemm(torch.int8, hidden)
    assert (proj.q8_0_weight is not None) == (proj.small_gemm_weight is None)


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_compressed_tensors_fp8_weights_match_hf(tmp_path, per_tensor):
    pytest.importorskip("compressed_tensors")
    _check(*make_quantized_checkpoint("llama", "ct-fp8", tmp_path, per_tensor=per_tensor))


@pytest.mark.parametrize("block", [(32, 32), None], ids=["block-32x32", "per-tensor-static"])
def test_fp8_checkpoint_matches_hf(tmp_path, block):
    """vLLM's fp8 format (quant_method "fp8"): block scales (weight_scale_inv) or one per tensor."""
    _check(*make_quantized_checkpoint("llama", "fp8", tmp_path, fp8_block=block))


@pytest.mark.slow
@pytest.mark.parametrize("fmt,group_size,symmetric,desc_act,gptq_v2", [
    ("gptq", 128, False, False, False),
    ("gptq", 128, True, True, False),
    ("gptq", -1, False, False, False),  # one group per row
    ("gptq", 32, False, True, True),  # gptq_v2 zero points
    ("awq", 32, False, False, False),
    ("awq", 128, False, False, False),
    ("ct-w4a16", 64, False, False, False),
    ("ct-w4a16", 128, True, False, False),
    ("ct-w4a16", -1, False, False, False),  # per channel
    ("ct-w4a16", 64, True, True, False),  # act-order "group": weight_g_idx
])
def test_int4_formats_group_sizes_match_hf(tmp_path, fmt, group_size, symmetric, desc_act, gptq_v2):
    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    _check(*make_quantized_checkpoint("llama", fmt, tmp_path, group_size=group_size, symmetric=symmetric,
                                      desc_act=desc_act, gptq_v2=gptq_v2, **WIDE))


# a part of the names, and the checkpoint's full module names (what real checkpoints list)
FLOAT_MLP_1 = {"part": ("layers.1.mlp",),
               "full": tuple(f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))}


@pytest.mark.parametrize("names", ["part", "full"])
@pytest.mark.parametrize("fmt", ["awq", "ct-w4a16", "fp8"])
def test_layers_the_checkpoint_left_in_float(tmp_path, fmt, names):
    """AWQ's modules_to_not_convert, compressed-tensors' ignore (regular expressions), fp8's ignored_layers: those
    layers load as float weights, the others quantized."""
    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    llm = _check(*make_quantized_checkpoint("llama", fmt, tmp_path, float_modules=FLOAT_MLP_1[names],
                                            fp8_block=(32, 32)))
    layers = llm.llm_engine.runner.model.layers
    for proj in (layers[1].mlp.gate_up_proj, layers[1].mlp.down_proj):
        assert type(proj.linear_method).__name__ == "UnquantizedLinearMethod"
    assert type(layers[0].mlp.down_proj.linear_method).__name__ != "UnquantizedLinearMethod"
    assert type(layers[1].self_attn.qkv_proj.linear_method).__name__ != "UnquantizedLinearMethod"


def test_quantization_argument_against_the_checkpoints_format(tmp_path):
    ckpt, _ = make_quantized_checkpoint("llama", "gptq", tmp_path, group_size=32)
    float_dir = tmp_path / "float"
    assert EngineArgs(model=str(ckpt)).create_engine_config().load.quantization == "gptq"  # from config.json
    assert EngineArgs(model=str(ckpt), quantization="gptq").create_engine_config().load.quantization == "gptq"
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* `quantization` argument \(int8\)"):
        EngineArgs(model=str(ckpt), quantization="int8").create_engine_config()
    with pytest.raises(ValueError, match="config.json has no quantization_config"):
        EngineArgs(model=str(float_dir), quantization="awq").create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineArgs(model=str(ckpt), tensor_parallel_size=2).create_engine_config()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "bitsandbytes"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'; supported: gptq, awq, compressed-tensors, fp8"):
        EngineArgs(model=str(ckpt)).create_engine_config()


def test_gptq_fused_projections_with_different_act_orders_is_value_error(tmp_path):
    ckpt, _ = make_quantized_checkpoint("llama", "gptq", tmp_path, group_size=32, desc_act=True)
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="different act-order group indices"):
        LLM(str(ckpt), dtype="float32", num_threads=1)


def test_unsupported_schemes_are_value_errors(tmp_path):
    ckpt, _ = make_quantized_checkpoint("llama", "gptq", tmp_path, group_size=32)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gptq' supports 4-bit weights"):
        LLM(str(ckpt), dtype="float32", num_threads=1)
    cfg["quantization_config"].update(bits=4, lm_head=True)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized LM head"):
        LLM(str(ckpt), dtype="float32", num_threads=1)
    cfg["quantization_config"].update(lm_head=False, group_size=48)  # does not divide the 64 inputs
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="group size 48 does not divide"):
        LLM(str(ckpt), dtype="float32", num_threads=1)


def test_gptq_act_order_linear_matches_dequantized_product():
    """One layer, act-order with groups of 32 over 128 inputs: the product against x @ dequantized(W)^T."""
    from quantized_checkpoints import dequantize_int4, pack_gptq, rtn_int4

    from pagedserve.model_executor.layers.linear import Linear
    from pagedserve.model_executor.quantization.gptq import GPTQConfig

    torch.manual_seed(0)
    w = torch.randn(48, 128) / 128 ** 0.5
    g_idx = torch.empty(128, dtype=torch.long)
    g_idx[torch.randperm(128)] = torch.arange(128) // 32
    q, zeros, scales = rtn_int4(w, g_idx, symmetric=False)
    config = GPTQConfig(checkpoint_config={"bits": 4, "group_size": 32})
    layer = Linear(128, 48, False, config, "layers.0.mlp.down_proj")
    for name, t in pack_gptq(q, zeros, scales, g_idx).items():
        getattr(layer, name).data.copy_(t)
    layer.process_weights_after_loading()
    x = torch.randn(5, 128)
    ref = x @ dequantize_int4(q, zeros, scales, g_idx).t()
    assert torch.allclose(layer(x), ref, atol=1e-4, rtol=0), (layer(x) - ref).abs().max()


def test_gptq_target_with_float_draft_model(tmp_path):
    """A pre-quantized checkpoint's format is its own: the draft model (float) is not loaded as GPTQ, and greedy
    output is the target's alone."""
    ckpt, ref = make_quantized_checkpoint("llama", "gptq", tmp_path, group_size=32)
    llm = LLM(str(ckpt), dtype="float32", num_threads=1,
              speculative_config={"model": str(tmp_path / "float"), "num_speculative_tokens": 3})
    prompts = mixed_prompts(llm.get_tokenizer(), 2, lengths=(5, 40), seed=9)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert_greedy_match(outs, hf_greedy(ref, prompts, GREEDY.max_tokens))


# Qwen2-MoE (shared expert of 64 channels: whole groups of 32): experts in every checkpoint format, each expert's
# projections read as stored; 4-bit ones become GGUF Q4_0 (symmetric) / Q4_1 blocks on the block-quantized kernel
# (int8 activations per block of 32: the near-tie rule, half identical), act-order and FP8 ones float experts.
MOE = dict(shared_expert_intermediate_size=64)


@pytest.mark.parametrize("fmt,settings,kind", [
    ("gptq", dict(group_size=32, symmetric=True), "Q4_0"),
    ("awq", dict(group_size=32), "Q4_1"),
    ("ct-w4a16", dict(group_size=32, symmetric=True), "Q4_0"),
    ("gptq", dict(group_size=32, desc_act=True), "float"),  # act-order: blocks cannot hold the input order
    ("fp8", dict(fp8_block=(32, 32)), "float"),
])
def test_moe_experts_in_checkpoint_formats_match_hf(tmp_path, fmt, settings, kind):
    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    ckpt, ref = make_quantized_checkpoint("qwen2-moe", fmt, tmp_path, **settings, **MOE)
    llm = LLM(str(ckpt), dtype="float32", num_threads=1)
    prompts = mixed_prompts(llm.get_tokenizer(), 6, lengths=(5, 60), seed=7)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    experts = llm.llm_engine.runner.model.layers[1].mlp.experts
    assert experts.checkpoint_experts is None  # the checkpoint's tensors are gone once converted
    if cpu_kernels() is not None:
        layout = experts.native13.layout
        assert (layout[:, 0].tolist() == [NATIVE_TYPES[kind][0]] * 2) if kind != "float" else layout is None
    assert_greedy_match(outs, hf_greedy(ref, prompts, GREEDY.max_tokens),
                        min_identical_frac=0.5 if kind != "float" else 0.9)


def test_moe_experts_under_quantization_int4_match_their_rounded_weights(tmp_path):
    """`--quantization int4` on a float MoE checkpoint: each expert rounded per group as the dense layers are
    (int4.py: quantize_rtn_int4), held as Q4_1 blocks: the layer's output as the rounded weights' own, within the int8
    activations' rounding."""
    from tiny_models import make_tiny_checkpoint

    from pagedserve.model_executor.layers.fused_moe import fused_experts, select_experts
    from pagedserve.model_executor.quantization.int4 import dequantize_rtn_int4, group_size_for, quantize_rtn_int4

    ckpt = make_tiny_checkpoint("qwen2-moe", tmp_path / "float", **MOE)
    llm = LLM(str(ckpt), quantization="int4", dtype="float32", num_threads=1)
    experts = llm.llm_engine.runner.model.layers[1].mlp.experts
    if cpu_kernels() is not None:
        assert experts.native13.layout[:, 0].tolist() == [NATIVE_TYPES["Q4_1"][0]] * 2
    weights = load_file(str(ckpt / "model.safetensors"))

    def rounded(proj: str) -> torch.Tensor:
        ws = [weights[f"model.layers.1.mlp.experts.{e}.{proj}.weight"].float() for e in range(experts.num_experts)]
        return torch.stack([dequantize_rtn_int4(*quantize_rtn_int4(w, group_size_for(w.shape[1]))) for w in ws])

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen)  # the tiny model's hidden size
    topk_weights, topk_ids = select_experts(torch.randn(9, experts.num_experts, generator=gen), 2, False)
    want = fused_experts(x, torch.cat([rounded("gate_proj"), rounded("up_proj")], dim=1), rounded("down_proj"),
                         topk_weights, topk_ids)
    got = experts(x, topk_weights, topk_ids)
    assert ((got - want).norm() / want.norm()).item() < 0.03


def test_moe_int8_checkpoint_experts_are_value_error(tmp_path):
    pytest.importorskip("compressed_tensors")
    ckpt, _ = make_quantized_checkpoint("qwen2-moe", "ct-w8a8", tmp_path, **MOE)
    with pytest.raises(ValueError, match="not built for them"):
        LLM(str(ckpt), dtype="float32", num_threads=1)
