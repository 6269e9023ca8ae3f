"""Tiny GGUF files written here with the `gguf` package (llama.cpp's own Python writer): a tiny random checkpoint
of tests/tiny_models.py (llama, qwen2, or the MoE qwen2-moe / qwen3-moe: experts stacked per layer and projection as
llama.cpp's `ffn_*_exps`, routers F32) with its tokenizer (byte-level BPE as llama.cpp's "gpt2" tokenizer model)
and chat template in the metadata, its linear weights in one tensor type, norms in F32.

    path = make_tiny_gguf("llama", "Q4_0", out_dir)

Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and F16/BF16 quantize the checkpoint's weights with gguf's reference quantizers; the
K-quants (gguf-py has no quantizer for them) are random blocks with bounded scales, on a model widened to rows of
256 (one K-quant super-block). llama's q/k rows are permuted as llama.cpp's convert_hf_to_gguf.py does.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny_models import CHAT_TEMPLATE, make_tiny_checkpoint

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1") + K_QUANTS

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          # MoE layers (qwen2moe/qwen3moe): the router, Qwen2-MoE's shared expert and its gate
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GGUF_ARCH = {"qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe"}  # else the tiny arch's name
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant super-blocks whose f16 scales keep weights near 1/sqrt(cols) in size."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # ... scales[16] int8, d f16 (last)
        blocks[:, -2:] = np.full(len(blocks), 2e-5 / np.sqrt(cols) * 16, np.float16).view(np.uint8).reshape(-1, 2)
    else:  # d f16, dmin f16, ...
        d = np.full(len(blocks), 4e-3 / np.sqrt(cols), np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, 0:2] = d
        blocks[:, 2:4] = d
    return blocks.reshape(rows, cols // block_size * type_size)


def make_tiny_gguf(arch: str, tensor_type: str, out_dir, *, seed: int = 0, quantize_head: bool = False,
                   layer_types: dict[str, str] | None = None, **overrides) -> Path:
    """quantize_head: the LM head (`output`, or `token_embd` when tied) in `tensor_type` too, as llama.cpp writes it;
    layer_types: another type for some layer tensors (e.g. {"attn_v": "Q6_K"}: Q4_K_M's mix); overrides: of the tiny
    checkpoint's config (tests/tiny_models.py)."""
    import gguf
    from safetensors.numpy import load_file

    out_dir = Path(out_dir)
    layer_types = layer_types or {}
    k_quant = {tensor_type, *layer_types.values()} & set(K_QUANTS)
    widen = dict(hidden_size=256, intermediate_size=512, head_dim=64) if k_quant else {}
    if k_quant and arch in _GGUF_ARCH:  # the experts' down projection reads rows of moe_intermediate_size
        widen.update(moe_intermediate_size=256, shared_expert_intermediate_size=256 if arch == "qwen2-moe" else 0)
    overrides = {**widen, **overrides}
    if arch == "qwen3-moe":  # llama.cpp's qwen3moe has experts in every layer (no mlp_only_layers)
        overrides.setdefault("mlp_only_layers", [])
    if arch == "qwen2-moe":  # the shared expert's down projection in whole blocks of 32 (the tiny model's is 48)
        overrides.setdefault("shared_expert_intermediate_size", 64)
    ckpt = make_tiny_checkpoint(arch, out_dir / "hf", seed=seed, **overrides)
    cfg = json.loads((ckpt / "config.json").read_text())
    weights = load_file(str(ckpt / "model.safetensors"))
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    rng = np.random.default_rng(seed)

    path = out_dir / f"tiny-{arch}-{'-'.join([tensor_type, *layer_types.values()])}.gguf"
    w = gguf.GGUFWriter(str(path), _GGUF_ARCH.get(arch, arch))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if num_experts:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"] for t in tok.get("added_tokens", [])}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for _, i in vocab])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def put(name: str, data: np.ndarray, quantize: bool, type_name: str = tensor_type) -> None:
        data = data.astype(np.float32)
        qtype = gguf.GGMLQuantizationType[type_name]
        if not quantize or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif type_name in K_QUANTS:
            blocks = random_k_blocks(qtype, int(np.prod(data.shape[:-1])), data.shape[-1], rng)
            w.add_tensor(name, blocks.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    put("token_embd.weight", weights["model.embed_tokens.weight"], quantize_head and "lm_head.weight" not in weights)
    put("output_norm.weight", weights["model.norm.weight"], False)
    if "lm_head.weight" in weights:
        put("output.weight", weights["lm_head.weight"], quantize_head)
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in _NAMES.items():
            for kind in ("weight", "bias"):
                t = weights.get(f"model.layers.{i}.{hf}.{kind}")
                if t is None:
                    continue
                if arch.startswith("llama") and gg in ("attn_q", "attn_k"):
                    t = _permute(t, heads if gg == "attn_q" else kv_heads)
                if gg == "ffn_gate_inp_shexp":  # llama.cpp writes the shared expert's gate as a vector
                    t = t.reshape(-1)
                linear = kind == "weight" and t.ndim == 2 and gg != "ffn_gate_inp"  # routers stay F32
                put(f"blk.{i}.{gg}.{kind}", t, linear, layer_types.get(gg, tensor_type))
        for hf, gg in _EXPERT_NAMES.items():  # [experts, rows, cols], as llama.cpp stacks them
            stacked = [weights.get(f"model.layers.{i}.mlp.experts.{e}.{hf}.weight") for e in range(num_experts or 0)]
            if stacked and stacked[0] is not None:
                put(f"blk.{i}.{gg}.weight", np.stack(stacked), True, layer_types.get(gg, tensor_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
