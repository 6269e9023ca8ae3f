"""Tiny, deterministic, random-weight checkpoints (and a home-made tokenizer) for correctness tests.

Everything here is built locally: no downloads.  The same arguments always give byte-identical
weights and the same tokenizer, so tests that compare our engine with Hugging Face transformers
token-for-token are reproducible.

    tok = build_tiny_tokenizer()                       # PreTrainedTokenizerFast, ~768 tokens
    path = make_tiny_checkpoint("qwen3", out_dir)      # config.json, *.safetensors, tokenizer, generation_config

Architectures (``ARCHS``):

    llama         LlamaForCausalLM, untied lm_head
    llama-tied    LlamaForCausalLM, tie_word_embeddings=True (no lm_head.weight in the checkpoint)
    llama3-rope   LlamaForCausalLM with llama3 rope scaling (factor 8, original_max_position_embeddings 64)
    mistral       MistralForCausalLM, sliding_window=None
    mistral-sw    MistralForCausalLM, sliding_window=32 (the prompts cross it: every layer attends to the last 32)
    qwen2-sw      Qwen2ForCausalLM, use_sliding_window, window 32 from layer 1 (max_window_layers=1): mixed layers
    qwen2         Qwen2ForCausalLM, non-zero q/k/v biases
    qwen3         Qwen3ForCausalLM, non-trivial q_norm/k_norm, head_dim=32 != hidden/heads=16
    sharded       same as "llama" (other seed) saved in several shards + model.safetensors.index.json
    gemma2        Gemma2ForCausalLM: window 32 on even layers, attention soft cap 10, final soft cap 30,
                  query_pre_attn_scalar 24 (!= head_dim)
    gemma3        Gemma3ForCausalLM (text): head_dim 32, layers sliding/sliding/full (window 32), RoPE bases 10k
                  (sliding) and 1M with linear x2 scaling (full), q/k norms
    phi3          Phi3ForCausalLM: fused qkv/gate_up checkpoint, LongRoPE with original_max_position_embeddings 1
                  (attention_factor 1.2 given: the derived one divides by log 1): every sequence is past it, so HF
                  rotates with the long factors, as the engine does whenever max_model_len exceeds it

Weights are NOT the transformers default init (std 0.02 gives near-uniform logits and greedy
decoding that repeats one token): linear layers use std = gain/sqrt(fan_in), q/k projections are
large enough that attention is peaked (so RoPE, masks and positions really matter), embeddings are
O(1), the lm_head gives logits with std ~3 so top-1/top-2 near-ties are rare, and norm weights are
drawn around 1 instead of being all ones.
"""
from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARCHS",
    "TINY_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "tiny_corpus",
    "build_tiny_tokenizer",
    "build_tiny_model",
    "make_tiny_checkpoint",
]

# "-hd128": head_dim 128 (SmolLM2's, Qwen3's, most 7B models'), wider than hidden_size / heads, end to end
# (new architectures go at the end: each arch's seed is its index, and the others' weights must not change)
_FIRST_ARCHS = ("llama", "llama-tied", "llama3-rope", "mistral", "qwen2", "qwen3", "sharded", "llama-hd128",
                "qwen3-hd128", "mistral-sw", "qwen2-sw")
ARCHS = _FIRST_ARCHS + ("gemma2", "gemma3", "phi3")

# mixture-of-experts families (not in ARCHS: the engine-feature matrices over ARCHS are dense-only for now);
# every 2nd Qwen3-MoE layer sparse with layer 0 dense (mlp_only_layers), so both MLP kinds run
_FIRST_MOE_ARCHS = ("mixtral", "qwen2-moe", "qwen3-moe")
# gpt-oss: sinks, sliding (32-token window) and full layers alternating, biased router and experts, clamped SwiGLU
MOE_ARCHS = _FIRST_MOE_ARCHS + ("gpt-oss",)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=3, output_router_logits=False)

TINY_VOCAB_SIZE = 768
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2

# Simple chat template; `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# --------------------------------------------------------------------------------------------
# Training text (generated, deterministic)
# --------------------------------------------------------------------------------------------

