"""A causal LM scored by the logits of its last token (Qwen3-Reranker style, vLLM's interface): served with
`hf_overrides={"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}`, a pair's score is softmax([logit_no, logit_yes])[yes] of transformers' causal
LM forward on the same tokens; without the two-way flag each token's logit is a class."""
from __future__ import annotations

import json

import pytest
import torch

from pagedserve.entrypoints.llm import LLM
from pagedserve.pooling_params import PoolingParams
from tiny_models import tiny_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


def _overrides(tokens: list[str], two_way: bool = True) -> dict:
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
            "is_original_qwen3_reranker": two_way}


def _hf_last_logits(path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1]


@pytest.mark.parametrize("arch", ["qwen3", "llama-tied"])
def test_yes_no_logits_match_hf(tiny_model_dir, tiny_tokenizer, arch):
    path = tiny_model_dir(arch)
    tokens = tiny_tokenizer.convert_ids_to_tokens([300, 301])  # [no, yes]: any two single tokens
    ids = tiny_tokenizer.convert_tokens_to_ids(tokens)
    overrides = _overrides(tokens)
    if arch == "llama-tied":  # the override's architecture is the family's (and the JSON text form of the flag)
        overrides["architectures"] = ["LlamaForSequenceClassification"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=256,
              hf_overrides=json.dumps(overrides))
    assert llm.llm_engine.config.pooler.task == "classify" and llm.llm_engine.config.pooler.num_labels == 1
    corpus = tiny_corpus()
    query, docs = corpus[0][:50], [corpus[1][:80], corpus[2][:30], "hi"]
    outs = llm.score(query, docs, use_tqdm=False)
    for doc, out in zip(docs, outs):
        assert out.prompt_token_ids == tiny_tokenizer(text=query, text_pair=doc)["input_ids"]
        logits = _hf_last_logits(path, out.prompt_token_ids)
        want = torch.softmax(logits[ids], dim=-1)[1].item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)


def test_tokens_as_classes(tiny_model_dir, tiny_tokenizer):
    path = tiny_model_dir("qwen3")
    tokens = tiny_tokenizer.convert_ids_to_tokens([300, 301, 302])
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256,
              hf_overrides=_overrides(tokens, two_way=False))
    text = tiny_corpus()[3][:60]
    out = llm.classify([text], use_tqdm=False, pooling_params=PoolingParams(activation=False))[0]
    want = _hf_last_logits(path, out.prompt_token_ids)[tiny_tokenizer.convert_tokens_to_ids(tokens)]
    assert torch.allclose(torch.tensor(out.outputs.probs), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not tokens of the model's vocabulary"):
        LLM(str(path), dtype="float32", num_kv_blocks=16, hf_overrides=_overrides(["no-such-token", "x" * 40]))


def test_hf_overrides_flag(tiny_model_dir, tiny_tokenizer):
    """`--hf-overrides` (the server's flag) takes the JSON text; the engine config sees the overridden architecture."""
    import argparse

    from pagedserve.config import EngineArgs

    tokens = tiny_tokenizer.convert_ids_to_tokens([300, 301])
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--hf-overrides", json.dumps(_overrides(tokens))]))
    args.model = str(tiny_model_dir("qwen3"))
    config = args.create_engine_config()
    assert config.model.architecture == "Qwen3ForSequenceClassification"
    assert config.pooler.task == "classify" and config.pooler.num_labels == 1
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        EngineArgs(model=args.model, hf_overrides="[1]").create_engine_config()
