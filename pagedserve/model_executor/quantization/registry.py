"""The `--quantization` values (vLLM's names), each a config class imported only when chosen; None (no
`--quantization`) is the checkpoint's own: its float weights, or the pre-quantized format config.json's
quantization_config names (CHECKPOINT_FORMATS, which read that config). A new format: its file, and one line here."""
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
    "gptq": "pagedserve.model_executor.quantization.gptq:GPTQConfig",
    "awq": "pagedserve.model_executor.quantization.awq:AWQConfig",
    "compressed-tensors": "pagedserve.model_executor.quantization.compressed_tensors:CompressedTensorsConfig",
    "fp8": "pagedserve.model_executor.quantization.fp8:Fp8Config",
    "gguf": "pagedserve.model_executor.quantization.gguf:GGUFConfig",
}
# weights quantized in the checkpoint, as its quantization_config describes
CHECKPOINT_FORMATS = ("gptq", "awq", "compressed-tensors", "fp8", "gguf")
# checkpoint formats the model's loader dequantizes as it reads them (gpt-oss's MXFP4 experts): the model then runs
# as a float checkpoint, or with --quantization int8
DEQUANTIZED_ON_LOAD = ("mxfp4",)


def validate_quantization(name: str | None) -> None:
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}, got {name!r}.")


def resolve_quantization(name: str | None, checkpoint_config: dict | None) -> str | None:
    """The method that runs: `--quantization` (name) against config.json's quantization_config, as vLLM decides - the
    checkpoint's format when no name is given; a name that is not it is a ValueError, as is a checkpoint format named
    for a checkpoint without one."""
    validate_quantization(name)
    method = str(checkpoint_config.get("quant_method", "")).lower() if checkpoint_config else None
    if not method:
        if name in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization={name!r} reads a pre-quantized checkpoint, and this one's config.json has "
                             "no quantization_config.")
        return name
    if method in DEQUANTIZED_ON_LOAD and name not in CHECKPOINT_FORMATS:
        return name
    if method not in CHECKPOINT_FORMATS:
        raise ValueError(f"The checkpoint's quantization_config has quant_method {method!r}; supported: "
                         f"{', '.join(CHECKPOINT_FORMATS)}.")
    if name is not None and name != method:
        raise ValueError(f"Quantization method specified in the model config ({method}) does not match the "
                         f"quantization method specified in the `quantization` argument ({name}).")
    return method


def get_quantization_config(name: str | None, linear_backend: str, device: torch.device,
                            checkpoint_config: dict | None = None) -> QuantizationConfig:
    """The config for `--quantization name` (as resolved) with `--linear-backend` on `device`, given config.json's
    quantization_config; ValueError where it cannot run."""
    validate_quantization(name)
    module_name, class_name = (UNQUANTIZED if name is None else QUANTIZATION_METHODS[name]).split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if name in CHECKPOINT_FORMATS:
        return cls(linear_backend, device, checkpoint_config)
    return cls(linear_backend, device)