_SUBJECTS = [
    "the cat", "a small dog", "the engineer", "my neighbour", "the old server", "a student",
    "the scheduler", "every request", "the model", "our team", "the river", "a bright star",
    "the kernel", "this function", "the cache", "a tired runner", "the city council", "the teacher",
]
_VERBS = [
    "reads", "writes", "finds", "sends", "builds", "watches", "ignores", "follows", "loves",
    "computes", "allocates", "frees", "schedules", "measures", "returns", "opens", "closes", "tests",
]
_OBJECTS = [
    "a long letter", "the blue book", "every token", "the memory blocks", "a quiet garden",
    "the morning train", "three apples", "the final answer", "a list of numbers", "the open window",
    "the new policy", "an empty table", "the hidden state", "a paged cache", "the green hills",
]
_ENDINGS = [
    "before noon", "after the storm", "with great care", "in the evening", "without a word",
    "every single day", "as fast as possible", "on the second floor", "for the first time",
    "because it was late", "near the station", "in a small village", "under the bright lights",
]
_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education token batch block layer"
).split()

_CODE_SNIPPETS = [
    "def {f}({a}, {b}):\n    return {a} + {b} * {n}\n",
    "for {a} in range({n}):\n    {b}.append({a} * {a})\n",
    "if {a} > {n}:\n    print(\"{a} is large\")\nelse:\n    {b} = {a} - 1\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n\n    def {f}(self):\n        return self.{a}\n",
    "import torch\n{a} = torch.zeros({n}, {n})\n{b} = {a}.sum(dim=-1)\n",
    "{b} = [{a} for {a} in {f}({n}) if {a} % 2 == 0]\n",
    "with open(\"{f}.txt\") as fh:\n    {a} = fh.read().split()\n",
    "while {a} < {n}:\n    {a} += 1\n    {b} = {b} * 2\n",
    "def {f}(self, {a}: int) -> list[int]:\n    \"\"\"Return the first {a} values.\"\"\"\n    return list(range({a}))\n",
    "{b} = {{\"{a}\": {n}, \"{f}\": [1, 2, 3]}}\n",
    "fn {f}({a}: u32) -> u32 {{\n    {a} * {n}\n}}\n",
    "int {f}(int {a}) {{ return {a} << {n}; }}\n",
]
_IDENTS = ["x", "y", "i", "j", "n", "count", "total", "items", "result", "value", "block", "seq",
           "tokens", "data", "key", "idx", "batch", "out", "cache", "size"]
_FUNCS = ["compute", "load", "step", "schedule", "allocate", "free", "forward", "sample", "decode",
          "encode", "update", "merge", "split", "parse", "render", "run"]


