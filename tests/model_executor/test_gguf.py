"""GGUF files (written here with the `gguf` package, tests/gguf_files.py) served by path: config, tokenizer and chat
template from the file's metadata; greedy output token for token with transformers opening the same file (which
dequantizes it itself) in float32, for each tensor type and architecture.

Q8_0/Q4_0/Q4_K/Q6_K linear weights run on the native block-quantized kernel (quantization/gguf.py), which quantizes
the activations to int8 per block of 32 as llama.cpp does: on these tiny random models, whose top logits are often
within a few hundredths, that moves near ties, so there every divergence must be a near tie (top-2 both ways) and
half the prompts identical; the kernel itself is checked exactly against its arithmetic in
tests/model_executor/test_gguf_kernels.py. Without the native kernels (PAGEDSERVE_CPU_KERNELS=0) the same blocks are
dequantized at load and the run is HF-exact under the usual rule."""
from __future__ import annotations

import pytest
from gguf_files import TYPES, make_tiny_gguf
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts

from pagedserve import LLM, SamplingParams
from pagedserve.model_executor import gguf_loader, kernels
from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES

pytest.importorskip("gguf")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_loader, "_CACHE_ROOT", tmp_path / "gguf-cache")


def _check(path, native: bool = False):
    """native: the file's linear weights run on the int8-activation kernel (the near-tie rule, half identical)."""
    llm = LLM(str(path), num_threads=1, dtype="float32")
    prompts = mixed_prompts(llm.get_tokenizer(), 6 if native else 3, lengths=(5, 60), seed=5)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert_greedy_match(outs, hf_greedy(path, prompts, GREEDY.max_tokens), min_identical_frac=0.5 if native else 0.9)
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    return llm


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q5_0", "Q4_K"])
def test_gguf_llama_matches_hf(tmp_path, tensor_type):
    llm = _check(make_tiny_gguf("llama", tensor_type, tmp_path), native=True)
    qkv = llm.llm_engine.runner.model.layers[0].self_attn.qkv_proj  # kept as blocks
    assert qkv.gguf_parts is not None and qkv.weight is None


@pytest.mark.parametrize("arch,tied,native", [("qwen2", False, True), ("llama", True, False)])
def test_gguf_quantized_lm_head_matches_hf(tmp_path, monkeypatch, arch, tied, native):
    """The head's blocks (llama.cpp's `output`, or the tied `token_embd`: then untied, the embedding float) kept
    as blocks: on the kernel, or dequantized without it (HF-exact: the tied head's rows in the embedding's order)."""
    if not native:
        monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
        monkeypatch.setattr(kernels, "_default", None)
    path = make_tiny_gguf(arch, "Q8_0", tmp_path, quantize_head=True, tie_word_embeddings=tied)
    head = _check(path, native=native).llm_engine.runner.model.lm_head
    assert (head.gguf_parts is not None) == native


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_K"])
def test_gguf_dequantized_without_native_kernels_matches_hf(tmp_path, monkeypatch, tensor_type):
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_default", None)
    _check(make_tiny_gguf("llama", tensor_type, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("arch,tensor_type", [("llama", t) for t in TYPES if t not in ("Q8_0", "Q4_0", "Q5_0", "Q4_K")]
                         + [("qwen2", t) for t in ("Q8_0", "Q4_0", "Q6_K")])
def test_gguf_types_match_hf(tmp_path, arch, tensor_type):
    _check(make_tiny_gguf(arch, tensor_type, tmp_path), native=tensor_type in NATIVE_TYPES)


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
