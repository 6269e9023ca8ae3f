"""`bench make-model` shapes, the random-weight checkpoint writer, and the roofline arithmetic."""
import dataclasses
import json
import os

import pytest

from pagedserve.benchmarks.roofline import MachinePeaks, measure_peaks, roofline_for, shape_from_config
from pagedserve.benchmarks.shapes import SHAPES, build_tokenizer, get_shape, make_model, parse_overrides


def _meta_param_count(shape):
    import torch
    import transformers

    cfg_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen3ForCausalLM": transformers.Qwen3Config}
    cfg = cfg_cls[shape.architecture](**shape.hf_config_kwargs())
    with torch.device("meta"):
        model = getattr(transformers, shape.architecture)(cfg)
    seen, n = set(), 0
    for p in model.parameters():  # tied weights once
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b", "llama-3-8b-4l", "tiny-llama",
                                  "tiny-qwen3"])
def test_param_count_matches_transformers(name):
    shape = get_shape(name)
    assert shape.num_params() == _meta_param_count(shape)


def test_real_shapes_have_the_published_sizes():
    assert get_shape("smollm2-135m").num_params() == 134_515_008
    assert get_shape("llama-3.2-1b").num_params() == 1_235_814_400
    # Llama-3-8B is 8_030_261_248: 4 of its 32 layers (218_112_000 each) and its untied 128256 x 4096 embedding/head
    assert get_shape("llama-3-8b-4l").num_params() == 8_030_261_248 - 28 * 218_112_000
    q = get_shape("qwen3-0.6b")
    assert q.num_params() == 596_049_920 and q.num_params(include_embedding=False) == 440_467_456
    assert get_shape("qwen3-0.6b").kv_bytes_per_token(2) == 2 * 28 * 8 * 128 * 2
    assert get_shape("llama-3.2-1b").hf_config_kwargs()["rope_scaling"]["rope_type"] == "llama3"


def test_overrides():
    s = get_shape("smollm2-135m", parse_overrides(["num_layers=2", "vocab-size=1024", "rope_theta=5.5"]))
    assert (s.num_layers, s.vocab_size, s.rope_theta) == (2, 1024, 5.5)
    with pytest.raises(ValueError):
        parse_overrides(["nope=1"])
    with pytest.raises(ValueError):
        get_shape("gpt-17")


@pytest.mark.parametrize("name,special", [("smollm2-135m", (0, "<|endoftext|>")),
                                          ("llama-3.2-1b", (128001, "<|end_of_text|>")),
                                          ("qwen3-0.6b", (151645, "<|im_end|>"))])
def test_tokenizer_has_the_shape_vocab(name, special):
    shape = get_shape(name)
    tok = build_tokenizer(shape)
    assert len(tok) == shape.vocab_size
    assert tok.convert_tokens_to_ids(special[1]) == special[0]
    assert tok.eos_token == shape.eos
    text = "The scheduler returns every token."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert isinstance(tok.decode([shape.vocab_size - 1, 5, 300]), str)  # every id decodes


def test_make_model_tiny_loads_in_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_model(get_shape("tiny-qwen3"), str(tmp_path / "m"), verbose=False)
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["vocab_size"] == 512
    assert cfg["rope_theta"] == 10000.0 and cfg["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 512 and tok.eos_token_id == 511
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>user")
    w = model.model.layers[0].self_attn.q_proj.weight
    assert 0.01 < float(w.detach().std()) < 0.03  # N(0, 0.02)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape == (1, 3, 512) and torch.isfinite(logits).all()
    s = shape_from_config(out)
    assert s.num_params() == get_shape("tiny-qwen3").num_params()


def test_roofline_arithmetic():
    peaks = MachinePeaks(threads=2, matmul_flops=100e9, matmul_size=1024, copy_bandwidth=10e9, sum_bandwidth=20e9,
                         gemv_bandwidth=15e9)
    assert peaks.bandwidth == 20e9
    shape = get_shape("smollm2-135m")
    r = roofline_for(shape, peaks, "float32")
    assert r.weight_bytes == 4 * shape.matmul_params()
    assert r.compute_bound_tok_s == pytest.approx(100e9 / (2 * shape.matmul_params()))
    assert r.decode_bound_tok_s == pytest.approx(20e9 / r.weight_bytes)
    # fp32: B_sat = ridge point (FLOP/byte) * 4 bytes / 2 FLOP
    assert r.b_sat == pytest.approx(100e9 / 20e9 * 2)
    assert r.step_time(1) == pytest.approx(r.weight_bytes / 20e9)  # memory-bound: flat
    assert r.step_time(2) == pytest.approx(r.step_time(1))
    assert r.step_time(100) == pytest.approx(2 * shape.matmul_params() * 100 / 100e9)  # compute-bound: linear
    assert r.fraction(r.decode_bound_tok_s) == pytest.approx(1.0)
    assert roofline_for(shape, peaks, "bfloat16").b_sat == pytest.approx(r.b_sat / 2)  # half the bytes to read


def test_measure_peaks_small():
    p = measure_peaks(sizes=(64, 128), repeats=1, bw_mib=4, threads=1)
    assert p.matmul_flops > 0 and p.copy_bandwidth > 0 and p.sum_bandwidth > 0 and p.gemv_bandwidth > 0
    assert p.matmul_size in (64, 128)


def test_every_shape_is_a_known_architecture():
    for s in SHAPES.values():
        assert s.model_type in ("llama", "qwen3", "qwen3_moe")
        assert s.num_heads % s.num_kv_heads == 0
        assert all(0 <= i < s.vocab_size for i, _ in s.special_tokens)


def test_moe_shape_counts_active_experts_only_in_matmul_params():
    s = SHAPES["qwen3-30b-a3b-2l"]
    h, e = s.hidden_size, s.num_experts
    dense = dataclasses.replace(s, num_experts=0)  # the same shape without the MoE fields
    expert = 3 * h * s.moe_intermediate_size
    assert s.num_params() - dense.num_params() == s.num_layers * (e * expert + h * e - 3 * h * s.intermediate_size)
    assert s.matmul_params() - dense.matmul_params() == s.num_layers * (
        s.num_experts_per_tok * expert + h * e - 3 * h * s.intermediate_size)
    assert s.hf_config_kwargs()["num_experts"] == 128
