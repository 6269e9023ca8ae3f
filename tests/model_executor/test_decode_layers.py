"""The native whole-stack decode (kernels/decode_layers.cpp, layers/fused_decode.py FusedDecodeStack) against the
Python layers it replaces on pure-decode steps: the same ops in the same order, so bitwise the same tokens and
logprobs; and where a model opts out of it."""
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.layers.fused_decode import FusedDecodeStack

pytestmark = pytest.mark.slow


# plain; q/k/v biases; q/k norms; every layer windowed (one KV cache group); full and windowed layers (two groups);
# Gemma 2 (norms after attention and MLP, GeGLU, soft cap) and Gemma 3 (q/k norms, RoPE per layer type)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral-sw", "qwen2-sw", "gemma2", "gemma3"])
@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                               ("bfloat16", "int8")])
def test_native_decode_loop_matches_python_layers(arch, dtype, quantization, tiny_model_dir, monkeypatch):
    ops = cpu_kernels()
    weights = torch.int8 if quantization else getattr(torch, dtype)
    if ops is None or not ops.native_small_gemm(weights):
        pytest.skip("no native small GEMM for these weights in this build (the Python layers run every step)")
    llm = LLM(str(tiny_model_dir(arch)), dtype=dtype, quantization=quantization, num_threads=2, num_kv_blocks=128,
              max_model_len=256, enable_prefix_caching=False)  # the second run must prefill exactly as the first
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