def tiny_corpus(seed: int = 0, n_lines: int = 3000) -> list[str]:
    """Fixed English + code training text (a list of documents), deterministic for a given seed."""
    rng = random.Random(seed)
    docs: list[str] = []
    for k in range(n_lines):
        kind = k % 3
        if kind == 0:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
            docs.append(s[0].upper() + s[1:])
        elif kind == 1:
            n = rng.randint(4, 14)
            words = [rng.choice(_WORDS) for _ in range(n)]
            punct = rng.choice([".", ".", ",", "?", "!", ";", ":"])
            docs.append(" ".join(words).capitalize() + punct + f" {rng.randint(0, 2024)}")
        else:
            snippet = rng.choice(_CODE_SNIPPETS)
            a, b = rng.sample(_IDENTS, 2)
            f = rng.choice(_FUNCS)
            docs.append(snippet.format(a=a, b=b, f=f, F=f.capitalize(), n=rng.randint(0, 128)))
    return docs


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _train_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    # Like Llama: encode(..., add_special_tokens=True) prepends <s>.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tok.to_str()


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """A byte-level BPE tokenizer trained on ``tiny_corpus()``, wrapped as PreTrainedTokenizerFast.

    Special tokens: ``<s>`` (bos, id 0), ``</s>`` (eos, id 1), ``<pad>`` (pad, id 2).  Encoding with
    ``add_special_tokens=True`` prepends ``<s>``; ``CHAT_TEMPLATE`` also starts with ``<s>``.
    Training is cached per process (it takes well under a second).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_train_tokenizer_json(vocab_size))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    return tok


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------

_BASE = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    dtype="float32",
)

OUT_GAIN_TIED = 5.0
QK_NORM_RANGE = (1.5, 3.0)
# seeds in the order the archs were added (the MoE ones before the later dense ones): no arch's weights change
_ARCH_SEEDS = {a: i for i, a in enumerate(_FIRST_ARCHS + _FIRST_MOE_ARCHS + ARCHS[len(_FIRST_ARCHS):]
                                           + MOE_ARCHS[len(_FIRST_MOE_ARCHS):])}


def _arch_spec(arch: str) -> tuple[str, dict[str, Any]]:
    """(model class name, config kwargs) for an arch name."""
    if arch in ("llama", "sharded"):
        return "LlamaForCausalLM", dict(_BASE)
    if arch == "llama-hd128":
        return "LlamaForCausalLM", dict(_BASE, head_dim=128)
    if arch == "llama-tied":
        return "LlamaForCausalLM", dict(_BASE, tie_word_embeddings=True)
    if arch == "llama3-rope":
        return "LlamaForCausalLM", dict(
            _BASE,
            max_position_embeddings=2048,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "mistral":
        return "MistralForCausalLM", dict(_BASE, sliding_window=None)
    if arch == "mistral-sw":
        return "MistralForCausalLM", dict(_BASE, sliding_window=32)
    if arch == "qwen2":
        return "Qwen2ForCausalLM", dict(_BASE, use_sliding_window=False, sliding_window=None)
    if arch == "qwen2-sw":
        return "Qwen2ForCausalLM", dict(_BASE, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    if arch == "qwen3":
        # head_dim 32 while hidden/heads = 16: catches code that derives head_dim from hidden size.
        return "Qwen3ForCausalLM", dict(
            _BASE, head_dim=32, use_sliding_window=False, sliding_window=None, attention_bias=False
        )
    if arch == "qwen3-hd128":
        return "Qwen3ForCausalLM", dict(
            _BASE, head_dim=128, use_sliding_window=False, sliding_window=None, attention_bias=False
        )
    if arch == "gemma2":
        return "Gemma2ForCausalLM", dict(_BASE, head_dim=16, sliding_window=32, attn_logit_softcapping=10.0,
                                         final_logit_softcapping=30.0, query_pre_attn_scalar=24)
    if arch == "gemma3":
        return "Gemma3ForCausalLM", dict(
            _BASE, num_hidden_layers=3, head_dim=32, sliding_window=32, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}})
    if arch == "phi3":
        return "Phi3ForCausalLM", dict(
            _BASE, original_max_position_embeddings=1, sliding_window=None,
            rope_scaling={"type": "longrope", "attention_factor": 1.2,
                          "short_factor": [1.0 + 0.05 * i for i in range(8)],
                          "long_factor": [1.5 + 0.5 * i for i in range(8)]})
    if arch == "mixtral":
        return "MixtralForCausalLM", dict(_BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=None, num_hidden_layers=2)
    if arch == "qwen2-moe":
        return "Qwen2MoeForCausalLM", dict(_BASE, **_MOE, num_experts=4, shared_expert_intermediate_size=48,
                                           norm_topk_prob=False, use_sliding_window=False, sliding_window=None)
    if arch == "qwen3-moe":
        return "Qwen3MoeForCausalLM", dict(_BASE, **_MOE, num_experts=6, norm_topk_prob=True, head_dim=32,
                                           mlp_only_layers=[0], decoder_sparse_step=1, use_sliding_window=False,
                                           sliding_window=None, attention_bias=False)
    if arch == "gpt-oss":
        return "GptOssForCausalLM", dict(
            _BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=32, sliding_window=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
            attention_bias=True, output_router_logits=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 256, "rope_theta": 150000.0})
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS + MOE_ARCHS}")


def _config_class(model_cls_name: str):
    import transformers

    if model_cls_name == "Gemma3ForCausalLM":  # the text-only model's config (Gemma3Config is the multimodal one)
        return transformers.Gemma3TextConfig
    return getattr(transformers, model_cls_name.replace("ForCausalLM", "Config"))


def build_tiny_model(arch: str, *, tokenizer=None, seed: int | None = None, **overrides):
    """Build the (in-memory, eval-mode, float32) transformers model for ``arch`` with our init."""
    import transformers

    if tokenizer is None:
        tokenizer = build_tiny_tokenizer()
    cls_name, kwargs = _arch_spec(arch)
    kwargs.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides)
    config = _config_class(cls_name)(**kwargs)
    model_cls = getattr(transformers, cls_name)
    if seed is None:
        seed = 1000 + _ARCH_SEEDS[arch]
    torch.manual_seed(seed)  # construction draws from the global RNG; we overwrite every param below
    model = model_cls(config).to(torch.float32)
    _init_weights(model, seed)
    model.eval()
    return model


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic, non-degenerate init (see module docstring). Every parameter is overwritten."""
    gen = torch.Generator().manual_seed(seed)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # With tied embeddings the residual stream contains the current token's own lm_head row, which
    # makes greedy decoding repeat the last token; larger layer outputs drown that self-logit.
    out_gain = OUT_GAIN_TIED if tied else 1.0

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)

    def uniform(p, lo, hi):
        p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo)

    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        if name.endswith("embed_tokens.weight"):
            normal(p, 1.0)
        elif name.endswith("lm_head.weight"):
            normal(p, 0.4)  # logits std ~ 0.4 * sqrt(hidden) ~ 3
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            # q/k are RMS-normalised per head: weights > 1 keep attention peaked as for Llama
            uniform(p, QK_NORM_RANGE[0], QK_NORM_RANGE[1])
        elif name.endswith("norm.weight"):  # input/post-attention/final norms
            uniform(p, 0.5, 1.5)
        elif name.endswith(".bias"):
            normal(p, 0.3)
        elif leaf in ("q_proj", "k_proj"):
            normal(p, 1.5 / math.sqrt(p.shape[1]))  # peaked attention: positions/masks matter
        elif leaf in ("o_proj", "down_proj"):
            normal(p, out_gain / math.sqrt(p.shape[1]))
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # gpt-oss's stacked [E, in, out]
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        elif name.endswith(("_proj_bias", "self_attn.sinks")):  # gpt-oss's expert biases, per-head sink logits
            normal(p, 0.3 if "proj" in name else 1.0)
        elif p.dim() == 3:  # stacked experts [E, out, in] (transformers' MoE layout in memory)
            normal(p, 1.0 / math.sqrt(p.shape[2]))
        elif name.endswith(".weight") and p.dim() == 2:
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        else:
            raise AssertionError(f"tiny model init does not know parameter {name} {tuple(p.shape)}")
    if tied:
        # The shared matrix got the embedding init (std 1); rescale so logits are not too sharp.
        emb = model.get_input_embeddings().weight
        emb.mul_(0.4)
        assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()


