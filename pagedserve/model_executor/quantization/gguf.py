"""GGUF block-quantized linear weights kept as stored (quant_method "gguf", which the GGUF loader writes into the
converted checkpoint's config.json: gguf_loader.py): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K rows stay in
their blocks and run on the native kernel (kernels/quant_gemm.cpp), which decodes the 4/5/6/8-bit values in registers
and multiplies them against activations quantized to int8 per block of 32 - about half (4-bit types) or as many
(Q8_0) bytes per decode step as the int8 path streams, an eighth / a quarter of float32's. The blocks are repacked
once at load into the kernel's tiles (same bits, reordered); the native whole-stack decode (layers/fused_decode.py)
runs these layers too, the whole decode step in one native call. Other GGUF types are dequantized at conversion and
run as float layers.

Tensors per linear (N outputs, K inputs), as the loader writes them:
  qweight [N, row bytes] uint8 - each output row's GGUF blocks as stored (a fused q/k/v or gate/up layer's shards
                                 may differ in type, e.g. Q4_K_M's Q6_K v_proj: rows padded to the widest);
  qtype   [N] uint8            - each row's ggml type id; runs of one type become the kernel's parts along N.
Without the native kernels (PAGEDSERVE_CPU_KERNELS=0, float16, another device) the rows are dequantized at load
(the `gguf` package) and multiplied in float.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.quantization.base import LinearMethodBase, NativeLinearTensors
from pagedserve.model_executor.quantization.int4 import Int4Weights
from pagedserve.model_executor.quantization.packed import (
    FUSED_SHARDS,
    CheckpointQuantizationConfig,
    add_param,
    drop_params,
)

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.linear import Linear

# The types kept quantized: name -> (ggml type id, weights per block, bytes per block)
NATIVE_TYPES: dict[str, tuple[int, int, int]] = {
    "Q8_0": (8, 32, 34), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
_NAME_OF_ID = {type_id: name for name, (type_id, _, _) in NATIVE_TYPES.items()}


def row_bytes(type_name: str, in_features: int) -> int:
    _, block, size = NATIVE_TYPES[type_name]
    if in_features % block:
        raise ValueError(f"quantization='gguf': {type_name} rows of {in_features} inputs (not a multiple of {block}).")
    return in_features // block * size


def type_runs(qtype: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first row, rows, ggml type id) of each run of one type along the output rows."""
    ids = qtype.tolist()
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            runs.append((start, i - start, int(ids[start])))
            start = i
    return runs


def dequantize_rows(raw: torch.Tensor, type_id: int, in_features: int) -> torch.Tensor:
    """Float32 [rows, in_features] of GGUF rows (the `gguf` package's reference dequantization)."""
    import gguf
    import numpy as np

    name = _NAME_OF_ID[type_id]
    raw = raw[:, :row_bytes(name, in_features)].contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])))


class GGUFLinearMethod(LinearMethodBase):
    def __init__(self, shard_types: tuple[str, ...]) -> None:
        self.shard_types = shard_types  # of the layer's checkpoint projections (q/k/v, gate/up, or one)

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        width = max(row_bytes(t, in_features) for t in self.shard_types)
        add_param(layer, "qweight", (out_features, width), torch.uint8, output_dim=0)
        add_param(layer, "qtype", (out_features,), torch.uint8, output_dim=0)
        layer.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        layer.gguf_parts = layer.weight = None
        # converted with the model (model.to(dtype)) as the uint8 blocks are not: the dtype the layer computes in
        layer.register_buffer("gguf_dtype", torch.empty(0), persistent=False)

    def process_weights_after_loading(self, layer: Linear) -> None:
        dtype = layer.gguf_dtype.dtype
        ops = cpu_kernels() if dtype in (torch.float32, torch.bfloat16) else None
        runs = type_runs(layer.qtype.data)
        raw = layer.qweight.data
        if ops is not None and all(ops.native_gguf_type(t) for _, _, t in runs):
            # the kernel's two tensors: every run's repacked blocks one after another, and the runs' (type, width)
            layer.gguf_parts = (torch.cat([ops.gguf_repack(raw[a:a + n], t, n, layer.in_features) for a, n, t in runs]),
                                torch.tensor([[t, n] for _, n, t in runs], dtype=torch.int64))
        else:
            w = torch.cat([dequantize_rows(raw[a:a + n], t, layer.in_features) for a, n, t in runs])
            layer.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        drop_params(layer, "qweight", "qtype")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.gguf_parts is None or x.dtype not in (torch.float32, torch.bfloat16):
            if layer.weight is None:  # float16 activations on repacked blocks: not a path the engine takes
                raise ValueError("quantization='gguf' runs float32 or bfloat16 activations.")
            return F.linear(x, layer.weight.to(x.dtype), layer.bias)
        rows = x.reshape(-1, x.shape[-1])
        y = cpu_kernels().gguf_gemm(rows, *layer.gguf_parts, layer.bias)
        return y.view(*x.shape[:-1], layer.out_features)

    def native_decode_tensors(self, layer: Linear) -> NativeLinearTensors | None:
        if layer.gguf_parts is None:
            return None
        packed, layout = layer.gguf_parts
        return NativeLinearTensors(packed, layer.bias, None, None, sys.maxsize, gguf_layout=layout)


