"""The native whole-stack decode (kernels/decode_layers.cpp, layers/fused_decode.py FusedDecodeStack) against the
Python layers it replaces on pure-decode steps: the same ops in the same order, so bitwise the same tokens and
logprobs; and where a model opts out of it."""
import pytest
import torch
from kernel_capabilities import default_build

from pagedserve import LLM, SamplingParams
from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.layers.fused_decode import FusedDecodeStack

pytestmark = pytest.mark.slow


# plain; q/k/v biases; q/k norms; every layer windowed (one KV cache group); full and windowed layers (two groups);
# Gemma 2 (norms after attention and MLP, GeGLU, soft cap) and Gemma 3 (q/k norms, RoPE per layer type)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral-sw", "qwen2-sw", "gemma2", "gemma3"])
@pytest.mark.parametrize("dtype,quantization", [
    (dtype, quantization) for dtype, quantization in (("float32", None), ("bfloat16", None), ("float32", "int8"),
                                                      ("bfloat16", "int8"))
    # the stack runs where the build has the native small GEMM for the weights (else the Python layers run)
    if (torch.int8 if quantization else getattr(torch, dtype)) in default_build().gemm_dtypes])
def test_native_decode_loop_matches_python_layers(arch, dtype, quantization, tiny_model_dir, monkeypatch):
    if cpu_kernels() is None:
        pytest.skip("native kernels disabled (PAGEDSERVE_CPU_KERNELS=0)")
    llm = LLM(str(tiny_model_dir(arch)), dtype=dtype, quantization=quantization, num_threads=2, num_kv_blocks=128,
              max_model_len=256, enable_prefix_caching=False)  # the second run must prefill exactly as the first
    _assert_stack_matches_python_layers(llm, monkeypatch)


# what Q4_0 / Q8_0 / Q4_K_M / Q6_K files hold: every linear one type, or Q4_K with Q6_K v_proj and down_proj; qwen2:
# q/k/v biases on the block kernel
@pytest.mark.parametrize("arch,tensor_type,layer_types", [
    ("llama", "Q4_0", None), ("llama", "Q8_0", None), ("qwen2", "Q6_K", None),
    ("llama", "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"})], ids=["Q4_0", "Q8_0", "Q6_K", "Q4_K_M"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_loop_matches_python_layers_gguf(arch, tensor_type, layer_types, dtype, tmp_path, monkeypatch):
    """GGUF linears kept as blocks run inside the native stack (quant_gemm.cpp's kernel), as the Python layers do."""
    pytest.importorskip("gguf")
    from gguf_files import make_tiny_gguf

    from pagedserve.model_executor import gguf_loader

    if cpu_kernels() is None:
        pytest.skip("no native kernels (the GGUF blocks are dequantized, the Python layers run every step)")
    monkeypatch.setattr(gguf_loader, "_CACHE_ROOT", tmp_path / "gguf-cache")
    path = make_tiny_gguf(arch, tensor_type, tmp_path, layer_types=layer_types)
    llm = LLM(str(path), dtype=dtype, num_threads=2, num_kv_blocks=128, max_model_len=256,
              enable_prefix_caching=False)
    assert llm.llm_engine.runner.model.layers[0].self_attn.qkv_proj.gguf_parts is not None  # kept as blocks
    _assert_stack_matches_python_layers(llm, monkeypatch)


def _assert_stack_matches_python_layers(llm: LLM, monkeypatch) -> None:
    """Greedy with logprobs: the decode steps on the native stack, then every step on the Python layers; bitwise
    the same tokens and logprobs."""
    model = llm.llm_engine.runner.model
    assert model.fused_decode is not None  # the model opted in: CPU backend, one rank, native tensors everywhere
    prompts = [[3 + i, 40 + 7 * i, 90, 17 + i] * (2 + 3 * i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    native = FusedDecodeStack.__call__
    took: list[bool] = []

    def counting(self, *args):
        out = native(self, *args)
        took.append(out is not None)
        return out

    monkeypatch.setattr(FusedDecodeStack, "__call__", counting)
    fast = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert any(took) and not all(took)  # the decode steps took the loop, the prefill steps did not
    monkeypatch.setattr(model, "fused_decode", None)  # the Python layers on every step
    slow = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for f, s in zip(fast, slow):
        f, s = f.outputs[0], s.outputs[0]
        assert f.token_ids == s.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in f.logprobs] == \
            [{t: lp.logprob for t, lp in step.items()} for step in s.logprobs]


@pytest.mark.parametrize("engine_kwargs", [dict(attention_backend="torch"), dict(linear_backend="onednn")],
                         ids=["torch-attention", "onednn-linears"])
def test_no_native_decode_stack_where_it_cannot_run(engine_kwargs, tiny_model_dir):
    """The stack reads the CPU backend's cache layout and the small GEMM's packed weights: with another attention
    backend, or linears on oneDNN, the model does not build one."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1, num_kv_blocks=32, **engine_kwargs)
    assert llm.llm_engine.runner.model.fused_decode is None
