"""Real model shapes with random weights: `pagedserve bench make-model --shape NAME --out DIR`.

No network here, so benchmarks run on checkpoints that have the *shape* of a real model
(the same layer count, widths, GQA ratio, vocabulary and tied embeddings, hence the same
FLOPs, weight bytes and KV bytes per token) but random weights.  Timing does not depend on
the weight values; the text they produce is noise, which is fine because benchmark prompts
are random token ids anyway and requests run with ``ignore_eos``.

What gets written (the layout of a Hugging Face checkpoint):

* ``config.json`` - a transformers config (``LlamaForCausalLM`` / ``Qwen3ForCausalLM``).
  Transformers 5 writes RoPE settings as ``rope_parameters``; we additionally write the
  hub-style top-level ``rope_theta`` / ``rope_scaling`` so loaders that read either work.
* ``model.safetensors`` - weights, N(0, 0.02) for matrices, ones for norms.  The model is
  built on the meta device and materialised with ``torch.randn`` (no slow per-module init),
  so even the 1B shape takes seconds.  Tied embeddings are stored once, as in the hub files.
* ``generation_config.json``
* a tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) whose length equals the
  shape's vocabulary: a byte-level BPE (256 byte symbols + up to 1000 merges learned with
  the ``tokenizers`` trainer from built-in text: the Zen of Python and the docstrings of
  Python builtins), the shape's real special tokens at their real ids (e.g. Llama-3's
  ``<|begin_of_text|>`` = 128000, Qwen's ``<|im_end|>`` = 151645), and every remaining id
  filled with a dummy vocabulary entry ``<dummy_N>``.  Dummy entries are ordinary BPE vocab
  entries that no merge produces, so encoding never emits them, but every id in
  ``[0, vocab_size)`` decodes to *something* (a random model samples from the whole vocab).
  A ChatML chat template is attached so the chat endpoints work.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str  # LlamaForCausalLM | Qwen3ForCausalLM | Qwen3MoeForCausalLM
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    # (id, text) of the special tokens; the first one listed with role "eos" is the EOS
    special_tokens: tuple[tuple[int, str], ...] = ()
    bos: str | None = None
    eos: str = "<|endoftext|>"
    hub_id: str = ""  # the real model this shape copies, for the docs
    # mixture of experts (Qwen3MoeForCausalLM): every layer sparse, experts of width moe_intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def model_type(self) -> str:
        return {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                "Qwen3MoeForCausalLM": "qwen3_moe"}[self.architecture]

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    # ---- sizes used by the roofline -------------------------------------------------
    def num_params(self, include_embedding: bool = True) -> int:
        h, d = self.hidden_size, self.dim_head
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        if self.model_type.startswith("qwen3"):
            attn += 2 * d  # q_norm, k_norm
        mlp = self._mlp_params(self.num_experts)
        per_layer = attn + mlp + 2 * h
        total = self.num_layers * per_layer + h  # final norm
        if include_embedding:
            total += self.vocab_size * h
            if not self.tie_word_embeddings:
                total += self.vocab_size * h
        return total

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul for every token: all linears + the LM head."""
        h, d = self.hidden_size, self.dim_head
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        mlp = self._mlp_params(self.num_experts_per_tok)  # a token runs only its top-k experts
        return self.num_layers * (attn + mlp) + self.vocab_size * h

    def _mlp_params(self, experts: int) -> int:
        """One layer's MLP over `experts` experts (with the router), or the dense MLP."""
        h = self.hidden_size
        if not self.num_experts:
            return 3 * h * self.intermediate_size
        return experts * 3 * h * self.moe_intermediate_size + h * self.num_experts

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.dim_head * dtype_bytes

    def hf_config_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            head_dim=self.dim_head,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act="silu",
            rope_theta=self.rope_theta,
            attention_bias=False,
        )
        if self.rope_scaling:
            kw["rope_scaling"] = dict(self.rope_scaling)
        if self.num_experts:
            kw.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=True)
        ids = dict((t, i) for i, t in self.special_tokens)
        kw["eos_token_id"] = ids.get(self.eos)
        kw["bos_token_id"] = ids.get(self.bos) if self.bos else None
        return kw


_SMOL_SPECIALS = tuple(enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>",
                                  "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>",
                                  "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
                                  "<jupyter_output>", "<jupyter_script>", "<empty_output>"]))
