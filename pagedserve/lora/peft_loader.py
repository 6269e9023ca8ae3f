"""A PEFT LoRA adapter's weights from adapter_model.safetensors: per layer and projection the A and B matrices, B
times the adapter's scaling (its config is checked first: lora/adapter_config.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.lora.adapter_config import TARGET_MODULES, read_adapter_config

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAWeights:
    """One adapter on the host: (layer index, module name) -> (A [rank, in], B [out, rank] times the scaling)."""
    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(lora_path: str, max_lora_rank: int, num_layers: int) -> LoRAWeights:
    config = read_adapter_config(lora_path, max_lora_rank)
    try:
        parts = _read_tensors(lora_path, num_layers)
    except ValueError:
        raise
    except Exception as exc:  # safetensors' own error for a truncated or foreign file, OSError
        raise ValueError(f"lora_path {lora_path!r}: unreadable adapter_model.safetensors ({exc}).") from exc
    modules = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != config.rank or ab["B"].shape[1] != config.rank:
            raise ValueError(f"lora_path {lora_path!r}: layer {layer} {module} needs lora_A [r, in] and lora_B "
                             f"[out, r] with r={config.rank}.")
        modules[(layer, module)] = (ab["A"], ab["B"] * config.scaling)
    return LoRAWeights(config.rank, modules)


def _read_tensors(lora_path: str, num_layers: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module) -> {"A": tensor, "B": tensor}, float32."""
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(Path(lora_path) / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():
            match = _KEY.search(key)
            if match is None or match.group(2) not in TARGET_MODULES:
                raise ValueError(f"lora_path {lora_path!r}: unsupported tensor {key!r} in adapter_model.safetensors.")
            layer, module, which = int(match.group(1)), match.group(2), match.group(3)
            if layer >= num_layers:
                raise ValueError(f"lora_path {lora_path!r}: tensor {key!r} names layer {layer}; the model has "
                                 f"{num_layers}.")
            parts.setdefault((layer, module), {})[which] = f.get_tensor(key).float()
    return parts
