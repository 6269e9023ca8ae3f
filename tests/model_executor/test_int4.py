"""Weight-only int4 (`--quantization int4`): the layer's product against a dequantize-then-matmul reference, and the
engine greedy token for token with transformers running the same round-to-nearest weights dequantized (float32)."""
from __future__ import annotations

import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.quantization.int4 import (
    Int4Config,
    dequantize_rtn_int4,
    group_size_for,
    quantize_rtn_int4,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,rows", [(256, 1), (256, 7), (96, 3)])
def test_int4_linear_matches_dequantized_reference(dtype, in_features, rows):
    torch.manual_seed(0)
    layer = Linear(in_features, 48, True, Int4Config(), "layers.0.mlp.down_proj")
    w = torch.randn(48, in_features) / in_features ** 0.5
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(48))
    layer.to(dtype)
    ref_w = dequantize_rtn_int4(*quantize_rtn_int4(w.to(dtype), group_size_for(in_features)))
    layer.process_weights_after_loading()
    assert layer.weight.numel() == 0  # only the packed copy is kept
    x = torch.randn(rows, in_features)
    ref = x.to(dtype).float() @ ref_w.t() + layer.bias.float()
    got = layer(x.to(dtype)).float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2 * ref.abs().max().item()
    assert torch.allclose(got, ref, atol=tol, rtol=0), (got - ref).abs().max()
    assert (w - ref_w.float()).abs().max() <= (w.abs().max() * 2 / 15)  # RTN: within a step of the group range


def test_int4_width_not_multiple_of_32_is_value_error():
    with pytest.raises(ValueError, match="int4"):
        Linear(40, 8, False, Int4Config())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_engine_matches_hf_on_dequantized_weights(tmp_path, arch):
    ckpt = make_tiny_checkpoint(arch, tmp_path / "ckpt")
    ref_dir = make_tiny_checkpoint(arch, tmp_path / "ref")  # same seed: the same weights
    tensors = load_file(str(ref_dir / "model.safetensors"))
    for name, t in tensors.items():
        if t.ndim == 2 and name.endswith(("proj.weight", "lm_head.weight")):
            tensors[name] = dequantize_rtn_int4(*quantize_rtn_int4(t, group_size_for(t.shape[1]))).contiguous()
    save_file(tensors, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(ckpt), quantization="int4", dtype="float32", num_threads=1)
    prompts = mixed_prompts(llm.get_tokenizer(), 3, lengths=(5, 60), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert_greedy_match(outs, hf_greedy(ref_dir, prompts, params.max_tokens))
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