_QWEN_SPECIALS = tuple((151643 + i, t) for i, t in enumerate(
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
     "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
     "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
     "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
     "<think>", "</think>"]))
_LLAMA3_SPECIALS = ((128000, "<|begin_of_text|>"), (128001, "<|end_of_text|>"), (128006, "<|start_header_id|>"),
                    (128007, "<|end_header_id|>"), (128008, "<|eom_id|>"), (128009, "<|eot_id|>"))

SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in [
        ModelShape("smollm2-135m", "LlamaForCausalLM", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                   intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                   special_tokens=_SMOL_SPECIALS, bos="<|endoftext|>", eos="<|endoftext|>",
                   hub_id="HuggingFaceTB/SmolLM2-135M"),
        ModelShape("qwen3-0.6b", "Qwen3ForCausalLM", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                   head_dim=128, intermediate_size=3072, vocab_size=151936, rope_theta=1000000.0,
                   max_position_embeddings=40960, rms_norm_eps=1e-6, special_tokens=_QWEN_SPECIALS,
                   eos="<|im_end|>", hub_id="Qwen/Qwen3-0.6B"),
        ModelShape("llama-3.2-1b", "LlamaForCausalLM", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                   head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                   max_position_embeddings=131072, special_tokens=_LLAMA3_SPECIALS, bos="<|begin_of_text|>",
                   eos="<|end_of_text|>", hub_id="meta-llama/Llama-3.2-1B"),
        # Llama-3-8B's layer with 4 of its 32 layers (the whole model is 32 GB in fp32; the per-layer GEMM shapes and
        # the 128k-vocab head are Llama-3-8B's, so the weight formats' kernels see its shapes)
        ModelShape("llama-3-8b-4l", "LlamaForCausalLM", hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8,
                   head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                   max_position_embeddings=8192, tie_word_embeddings=False, special_tokens=_LLAMA3_SPECIALS,
                   bos="<|begin_of_text|>", eos="<|end_of_text|>", hub_id="meta-llama/Meta-Llama-3-8B"),
        # Qwen3-30B-A3B's layer with 2 of its 48 layers (the whole model is 61 GB in bf16; make the layer count
        # fit the machine with --override num_layers=N)
        ModelShape("qwen3-30b-a3b-2l", "Qwen3MoeForCausalLM", hidden_size=2048, num_layers=2, num_heads=32,
                   num_kv_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936, rope_theta=1000000.0,
                   max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                   special_tokens=_QWEN_SPECIALS, eos="<|im_end|>", hub_id="Qwen/Qwen3-30B-A3B"),
        # Tiny shapes for tests and smoke runs (not real models).
        ModelShape("tiny-llama", "LlamaForCausalLM", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=128, vocab_size=512, max_position_embeddings=2048,
                   special_tokens=_SMOL_SPECIALS[:3], bos="<|endoftext|>", eos="<|endoftext|>"),
        ModelShape("tiny-qwen3", "Qwen3ForCausalLM", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, intermediate_size=128, vocab_size=512, max_position_embeddings=2048,
                   rms_norm_eps=1e-6, special_tokens=tuple((509 + i, t) for i, t in
                                                           enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])),
                   eos="<|im_end|>"),
    ]
}


def get_shape(name: str, overrides: dict[str, Any] | None = None) -> ModelShape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    if overrides:
        shape = dataclasses.replace(shape, **overrides)
    return shape


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """`key=value` pairs (e.g. num_layers=4) -> typed dict for dataclasses.replace."""
    out: dict[str, Any] = {}
    types = {f.name: f.type for f in dataclasses.fields(ModelShape)}
    for item in items or []:
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in types:
            raise ValueError(f"unknown shape field {key!r}")
        t = str(types[key])
        if "int" in t:
            out[key] = int(value)
        elif "float" in t:
            out[key] = float(value)
        elif "bool" in t:
            out[key] = value.lower() in ("1", "true", "yes")
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------
# tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _training_text() -> list[str]:
    """Built-in, deterministic-enough English+code text to learn the BPE merges from."""
    import builtins
    import codecs
    import this  # the Zen of Python; prints it on first import (callers redirect stdout)

    zen = codecs.decode(this.s, "rot13")
    docs = [zen]
    for name in sorted(dir(builtins)):
        doc = getattr(getattr(builtins, name), "__doc__", None)
        if isinstance(doc, str):
            docs.append(doc)
    return docs


