"""A Gemma 3 checkpoint (sliding and full layers, per-layer RoPE bases) through `pagedserve serve` and the openai
client: greedy completions (a prompt past the 32-token window) equal to transformers' float32 greedy tokens, and a
streamed chat completion. The same for the MoE families (Qwen3-MoE's native experts; gpt-oss's sinks, sliding
layers and biased experts)."""
from __future__ import annotations

import pytest
from hf_reference import hf_greedy, mixed_prompts
from openai import OpenAI
from server_helpers import API_KEY, MAIN_ARGS, get_server


@pytest.mark.parametrize("arch", ["gemma3", "qwen3-moe", "gpt-oss"])
def test_gemma3_serves_hf_greedy_completions(arch, tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir(arch)
    server = get_server(model_dir, MAIN_ARGS + ("--dtype", "float32"))
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    prompts = mixed_prompts(tiny_tokenizer, n=2, lengths=(40, 90), seed=4)
    hf = hf_greedy(model_dir, prompts, 8)
    for prompt, expected in zip(prompts, hf):
        out = client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=8, temperature=0,
                                        logprobs=1, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        assert "".join(out.choices[0].logprobs.tokens) == tiny_tokenizer.decode(expected.token_ids)
    stream = client.chat.completions.create(model=str(model_dir), stream=True, max_tokens=12, temperature=0,
                                            messages=[{"role": "user", "content": "Sort a list in Python"}])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
