"""The small trained demo model that ships in pagedserve/demo_model (see its MODEL_CARD.md).

Fast (< 60 s on 2 CPU cores): loads the packaged checkpoint offline, re-checks the held-out loss on
a 20k-token subset, and compares greedy decoding of transformers and of our engine.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedserve
from pagedserve import LLM, SamplingParams
from pagedserve.demo_model_path import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tools/, outside the package
from tools import eval_demo_model as ev  # noqa: E402

pytestmark = pytest.mark.slow

MODEL_DIR = Path(default_model_path())
FIB = "def fibonacci(n):"
ENGINE_PROMPTS = [FIB, "import os\n\n\ndef main(argv):\n", "class Stack:\n    def push(self, item):"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def hf_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    yield ev.load_model_float32(MODEL_DIR)
    torch.set_num_threads(threads)


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def trim_at_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


# ---------------------------------------------------------------------------------------------- (a)


def test_checkpoint_files_are_small_and_complete():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "eval.json", "MODEL_CARD.md", "loss_curve.png"):
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 20_000_000
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file()) < 25_000_000
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] in ("bfloat16", "float16")
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"] and cfg["tie_word_embeddings"]
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["bos_token_id"] == cfg["bos_token_id"] and gen["eos_token_id"] == cfg["eos_token_id"]
    card = (MODEL_DIR / "MODEL_CARD.md").read_text()
    assert "held_out_loss:" in card and "loss_curve.png" in card


def test_loads_offline_with_transformers():
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "d = sys.argv[1]\n"
        "tok = AutoTokenizer.from_pretrained(d)\n"
        "m = AutoModelForCausalLM.from_pretrained(d)\n"
        "print(json.dumps({'cls': type(m).__name__, 'dtype': str(next(m.parameters()).dtype),\n"
        "                  'vocab': m.config.vocab_size, 'tok': len(tok)}))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code, str(MODEL_DIR)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["cls"] == "LlamaForCausalLM"
    assert info["tok"] <= info["vocab"]


def test_tokenizer_round_trip_and_chat_template(tokenizer):
    text = "def f(x):\n\treturn {'a': x ** 2}  # ünïcode ✓ 日本語\n\n\n    pass\r\n"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id  # tokenizer(text) prepends <|bos|>
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert tokenizer.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert not tokenizer.apply_chat_template(messages, tokenize=False).endswith("<|assistant|>\n")
    chat_ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert chat_ids[0] == tokenizer.bos_token_id and chat_ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") in chat_ids


# ---------------------------------------------------------------------------------------------- (b)


def test_held_out_loss_reproduces_eval_json(hf_model):
    rec = json.loads((MODEL_DIR / "eval.json").read_text())
    assert {"held_out_loss", "eval_tokens", "seq_len"} <= rec.keys()
    _, held = ev.load_split()
    if ev.held_out_fingerprint(held) != rec["held_out_fingerprint"]:
        pytest.skip(f"this Python's stdlib differs from the training one (Python {rec['python_version']}), "
                    "so the held-out files are not the same")
    loss = ev.evaluate_held_out_loss(MODEL_DIR, max_tokens=rec["subset_max_tokens"], model=hf_model)
    ref = rec["held_out_loss_subset"]
    assert abs(loss - ref) <= 0.05 * ref, (loss, ref)
    assert loss < 4.0  # a trained model, far below ln(vocab) ~ 9


# ---------------------------------------------------------------------------------------------- (c)


def test_greedy_fibonacci_looks_like_python(hf_model, tokenizer):
    new = hf_greedy(hf_model, tokenizer, FIB, 48)
    completion = tokenizer.decode(new, skip_special_tokens=True)
    text = FIB + completion
    lines = text.splitlines()
    if not text.endswith("\n"):
        lines = lines[:-1]  # drop the last, possibly cut, line
    parses = False
    while len(lines) > 1:
        try:
            ast.parse("\n".join(lines))
            parses = True
            break
        except SyntaxError:
            lines = lines[:-1]
    assert "return" in completion or parses, completion


# ---------------------------------------------------------------------------------------------- (d), (e)


def _greedy_ok(model, prompt_ids: list[int], ref: list[int], got: list[int]) -> tuple[bool, str]:
    """Equal, or the first difference is a float near-tie in transformers' own logits."""
    if got == ref:
        return True, ""
    i = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if i >= min(len(ref), len(got)):
        return False, f"lengths differ: transformers {len(ref)} tokens, engine {len(got)} tokens"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + ref[:i]])).logits[0, -1].float()
    gap = (logits[ref[i]] - logits[got[i]]).item()
    return gap < 1e-3, f"first difference at token {i}: transformers {ref[i]} vs engine {got[i]}, logit gap {gap:.2e}"


def test_engine_greedy_matches_transformers(hf_model, tokenizer):
    llm = LLM(model=str(MODEL_DIR), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8, seed=0)
    n = 24
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    assert len(outs) == len(ENGINE_PROMPTS)
    eos = tokenizer.eos_token_id
    for prompt, out in zip(ENGINE_PROMPTS, outs):
        prompt_ids = tokenizer(prompt).input_ids
        assert list(out.prompt_token_ids) == prompt_ids
        ref = trim_at_eos(hf_greedy(hf_model, tokenizer, prompt, n), eos)
        got = trim_at_eos(list(out.outputs[0].token_ids), eos)
        ok, why = _greedy_ok(hf_model, prompt_ids, ref, got)
        assert ok, f"{prompt!r}: {why}\n transformers: {tokenizer.decode(ref)!r}\n engine: {tokenizer.decode(got)!r}"


def test_llm_without_model_uses_demo_model(tokenizer):
    assert pagedserve.default_model_path() == str(MODEL_DIR)
    assert Path(default_model_path()).is_absolute() and (MODEL_DIR / "config.json").is_file()
    llm = LLM(device="cpu", num_kv_blocks=32, max_num_seqs=2)
    engine = llm.llm_engine
    assert engine.model_config.is_default_model
    assert engine.model_config.max_model_len == json.loads((MODEL_DIR / "config.json").read_text())[
        "max_position_embeddings"]
    assert engine.tokenizer.get_vocab() == tokenizer.get_vocab()
    out = llm.generate(FIB, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1 and out[0].outputs[0].text
