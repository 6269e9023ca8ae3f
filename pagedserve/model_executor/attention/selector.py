"""Which attention backend a runner uses: `--attention-backend` (vLLM's name), resolved once per runner.

A backend is one file in this package and one line in ATTENTION_BACKENDS (module path and class, imported only
when chosen: the Triton backend imports triton, which must not load where it is not used).

"auto" (the default) takes PAGEDSERVE_ATTENTION_BACKEND when it is set, else picks by device: Triton on CUDA when
it imports (else the PyTorch reference), the native CPU kernels on a CPU (each op falls back to the reference
where its kernel does not apply or did not build), the PyTorch reference on any other device.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagedserve import envs

if TYPE_CHECKING:
    import torch

    from pagedserve.model_executor.attention.backend import AttentionBackend

ATTENTION_BACKENDS: dict[str, str] = {
    "cpu": "pagedserve.model_executor.attention.cpu:CpuAttentionBackend",
    "triton": "pagedserve.model_executor.attention.triton:TritonAttentionBackend",
    "torch": "pagedserve.model_executor.attention.torch_sdpa:TorchSDPABackend",
}
ATTENTION_BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS)


def validate_attention_backend(name: str) -> None:
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, got {name!r}.")


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention_backend_name(name: str, device_type: str) -> str:
    """The registry name `name` stands for on this device type ("auto" resolved; see the module docstring)."""
    if name == "auto":
        name = envs.PAGEDSERVE_ATTENTION_BACKEND
        validate_attention_backend(name)
    if name != "auto":
        return name
    if device_type == "cuda":
        return "triton" if _triton_imports() else "torch"
    return "cpu" if device_type == "cpu" else "torch"


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """A new backend object for `name` ("auto" or a registry name) on `device`; ValueError when it cannot run."""
    validate_attention_backend(name)
    name = resolve_attention_backend_name(name, device.type)
    if name == "triton" and not _triton_imports():
        raise ValueError("attention backend 'triton' needs the triton package (pip install -e '.[triton]').")
    module_name, class_name = ATTENTION_BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    cls.check_device(device)
    return cls(device)