def int4_gguf_rows(weights: Int4Weights) -> tuple[torch.Tensor, str] | None:
    """GGUF rows [N, row bytes] uint8 of 4-bit weights (an int4 checkpoint's, quantization/int4.py), read by the same
    kernel: Q4_0 (w = (q - 8) d) where every lo is -8 scale (symmetric: exact, the scales float16 as GPTQ stores
    them), else Q4_1 (w = q d + m, m = lo rounded to float16). None where blocks of 32 cannot hold them: groups not
    a whole number of blocks, or act-order's input order."""
    if weights.input_perm is not None or weights.group_size % 32:
        return None
    n, k = weights.q.shape
    scale = weights.scale.float()
    per_block = weights.group_size // 32
    nibbles = weights.q.to(torch.uint8).reshape(n, k // 32, 32)
    parts = [scale.repeat_interleave(per_block, 1).to(torch.float16).view(torch.uint8).reshape(n, -1, 2)]  # d
    symmetric = torch.equal(weights.lo.float(), -8 * scale)
    if not symmetric:
        parts.append(weights.lo.float().repeat_interleave(per_block, 1).to(torch.float16).view(torch.uint8)
                     .reshape(n, -1, 2))  # m
    parts.append(nibbles[..., :16] | (nibbles[..., 16:] << 4))  # byte j: value j (low nibble), j + 16 (high)
    return torch.cat(parts, dim=-1).reshape(n, -1), "Q4_0" if symmetric else "Q4_1"


def q4_0_as_q4_1(rows: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows rewritten as Q4_1, exactly (m = -8 d): one type for a stack whose experts mix the two."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 18)
    m = (blocks[..., :2].contiguous().view(torch.float16) * -8).view(torch.uint8)
    return torch.cat([blocks[..., :2], m, blocks[..., 2:]], dim=-1).reshape(n, -1)


class GGUFExpertsMethod:
    """An MoE layer's experts kept in their GGUF blocks (layers/fused_moe/experts.py: FusedMoE): the file's stacked
    gate, up and down tensors [experts, rows, row bytes] as stored, each projection in one type; once loaded,
    repacked per expert for the native experts call (gate|up as two parts of one product), or dequantized to the
    float weights where it does not run."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, types: tuple[str, str, str]) -> None:
        self.types = dict(zip(self.PROJECTIONS, types))

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int) -> None:
        for proj, type_name in self.types.items():
            k = intermediate if proj == "down_proj" else hidden
            n = hidden if proj == "down_proj" else intermediate
            blocks = torch.empty(num_experts, n, row_bytes(type_name, k), dtype=torch.uint8)
            setattr(layer, f"{proj}_qweight", nn.Parameter(blocks, requires_grad=False))
        layer.register_buffer("gguf_dtype", torch.empty(0), persistent=False)  # the dtype the experts compute in

    def native_parts(self, layer: nn.Module) -> list[list[tuple[torch.Tensor, int]]] | None:
        """[(blocks [experts, rows, row bytes], ggml type id), ...] of the gate|up product and of the down product,
        or None where the native kernels do not run these types in the layer's dtype."""
        ops = cpu_kernels() if layer.gguf_dtype.dtype in (torch.float32, torch.bfloat16) else None
        ids = {proj: NATIVE_TYPES[t][0] for proj, t in self.types.items()}
        if ops is None or not all(ops.native_gguf_type(t) for t in ids.values()):
            return None
        return [[(getattr(layer, f"{p}_qweight").data, ids[p]) for p in ("gate_proj", "up_proj")],
                [(layer.down_proj_qweight.data, ids["down_proj"])]]

    def dequantized(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The float w13 [experts, 2I, H] and w2 [experts, H, I] of the blocks, in the layer's dtype."""
        def rows(proj: str, in_features: int) -> torch.Tensor:
            blocks = getattr(layer, f"{proj}_qweight").data
            flat = dequantize_rows(blocks.reshape(-1, blocks.shape[-1]), NATIVE_TYPES[self.types[proj]][0], in_features)
            return flat.view(*blocks.shape[:2], in_features).to(layer.gguf_dtype.dtype)

        hidden, intermediate = layer.down_proj_qweight.shape[1], layer.gate_proj_qweight.shape[1]
        return torch.cat([rows("gate_proj", hidden), rows("up_proj", hidden)], dim=1), rows("down_proj", intermediate)


class GGUFConfig(CheckpointQuantizationConfig):
    name = "gguf"

    def read_checkpoint_config(self, cfg: dict) -> None:
        # the checkpoint module names ("model.layers.0.self_attn.q_proj") whose weights stay quantized -> GGUF type
        self.linear_types: dict[str, str] = dict(cfg.get("linear_types", {}))
        unknown = sorted(set(self.linear_types.values()) - set(NATIVE_TYPES))
        if unknown:
            raise ValueError(f"quantization='gguf': no kernel for tensor types {unknown}; supported: "
                             f"{', '.join(NATIVE_TYPES)}.")

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase | GGUFExpertsMethod:
        parent, _, leaf = prefix.rpartition(".")  # "layers.0.self_attn.qkv_proj" -> model.layers.0.self_attn.q_proj ...
        if leaf == "experts":  # an MoE layer's experts ("layers.1.mlp.experts"): in blocks if the file kept them
            types = tuple(self.linear_types.get(f"model.{prefix}.{p}") for p in GGUFExpertsMethod.PROJECTIONS)
            return self.float_config.method if None in types else GGUFExpertsMethod(types)
        module = f"model.{parent}." if parent else ""  # the LM head: "lm_head"
        types = [self.linear_types.get(module + name) for name in FUSED_SHARDS.get(leaf, (leaf,))]
        if None in types:
            return self.float_config.method
        return GGUFLinearMethod(tuple(types))
