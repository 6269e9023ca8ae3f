"""What the pre-quantized checkpoint formats (gptq.py, awq.py, compressed_tensors.py) share: their tensors declared as
the layer's parameters (with where the output features lie, so the loader fills a fused q/k/v or gate/up layer shard
by shard), 4-bit values unpacked from int32 words, and which layers a checkpoint left in float."""
from __future__ import annotations

import re
from abc import abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.model_executor.quantization.base import QuantizationConfig
from pagedserve.model_executor.quantization.int4 import Int4Weights
from pagedserve.model_executor.quantization.unquantized import UnquantizedConfig

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.linear import Linear

class CheckpointQuantizationConfig(QuantizationConfig):
    """A pre-quantized checkpoint's format, read from config.json's quantization_config; the layers the checkpoint
    left in float run `float_config`'s method (`--linear-backend`)."""

    def __init__(self, linear_backend: str = "auto", device: torch.device | None = None,
                 checkpoint_config: dict | None = None) -> None:
        if device is not None and device.type != "cpu":
            raise ValueError(f"quantization={self.name!r} is implemented for the CPU only.")
        self.float_config = UnquantizedConfig(linear_backend, device)
        self.read_checkpoint_config(checkpoint_config or {})

    @abstractmethod
    def read_checkpoint_config(self, cfg: dict) -> None:
        """The format's settings from quantization_config; ValueError for what it cannot run."""

    def leaves_float(self, prefix: str, skipped: list[str]) -> bool:
        """Whether layer `prefix` is float in the checkpoint: the LM head, and the layers whose checkpoint names
        contain one of `skipped` (vLLM's rule for AWQ's modules_to_not_convert and FP8's ignored_layers)."""
        return prefix == "lm_head" or any(skip in name for name in layer_names(prefix) for skip in skipped)


# the checkpoint's projections a fused layer of ours holds (models/decoder_lm.py loads them shard by shard)
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def add_param(layer: Linear, name: str, shape: tuple[int, ...], dtype: torch.dtype, output_dim: int | None,
              packed_factor: int = 1, shared_by_shards: bool = False) -> None:
    """A checkpoint tensor `name` of `layer` (vLLM's parameter attributes): `output_dim` the dimension of the output
    features (the loader cuts a fused layer's shards along it), `packed_factor` values per element along it, None
    where the tensor has none (then every shard writes the whole tensor: `shared_by_shards` if they must agree)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.output_dim, param.packed_factor, param.shared_by_shards = output_dim, packed_factor, shared_by_shards
    setattr(layer, name, param)


def add_bias_and_int4_state(layer: Linear, out_features: int, bias: bool, group_size: int) -> None:
    """The float bias and the int4 kernel's tensors (int4.py, filled once loaded) of a 4-bit checkpoint's layer."""
    layer.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
    layer.int4_weight = layer.int4_scale_zeros = layer.int4_input_perm = None
    layer.int4_group_size = group_size


def drop_params(layer: Linear, *names: str) -> None:
    """The checkpoint's tensors once repacked for the kernels: kept only as empty placeholders."""
    for name in names:
        setattr(layer, name, nn.Parameter(torch.empty(0), requires_grad=False))


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The 4-bit values (0..15, int32) of int32 words packing 8 each along `dim`; nibble i (bits 4i..4i+3) holds
    value order[i] of its 8 (AWQ interleaves them; GPTQ and compressed-tensors keep them in order)."""
    words = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8]: nibble i of each word
    values = nibbles[..., torch.tensor(order).argsort()]  # [..., words, 8]: value j of each word
    return values.reshape(*words.shape[:-1], -1).movedim(-1, dim)

def layer_names(prefix: str) -> list[str]:
    """The checkpoint's module names (vLLM's, "model.layers.0.self_attn.q_proj") of our layer `prefix`
    ("layers.0.self_attn.qkv_proj"): one per shard of a fused layer."""
    parent, _, leaf = prefix.rpartition(".")
    leaves = FUSED_SHARDS.get(leaf, (leaf,))
    if not parent:  # lm_head
        return list(leaves)
    return [f"model.{parent}.{name}" for name in leaves]


def matches(name: str, patterns: list[str]) -> bool:
    """compressed-tensors' target / ignore rule: "re:" a regular expression, else the module's name or its last
    part (or "Linear", every linear layer)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern in ("Linear", name, name.rsplit(".", 1)[-1]):
            return True
    return False


def check_group_size(method: str, group_size: int, in_features: int) -> int:
    """The group size of a layer (-1: the whole input row), a ValueError where the rows do not split in it."""
    group = in_features if group_size == -1 else group_size
    if group <= 0 or in_features % group or in_features % 8:
        raise ValueError(f"quantization={method!r}: group size {group_size} does not divide the layer's "
                         f"{in_features} input channels.")
    return group



def zero_point_int4_weights(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                            g_idx: torch.Tensor | None = None) -> Int4Weights:
    """w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g] (q, zeros in 0..15 [N, K], [N, G]; g = k // group_size, or
    g_idx[k] for act-order: then the input channels are sorted by group, here and in every product (`input_perm`), as
    vLLM's exllama path does)."""
    perm = None
    if g_idx is not None:
        g_idx = g_idx.long()
        positional = torch.arange(q.shape[1]) // group_size
        if not torch.equal(g_idx, positional):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], positional):
                raise ValueError(f"g_idx must give every group {group_size} input channels.")
            q = q[:, perm]
    scale = scales.float()
    return Int4Weights(q, scale, -zeros * scale, group_size, scales.dtype, perm)
