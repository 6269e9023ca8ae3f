"""What the engine needs from a checkpoint's config.json, read directly (old and new transformers layouts), with
what the engine resolved about serving it (dtype, max_model_len, served name): frozen once created."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pagedserve.model_executor.gguf_loader import gguf_checkpoint_dir, is_gguf_file
from pagedserve.model_executor.models.registry import SUPPORTED_ARCHITECTURES


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool | None  # config.json's attention_bias (None: not given, the family's default)
    checkpoint_dtype: str | None
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    sliding_window: int | None  # a sliding layer attends to the last this many positions (None: full attention)
    layer_types: tuple[str, ...] | None  # per layer "sliding_attention" | "full_attention" (None: all slide)
    quantization_config: dict | None  # a pre-quantized checkpoint's (GPTQ, AWQ, compressed-tensors)
    # ---- resolved for serving (from_dir's arguments)
    dtype: str  # the weights' and activations' dtype: float32 | bfloat16 | float16
    max_model_len: int  # prompt + output tokens of one request
    served_model_name: str
    tokenizer: str  # the tokenizer's path or hub id
    is_default_model: bool  # the embedded demo model
    hf_overrides: dict | None = None  # vLLM's --hf-overrides: config.json fields replaced (read over the file's)

    @classmethod
    def from_dir(cls, model_dir: Path, *, dtype: str = "float32", max_model_len: int | None = None,
                 served_model_name: str | None = None, tokenizer: str | None = None,
                 is_default_model: bool = False, hf_overrides: dict | None = None) -> "ModelConfig":
        """The checkpoint's config; max_model_len defaults to the positions the model supports (and may not exceed
        them), the served name to the directory."""
        cfg = json.loads((model_dir / "config.json").read_text()) | (hf_overrides or {})
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"Model architecture {archs or cfg.get('model_type')} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}.")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        num_heads = cfg["num_attention_heads"]
        # a window without use_sliding_window (Mistral's configs) is in use; Qwen's configs say when it is not
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        max_pos = cfg.get("max_position_embeddings", 2048)
        if cfg.get("model_type") in ("roberta", "xlm-roberta"):  # positions start past the padding id (bert.py)
            max_pos -= cfg.get("pad_token_id", 1) + 1
        layer_types = cfg.get("layer_types")
        if layer_types is None and sliding and "max_window_layers" in cfg:  # Qwen2's layers from this one slide
            layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                           for i in range(cfg["num_hidden_layers"])]
        limit = _scaled_context(max_pos, scaling)
        if max_model_len is not None and max_model_len > limit:
            scaled = f", {limit} with its rope scaling" if limit != max_pos else ""
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                             f"({max_pos}{scaled}).")
        return cls(
            model_dir=model_dir,
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias"),
            checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=_eos_ids(model_dir, cfg),
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=sliding or None,
            layer_types=tuple(layer_types) if layer_types else None,
            quantization_config=cfg.get("quantization_config"),
            dtype=dtype,
            max_model_len=max_model_len or max_pos,
            served_model_name=served_model_name or str(model_dir),
            tokenizer=tokenizer or str(model_dir),
            is_default_model=is_default_model,
            hf_overrides=hf_overrides or None,
        )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of the checkpoint's layer `layer` (global index), None where it attends to everything."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def path(self) -> str:
        return str(self.model_dir)

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h
        return self.num_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h


def _scaled_context(max_pos: int, scaling: dict | None) -> int:
    """The positions a model serves: yarn's and dynamic NTK's scaling extend max_position_embeddings by their
    factor (vLLM's rule); the default max_model_len stays max_position_embeddings."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "yarn" and scaling.get("factor"):
        return max(max_pos, int(scaling.get("original_max_position_embeddings", max_pos) * scaling["factor"]))
    if kind == "dynamic":
        return int(max_pos * scaling["factor"])
    return max_pos


def _eos_ids(model_dir: Path, cfg: dict) -> frozenset[int]:
    ids: set[int] = set()
    for source in (cfg, _read_json(model_dir / "generation_config.json")):
        eos = source.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """A local checkpoint directory, a GGUF file (converted once: gguf_loader.py), or a hub id downloaded (or found in the local HF cache) via huggingface_hub."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf" or is_gguf_file(path):
        if not is_gguf_file(path):
            raise ValueError(f"Model path {model!r} is not a GGUF file.")
        return gguf_checkpoint_dir(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory.")
        return path
    if path.exists() or os.sep in model and model.count("/") > 1:
        raise ValueError(f"Model path {model!r} is not a checkpoint directory.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))
    except Exception as exc:  # offline, unknown repo, gated ...
        raise ValueError(f"Could not load model {model!r}: not a local directory and the hub download failed "
                         f"({type(exc).__name__}: {exc}).") from exc
