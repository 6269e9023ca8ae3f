"""Tests of the correctness-test infrastructure itself: tiny tokenizer, tiny checkpoints, HF reference,
greedy matcher and prompt generator.  No pagedserve engine code is exercised here."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

import tiny_models
from hf_reference import HFResult, assert_greedy_match, hf_greedy, load_hf_model, mixed_prompts
from tiny_models import ARCHS, CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer

N_NEW = 32


pytestmark = pytest.mark.usefixtures("one_thread")


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def test_tokenizer_basics(tiny_tokenizer):
    tok = tiny_tokenizer
    assert 512 <= len(tok) <= 1024
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    text = "def compute(x, y):\n    return x + y * 3\nThe cat reads a long letter. Ünïcödé ✓ 你好"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless round trip
    ascii_part = text.split(" Ü")[0]
    assert len(tok.encode(ascii_part)) < len(ascii_part) // 2  # merges learned for English/code
    assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:]
    # incremental (per-token) decoding, as a detokenizer does it, concatenates to the text
    pieces = tok.convert_ids_to_tokens(ids[1:])
    assert tok.convert_tokens_to_string(pieces) == text


def test_tokenizer_chat_template(tiny_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    s = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert s == "<s><|system|>\nBe brief.</s>\n<|user|>\nhi there</s>\n<|assistant|>\n"
    s2 = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert s2 == s[: -len("<|assistant|>\n")]
    assert tiny_tokenizer.chat_template == CHAT_TEMPLATE


def test_tokenizer_deterministic_and_saved_equals_built(tiny_tokenizer):
    again = tiny_models._train_tokenizer_json.__wrapped__(tiny_models.TINY_VOCAB_SIZE)
    assert again == tiny_models._train_tokenizer_json(tiny_models.TINY_VOCAB_SIZE)
    built = build_tiny_tokenizer()
    assert built.get_vocab() == tiny_tokenizer.get_vocab()
    text = "for i in range(10):\n    total += i  # the scheduler allocates blocks"
    assert built(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------

_MODEL_TYPE = {
    "llama": "llama", "llama-tied": "llama", "llama3-rope": "llama", "sharded": "llama",
    "mistral": "mistral", "mistral-sw": "mistral", "qwen2": "qwen2", "qwen2-sw": "qwen2", "qwen3": "qwen3", "llama-hd128": "llama", "qwen3-hd128": "qwen3",
    "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
}


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_files_and_load(arch, tiny_model_dir, tiny_tokenizer):
    d = tiny_model_dir(arch)
    assert tiny_model_dir(arch) is d  # cached per session
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (d / f).is_file(), f
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == _MODEL_TYPE[arch]
    assert cfg["vocab_size"] == len(tiny_tokenizer)
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert 64 <= cfg["hidden_size"] <= 128 and 2 <= cfg["num_hidden_layers"] <= 4
    assert cfg["max_position_embeddings"] >= 1024
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (0, 1, 2)

    tensors = _tensors(d)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert ("lm_head.weight" in tensors) == (arch != "llama-tied")
    if arch == "sharded":
        index = json.loads((d / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) >= 3 and shards == {f.name for f in d.glob("*.safetensors")}
        assert set(index["weight_map"]) == set(tensors)
    else:
        assert (d / "model.safetensors").is_file()
        assert not (d / "model.safetensors.index.json").exists()

    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == cfg["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.float32


def test_qwen2_biases_nonzero(tiny_model_dir):
    t = _tensors(tiny_model_dir("qwen2"))
    for proj in ("q_proj", "k_proj", "v_proj"):
        b = t[f"model.layers.0.self_attn.{proj}.bias"]
        assert b.abs().min() > 0 and b.std() > 0.1, proj
    assert "model.layers.0.self_attn.o_proj.bias" not in t


def test_qwen3_head_dim_and_qk_norm(tiny_model_dir):
    d = tiny_model_dir("qwen3")
    cfg = json.loads((d / "config.json").read_text())
    head_dim = cfg["head_dim"]
    assert head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]
    t = _tensors(d)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (4 * head_dim, cfg["hidden_size"])
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (2 * head_dim, cfg["hidden_size"])
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (cfg["hidden_size"], 4 * head_dim)
    for n in ("q_norm", "k_norm"):
        w = t[f"model.layers.0.self_attn.{n}.weight"]
        assert w.shape == (head_dim,) and (w - 1).abs().mean() > 0.1, n


def test_norm_weights_not_trivial(tiny_model_dir):
    t = _tensors(tiny_model_dir("llama"))
    for k in ("model.norm.weight", "model.layers.1.input_layernorm.weight",
              "model.layers.1.post_attention_layernorm.weight"):
        assert (t[k] - 1).abs().mean() > 0.1, k


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_build_is_deterministic(arch):
    a = build_tiny_model(arch).state_dict()
    b = build_tiny_model(arch).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = build_tiny_model(arch, seed=12345).state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@torch.inference_mode()
def test_rope_scaling_changes_outputs(tiny_model_dir):
    d = tiny_model_dir("llama3-rope")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    scaled = load_hf_model(str(d.resolve()))
    plain = build_tiny_model("llama3-rope", rope_scaling=None)  # same seed -> same weights
    assert plain.config.rope_parameters["rope_type"] == "default"
    sd_s, sd_p = scaled.state_dict(), plain.state_dict()
    assert all(torch.equal(sd_s[k], sd_p[k]) for k in sd_p)
    f_s = scaled.model.rotary_emb.inv_freq
    f_p = plain.model.rotary_emb.inv_freq
    changed = ~torch.isclose(f_s, f_p)
    assert changed.sum() >= len(f_p) // 2 and torch.equal(f_s[0], f_p[0])  # high freqs kept

    ids = torch.tensor([list(range(3, 203))])
    ls, lp = scaled(ids).logits[0], plain(ids).logits[0]
    assert (ls[50:] - lp[50:]).abs().max() > 1.0
    assert (ls[50:].argmax(-1) != lp[50:].argmax(-1)).float().mean() > 0.2


@torch.inference_mode()
def test_legacy_rope_config_equivalent(tmp_path, tiny_tokenizer):
    d = tiny_models.make_tiny_checkpoint(
        "llama3-rope", tmp_path / "legacy", tokenizer=tiny_tokenizer, legacy_rope_config=True,
        num_hidden_layers=1,
    )
    cfg = json.loads((d / "config.json").read_text())
    assert "rope_parameters" not in cfg and cfg["rope_theta"] == 10000.0
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    from transformers import AutoModelForCausalLM

    legacy = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    assert legacy.config.rope_parameters["rope_type"] == "llama3"
    ref = build_tiny_model("llama3-rope", num_hidden_layers=1)
    assert torch.equal(legacy.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)


@torch.inference_mode()
def test_positions_matter(tiny_model_dir):
    """Attention is peaked enough that a wrong position for one token visibly changes logits."""
    model = load_hf_model(str(tiny_model_dir("llama").resolve()))
    ids = torch.tensor([list(range(10, 110))])
    pos = torch.arange(100)[None]
    bad = pos.clone()
    bad[0, -1] += 3
    good = model(ids, position_ids=pos).logits[0, -1]
    wrong = model(ids, position_ids=bad).logits[0, -1]
    assert (good - wrong).abs().max() > 0.5
    # a constant offset is invisible to RoPE (relative positions) -- sanity of the setup
    shifted = model(ids, position_ids=pos + 5).logits[0, -1]
    assert torch.allclose(good, shifted, atol=1e-3)


# --------------------------------------------------------------------------------------------
# non-degeneracy of greedy decoding
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_non_degenerate(arch, tiny_model_dir, tiny_tokenizer):
    prompts = mixed_prompts(tiny_tokenizer, n=8)
    res = hf_greedy(tiny_model_dir(arch), prompts, N_NEW)
    for i, r in enumerate(res):
        assert len(r.token_ids) == N_NEW
        assert len(set(r.token_ids)) >= 4, (i, r.token_ids)
        assert len(set(r.token_ids[N_NEW // 2:])) >= 3, (i, r.token_ids)  # not stuck at the end
    assert len({tuple(r.token_ids) for r in res}) == len(res)  # different prompts, different outputs
    top2 = torch.cat([torch.topk(r.logprobs, 2).values for r in res])
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps < 1e-3).float().mean() <= 0.02, "too many near-ties"
    assert gaps.median() > 0.3
    probs = torch.cat([r.logprobs.exp().max(-1).values for r in res])
    assert 0.1 < probs.mean() < 0.9  # neither near-uniform nor one-hot


def test_hf_greedy_deterministic_and_matches_manual_loop(tiny_model_dir, tiny_tokenizer):
    d = tiny_model_dir("qwen3")
    prompt = mixed_prompts(tiny_tokenizer, n=8)[1]
    (r,) = hf_greedy(d, [prompt], 8)
    model = load_hf_model(str(d.resolve()))
    ids = list(prompt)
    with torch.inference_mode():
        for step in range(8):
            logits = model(torch.tensor([ids])).logits[0, -1]  # full recompute, no KV cache
            lp = torch.log_softmax(logits.float(), -1)
            assert int(lp.argmax()) == r.token_ids[step]
            assert torch.allclose(lp, r.logprobs[step], atol=1e-4)
            ids.append(int(lp.argmax()))
    assert hf_greedy(d, [prompt], 8)[0] is r  # memoized


def test_hf_greedy_does_not_stop_at_eos(tiny_model_dir, tiny_tokenizer, tmp_path):
    src = tiny_model_dir("llama")
    prompt = mixed_prompts(tiny_tokenizer, n=8)[0]
    (ref,) = hf_greedy(src, [prompt], 16)
    # Make the token greedy emits at step 3 the checkpoint's eos: HF must still run 16 steps.
    eos = ref.token_ids[3]
    d = tmp_path / "eos"
    shutil.copytree(src, d)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((d / name).read_text())
        cfg["eos_token_id"] = eos
        (d / name).write_text(json.dumps(cfg))
    (r,) = hf_greedy(d, [prompt], 16)
    assert r.token_ids == ref.token_ids
    assert torch.allclose(r.logprobs, ref.logprobs, atol=1e-5)


def test_matcher_catches_a_rope_scaling_bug(tiny_model_dir, tiny_tokenizer, tmp_path):
    """An 'engine' that ignores rope_scaling (same weights) must fail the comparison."""
    prompts = mixed_prompts(tiny_tokenizer, n=8)
    ref = hf_greedy(tiny_model_dir("llama3-rope"), prompts, N_NEW)
    buggy_dir = tiny_models.make_tiny_checkpoint(
        "llama3-rope", tmp_path / "norope", tokenizer=tiny_tokenizer, rope_scaling=None
    )
    buggy = hf_greedy(buggy_dir, prompts, N_NEW)
    with pytest.raises(AssertionError, match="NOT a near-tie|fully identical"):
        assert_greedy_match([r.token_ids for r in buggy], ref)
    assert_greedy_match([r.token_ids for r in ref], ref)


# --------------------------------------------------------------------------------------------
# assert_greedy_match (synthetic HF results; no model)
# --------------------------------------------------------------------------------------------

V = 16


def _hf(tokens, tie_at=None, runner_up=None, gap=1e-4, third=None):
    """Fake HFResult: at each step `tokens[i]` is top-1 by a wide margin; at step `tie_at` the
    token `runner_up` is second by `gap`; `third` (if given) is third there."""
    rows = torch.full((len(tokens), V), -10.0)
    for i, t in enumerate(tokens):
        rows[i, t] = -0.5
    if tie_at is not None:
        rows[tie_at, runner_up] = -0.5 - gap
        if third is not None:
            rows[tie_at, third] = -0.5 - 2 * gap
    return HFResult([1, 2, 3], list(tokens), torch.log_softmax(rows, -1))


BASE = [3, 5, 7, 9, 11, 13, 4, 6]


def test_match_accepts_identical():
    hf = [_hf(BASE) for _ in range(10)]
    assert_greedy_match([list(BASE) for _ in range(10)], hf)
    assert_greedy_match([list(BASE)] * 10, hf, our_logprobs=[[{t: -0.5} for t in BASE]] * 10)


def test_match_accepts_near_tie_divergence():
    hf = [_hf(BASE, tie_at=5, runner_up=2)] + [_hf(BASE) for _ in range(9)]
    ours = [BASE[:5] + [2, 8, 8]] + [list(BASE)] * 9  # diverges at 5 to HF's #2, then anything
    assert_greedy_match(ours, hf)
    # with our logprobs showing HF's token as our #2 (a genuine near-tie on both sides)
    lps = [[{t: -0.5} for t in BASE] for _ in range(10)]
    lps[0][5] = {2: -0.50, 13: -0.5001}
    assert_greedy_match(ours, hf, our_logprobs=lps)


def test_match_rejects_token_not_in_hf_top2():
    hf = [_hf(BASE, tie_at=5, runner_up=2, third=8)] + [_hf(BASE) for _ in range(9)]
    ours = [BASE[:5] + [8, 8, 8]] + [list(BASE)] * 9  # our token is HF's #3
    with pytest.raises(AssertionError) as e:
        assert_greedy_match(ours, hf)
    msg = str(e.value)
    assert "prompt 0" in msg and "position 5" in msg and "ours=8" in msg and "hf=13" in msg
    assert "gap=" in msg and "rank=3" in msg
    ours = [BASE[:5] + [0, 8, 8]] + [list(BASE)] * 9  # far off
    with pytest.raises(AssertionError, match="NOT a near-tie"):
        assert_greedy_match(ours, hf)


def test_match_rejects_hf_token_not_in_our_top2():
    hf = [_hf(BASE, tie_at=5, runner_up=2)] + [_hf(BASE) for _ in range(9)]
    ours = [BASE[:5] + [2, 8, 8]] + [list(BASE)] * 9
    lps = [[{t: -0.5} for t in BASE] for _ in range(10)]
    lps[0][5] = {2: -0.1, 0: -2.0, 13: -3.0}  # HF's 13 is our #3
    with pytest.raises(AssertionError, match="HF token's rank in ours=3"):
        assert_greedy_match(ours, hf, our_logprobs=lps)
    lps[0][5] = {2: -0.1, 0: -2.0}  # HF's token not returned at all
    with pytest.raises(AssertionError, match="not among our returned logprobs"):
        assert_greedy_match(ours, hf, our_logprobs=lps)


def test_match_checks_logprob_values_up_to_the_divergence():
    hf = [_hf(BASE, tie_at=5, runner_up=2)] + [_hf(BASE) for _ in range(9)]
    ours = [BASE[:5] + [2, 8, 8]] + [list(BASE)] * 9
    exact = [[{t: float(h.logprobs[i, t]) for t in (h.token_ids[i], 0)} for i in range(len(BASE))] for h in hf]
    exact[0][5] = {2: float(hf[0].logprobs[5, 2]), 13: float(hf[0].logprobs[5, 13])}
    assert_greedy_match(ours, hf, our_logprobs=exact, logprob_atol=1e-4)
    for step, token in ((5, 13), (7, 0)):  # at the divergence: compared; past it (other contexts): not
        off = [[dict(s) for s in p] for p in exact]
        off[0][step][token] += 2e-4
        if step == 5:
            with pytest.raises(AssertionError, match=r"logprob \|ours - HF\| = 2\.\d+e-04 > 0\.0001 at step 5, token 13"):
                assert_greedy_match(ours, hf, our_logprobs=off, logprob_atol=1e-4)
        else:
            assert_greedy_match(ours, hf, our_logprobs=off, logprob_atol=1e-4)
    off = [[dict(s) for s in p] for p in exact]
    off[3][0][0] -= 1e-3  # a returned non-greedy token of an identical prompt
    with pytest.raises(AssertionError, match="prompt 3: logprob"):
        assert_greedy_match(ours, hf, our_logprobs=off, logprob_atol=1e-4)
    with pytest.raises(AssertionError, match="no logprobs of ours"):
        assert_greedy_match(ours, hf, logprob_atol=1e-4)


def test_match_rejects_too_few_identical():
    hf = [_hf(BASE, tie_at=5, runner_up=2) for _ in range(10)]
    ours = [BASE[:5] + [2, 8, 8]] * 2 + [list(BASE)] * 8  # near-ties, but only 80% identical
    with pytest.raises(AssertionError, match="only 8/10 prompts"):
        assert_greedy_match(ours, hf)
    assert_greedy_match(ours, hf, min_identical_frac=0.8)
    with pytest.raises(AssertionError, match="only 8/9 prompts"):
        assert_greedy_match(ours[1:], hf[1:])  # 89% < 90%
    assert_greedy_match(ours[1:] + [list(BASE)], hf[1:] + [_hf(BASE)])  # 9/10 = 90%: ok

def test_match_rejects_length_mismatch():
    hf = [_hf(BASE) for _ in range(10)]
    with pytest.raises(AssertionError, match="length mismatch"):
        assert_greedy_match([BASE[:-1]] + [list(BASE)] * 9, hf)


def test_match_accepts_engine_output_objects():
    from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput

    hf = [_hf(BASE, tie_at=5, runner_up=2)] + [_hf(BASE) for _ in range(9)]
    toks = [BASE[:5] + [2, 8, 8]] + [list(BASE)] * 9

    def req(i, t, lps):
        co = CompletionOutput(index=0, text="", token_ids=t, logprobs=lps)
        return RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=[1, 2, 3],
                             outputs=[co], finished=True)

    good = [[{t: Logprob(-0.5, rank=1)} | {0: Logprob(-3.0, rank=2)} for t in tk] for tk in toks]
    good[0][5] = {2: Logprob(-0.69, rank=1), 13: Logprob(-0.70, rank=2)}
    assert_greedy_match([req(i, t, lp) for i, (t, lp) in enumerate(zip(toks, good))], hf)
    bad = [list(s) for s in good]
    bad[0][5] = {2: Logprob(-0.1, rank=1), 0: Logprob(-2.5, rank=2)}
    with pytest.raises(AssertionError, match="NOT a near-tie"):
        assert_greedy_match([req(i, t, lp) for i, (t, lp) in enumerate(zip(toks, bad))], hf)


# --------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------


def test_mixed_prompts(tiny_tokenizer):
    a = mixed_prompts(tiny_tokenizer, n=8, seed=0)
    assert a == mixed_prompts(tiny_tokenizer, n=8, seed=0)
    assert a != mixed_prompts(tiny_tokenizer, n=8, seed=1)
    lens = sorted(len(p) for p in a)
    assert len(a) == 8 and lens[0] == 5 and lens[-1] == 300 and len(set(lens)) == 8
    assert lens[3] < 60 < lens[5]  # spread, not clustered at one end
    assert all(p[0] == tiny_tokenizer.bos_token_id for p in a)
    assert all(0 <= t < len(tiny_tokenizer) for p in a for t in p)
    assert len({tuple(p) for p in a}) == 8

    b = mixed_prompts(500, n=12, lengths=(5, 64), seed=3)
    assert len(b) == 12 and min(map(len, b)) == 5 and max(map(len, b)) == 64
    assert all(3 <= t < 500 for p in b for t in p)
