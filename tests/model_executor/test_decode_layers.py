"""The native decode-layer loop (kernels/decode_layers.cpp, LlamaForCausalLM._native_decode) against the Python
layers it replaces on pure-decode steps: the same ops in the same order, so bitwise the same tokens and logprobs."""
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.models import llama


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain; q/k/v biases; q/k norms
@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                               ("bfloat16", "int8")])
def test_native_decode_loop_matches_python_layers(arch, dtype, quantization, tiny_model_dir, monkeypatch):
    ops = cpu_kernels()
    weights = torch.int8 if quantization else getattr(torch, dtype)
    if ops is None or not ops.native_small_gemm(weights):
        pytest.skip("no native small GEMM for these weights in this build (the Python layers run every step)")
    llm = LLM(str(tiny_model_dir(arch)), dtype=dtype, quantization=quantization, num_threads=2, num_kv_blocks=128,
              max_model_len=256, enable_prefix_caching=False)  # the second run must prefill exactly as the first
    prompts = [[3 + i, 40 + 7 * i, 90, 17 + i] * (2 + 3 * i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    native = llama.LlamaForCausalLM._native_decode
    took: list[bool] = []

    def counting(self, *args):
        out = native(self, *args)
        took.append(out is not None)
        return out

    monkeypatch.setattr(llama.LlamaForCausalLM, "_native_decode", counting)
    fast = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert any(took) and not all(took)  # the decode steps took the loop, the prefill steps did not
    monkeypatch.setattr(llama.LlamaForCausalLM, "_native_decode", lambda self, *args: None)
    slow = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for f, s in zip(fast, slow):
        f, s = f.outputs[0], s.outputs[0]
        assert f.token_ids == s.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in f.logprobs] == \
            [{t: lp.logprob for t, lp in step.items()} for step in s.logprobs]
