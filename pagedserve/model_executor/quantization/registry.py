"""The `--quantization` values (vLLM's names), each a config class imported only when chosen; None (no
`--quantization`) is the checkpoint's float weights. A new format: its file, and one line here."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedserve.model_executor.quantization.base import QuantizationConfig

UNQUANTIZED = "pagedserve.model_executor.quantization.unquantized:UnquantizedConfig"
QUANTIZATION_METHODS: dict[str, str] = {
    "int8": "pagedserve.model_executor.quantization.int8:Int8Config",
    "int4": "pagedserve.model_executor.quantization.int4:Int4Config",
}


def validate_quantization(name: str | None) -> None:
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}, got {name!r}.")


def get_quantization_config(name: str | None, linear_backend: str, device: torch.device) -> QuantizationConfig:
    """The config for `--quantization name` with `--linear-backend` on `device`; ValueError where it cannot run."""
    validate_quantization(name)
    module_name, class_name = (UNQUANTIZED if name is None else QUANTIZATION_METHODS[name]).split(":")
    return getattr(importlib.import_module(module_name), class_name)(linear_backend, device)
