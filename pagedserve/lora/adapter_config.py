"""A PEFT LoRA adapter's adapter_config.json, checked against what the engine serves (plain Python: the input
processor validates a request's adapter with it before the engine reads the weights, lora/peft_loader.py).

Supported: LoRA on q/k/v/o_proj and gate/up/down_proj of the decoder layers, any rank up to --max-lora-rank,
`lora_alpha` scaling (alpha / r) and rsLoRA (alpha / sqrt(r)). Refused with a ValueError naming the field: DoRA,
trained biases, modules_to_save, per-module rank/alpha patterns, other target modules (embeddings, lm_head).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora
    target_modules: frozenset[str]


def read_adapter_config(lora_path: str, max_lora_rank: int) -> AdapterConfig:
    """Checks an adapter directory against what the engine serves; ValueError naming the problem."""
    path = Path(lora_path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"lora_path {lora_path!r} has no adapter_config.json (a PEFT adapter directory is needed).")
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"lora_path {lora_path!r} has no adapter_model.safetensors.")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"lora_path {lora_path!r}: unreadable adapter_config.json ({exc}).") from exc
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path {lora_path!r}: peft_type {cfg.get('peft_type')!r} is not LORA.")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_path {lora_path!r}: adapter_config.json 'r' must be a positive integer.")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA rank {rank} of {lora_path!r} is greater than max_lora_rank {max_lora_rank}.")
    for field, ok in (("use_dora", not cfg.get("use_dora")), ("bias", cfg.get("bias", "none") == "none"),
                      ("modules_to_save", not cfg.get("modules_to_save")),
                      ("rank_pattern", not cfg.get("rank_pattern")), ("alpha_pattern", not cfg.get("alpha_pattern")),
                      ("fan_in_fan_out", not cfg.get("fan_in_fan_out"))):
        if not ok:
            raise ValueError(f"lora_path {lora_path!r}: adapter_config.json {field}={cfg.get(field)!r} is not "
                             f"supported.")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = sorted(set(targets) - set(TARGET_MODULES))
    if unsupported:
        raise ValueError(f"lora_path {lora_path!r}: target_modules {unsupported} are not supported (LoRA applies "
                         f"to {', '.join(TARGET_MODULES)}).")
    alpha = cfg.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, scaling, frozenset(targets))