def make_tiny_checkpoint(
    arch: str,
    out_dir,
    *,
    tokenizer=None,
    seed: int | None = None,
    max_shard_size: str | None = None,
    legacy_rope_config: bool = False,
    **overrides,
) -> Path:
    """Write a tiny random-weight checkpoint for ``arch`` into ``out_dir`` and return its path.

    Writes ``config.json``, ``model.safetensors`` (or shards + ``model.safetensors.index.json``),
    ``generation_config.json`` and the tokenizer files.  ``overrides`` go to the model config
    (e.g. ``num_hidden_layers=4``).  ``arch="sharded"`` defaults ``max_shard_size`` to "200KB".

    transformers 5 writes RoPE settings as ``rope_parameters`` (with ``rope_theta`` inside).  With
    ``legacy_rope_config=True`` config.json is rewritten the transformers-4 way (top-level
    ``rope_theta`` + ``rope_scaling``), as most hub checkpoints have it; transformers 5 loads both.
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(arch, tokenizer=tokenizer, seed=seed, **overrides)
    if arch == "sharded" and max_shard_size is None:
        max_shard_size = "200KB"
    save_kwargs: dict[str, Any] = dict(safe_serialization=True)
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    if legacy_rope_config:
        _rewrite_rope_legacy(out / "config.json")
    return out


def _rewrite_rope_legacy(config_path: Path) -> None:
    cfg = json.loads(config_path.read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    rope = dict(rope)
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
