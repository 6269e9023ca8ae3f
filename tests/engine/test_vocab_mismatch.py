"""A tokenizer with more or fewer tokens than the model's logits (config.json's vocab_size), as real checkpoints have:
Qwen pads its embedding past the tokenizer, Gemma / Llama-3.2 / transformers' GGUF tokenizer add tokens the model has
no row for. The engine serves both; structured output never allows an id the tokenizer does not have nor one past
the logits; prompt ids past the model's vocabulary are a ValueError naming the prompt."""
from __future__ import annotations

import re

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams as SO

TOKENIZER_SIZE = 768  # tests/tiny_models.py's tokenizer
REGEX = r"[A-Z]{2}-[0-9]{3}"


@pytest.mark.parametrize("vocab_size", [800, 760], ids=["model-wider", "tokenizer-wider"])
def test_structured_output_with_tokenizer_and_model_vocab_of_different_sizes(tiny_model_dir, vocab_size):
    llm = LLM(str(tiny_model_dir("llama", vocab_size=vocab_size)), num_threads=1, dtype="float32",
              num_kv_blocks=64, max_model_len=256)
    assert len(llm.get_tokenizer()) == TOKENIZER_SIZE
    # the last logit pushed far ahead: free, it is sampled; constrained, never (no token of the tokenizer)
    push = {str(vocab_size - 1): 100.0}
    free = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias=push))
    assert free[0].outputs[0].token_ids == [vocab_size - 1] * 3
    for overlap in (True, False):  # both ways of running the masks (engine/structured_output.py)
        llm.llm_engine.structured_output.overlap_masks = overlap
        out = llm.generate(prompt_token_ids=[[5, 6, 7, 8], [9, 10]], use_tqdm=False,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=20, logit_bias=push,
                                                          structured_outputs=SO(regex=REGEX)))
        for o in out:
            assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text
            assert max(o.outputs[0].token_ids) < min(vocab_size, TOKENIZER_SIZE)
    if vocab_size < TOKENIZER_SIZE:
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 760\)"):
            llm.generate(prompt_token_ids=[[5, 765]], use_tqdm=False)
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
