"""GGUF files (written here with the `gguf` package, tests/gguf_files.py) served by path: config, tokenizer and chat
template from the file's metadata; greedy output token for token with transformers opening the same file (which
dequantizes it itself) in float32, for each tensor type and architecture."""
from __future__ import annotations

import pytest
from gguf_files import TYPES, make_tiny_gguf
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts

from pagedserve import LLM, SamplingParams
from pagedserve.model_executor import gguf_loader

pytest.importorskip("gguf")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_loader, "_CACHE_ROOT", tmp_path / "gguf-cache")


def _check(path):
    llm = LLM(str(path), num_threads=1, dtype="float32")
    prompts = mixed_prompts(llm.get_tokenizer(), 3, lengths=(5, 60), seed=5)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert_greedy_match(outs, hf_greedy(path, prompts, GREEDY.max_tokens))
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    return llm


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_K"])
def test_gguf_llama_matches_hf(tmp_path, tensor_type):
    _check(make_tiny_gguf("llama", tensor_type, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("arch,tensor_type", [("llama", t) for t in TYPES if t not in ("Q8_0", "Q4_0", "Q4_K")]
                         + [("qwen2", t) for t in ("Q8_0", "Q4_0", "Q6_K")])
def test_gguf_types_match_hf(tmp_path, arch, tensor_type):
    _check(make_tiny_gguf(arch, tensor_type, tmp_path))


def test_gguf_tokenizer_and_chat_template_from_metadata(tmp_path):
    path = make_tiny_gguf("qwen2", "Q8_0", tmp_path)
    llm = LLM(str(path), num_threads=1, dtype="float32")
    tok = llm.get_tokenizer()
    assert tok.chat_template and "<|assistant|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    out = llm.chat([{"role": "user", "content": "the cat reads"}],
                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # opened again: the converted directory is reused, not rewritten
    assert gguf_loader.gguf_checkpoint_dir(path) == gguf_loader.gguf_checkpoint_dir(path)


def test_gguf_bad_file_is_value_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(bad), num_threads=1)