def build_tokenizer(shape: ModelShape, num_merges: int = 1000):
    """A PreTrainedTokenizerFast with len() == shape.vocab_size (see the module docstring)."""
    import contextlib
    import io

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = dict(shape.special_tokens)  # id -> text
    vocab_size = shape.vocab_size
    # Learn merges on free ids only: a small trainer vocab, then re-number.
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learn = max(0, min(num_merges, vocab_size - len(specials) - 256))
    trainer = trainers.BpeTrainer(vocab_size=256 + learn, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with contextlib.redirect_stdout(io.StringIO()):
        text = _training_text()
    base.train_from_iterator(text, trainer=trainer)
    learned = json.loads(base.to_str())["model"]
    learned_vocab: dict[str, int] = learned["vocab"]
    merges = learned["merges"]

    # Lay out ids: specials at their real ids, the learned tokens in order on the free ids,
    # dummies on whatever is left.
    vocab: dict[str, int] = {}
    free = (i for i in range(vocab_size) if i not in specials)
    for tok, _ in sorted(learned_vocab.items(), key=lambda kv: kv[1]):
        vocab[tok] = next(free)
    for i, tok in specials.items():
        vocab[tok] = i
    n = 0
    for i in free:
        vocab[f"<dummy_{n}>"] = i
        n += 1
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)

    merges_t = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_t))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Special tokens are added tokens (matched before BPE, skipped with skip_special_tokens).
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in sorted(specials.items())])
    kw: dict[str, Any] = {"eos_token": shape.eos}
    if shape.bos:
        kw["bos_token"] = shape.bos
    if "<|im_start|>" in specials.values():
        kw["chat_template"] = CHATML_TEMPLATE
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    if "chat_template" not in kw:
        hf.chat_template = CHATML_TEMPLATE.replace("<|im_start|>", "").replace("<|im_end|>", "\n")
    return hf


# ---------------------------------------------------------------------------------------
# weights


def make_model(shape: ModelShape, out_dir: str, dtype: str = "float32", seed: int = 0,
               with_tokenizer: bool = True, verbose: bool = True) -> str:
    """Write a random-weight Hugging Face checkpoint of `shape` to out_dir; returns out_dir."""
    import torch
    import transformers

    t0 = time.perf_counter()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen3ForCausalLM": transformers.Qwen3Config,
                  "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig}[shape.architecture]
    model_cls = getattr(transformers, shape.architecture)
    config = config_cls(**shape.hf_config_kwargs())
    config.architectures = [shape.architecture]
    with torch.device("meta"):
        model = model_cls(config).to(torch_dtype)  # no memory, no init
    model = model.to_empty(device="cpu")  # uninitialised storage in the target dtype
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights (q_norm / k_norm / layer norms)
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02))
    # to_empty leaves buffers (rotary inv_freq) uninitialised; they are not saved, but fix them so the
    # in-memory model is usable too.
    _reinit_rotary(model)
    model.tie_weights()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _add_hub_style_rope(os.path.join(out_dir, "config.json"), shape, dtype)
    if with_tokenizer:
        tok = build_tokenizer(shape)
        tok.save_pretrained(out_dir)
    if verbose:
        n = shape.num_params()
        print(f"wrote {shape.name} ({n / 1e6:.1f}M params, {dtype}) to {out_dir} in {time.perf_counter() - t0:.1f}s")
    return out_dir


def _reinit_rotary(model) -> None:
    """to_empty() leaves non-persistent buffers (rotary inv_freq) as garbage: rebuild them on CPU."""
    for mod in model.modules():
        if hasattr(mod, "inv_freq") and hasattr(mod, "config"):
            fresh = type(mod)(mod.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(mod, name, buf)


def _add_hub_style_rope(path: str, shape: ModelShape, dtype: str) -> None:
    with open(path) as f:
        cfg = json.load(f)
    cfg["rope_theta"] = shape.rope_theta
    cfg["rope_scaling"] = dict(shape.rope_scaling) if shape.rope_scaling else None
    cfg["torch_dtype"] = dtype
    cfg.setdefault("dtype", dtype)
    cfg["pagedserve_shape"] = shape.name  # informational: random weights, see benchmarks/shapes.py
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
