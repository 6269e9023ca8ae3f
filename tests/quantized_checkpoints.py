"""Pre-quantized checkpoints made here from a tiny random model of tests/tiny_models.py, each beside its reference: the
same model with the quantized weights dequantized back to float32, which transformers runs.

    ckpt, ref = make_quantized_checkpoint("llama", "gptq", out_dir, group_size=64, symmetric=False, desc_act=True)
    ckpt, ref = quantize_checkpoint(float_dir, "awq", out_dir, group_size=128)  # any one-file float checkpoint

Formats, each packed here in its documented layout (independently of pagedserve's loader):
  gptq  AutoGPTQ: qweight [K/8, N] int32, 8 values a word along the input dimension (value i in bits 4i..4i+3);
        qzeros [G, N/8] int32 along the output dimension, storing zero - 1 ("checkpoint_format": "gptq", v1) or the
        zero ("gptq_v2"); scales [G, N] float16; g_idx [K] int32, the group of each input channel (desc_act: a random
        order of the inputs, one per layer input as GPTQ's Hessian gives q/k/v and gate/up the same one).
  awq   AutoAWQ GEMM: qweight [K, N/8] int32 along the output dimension with nibble i holding output 8j + ORDER[i]
        (ORDER = 0, 2, 4, 6, 1, 3, 5, 7); qzeros [G, N/8] likewise; scales [G, N] float16.
  ct-w4a16 / ct-w8a8 / ct-fp8  compressed-tensors, written by the `compressed-tensors` package's own compressors
        (pack-quantized int4 per group; int8 per channel with dynamic per-token int8 activations; FP8 e4m3 weights
        per channel or per tensor); the reference is the package's decompression. The package no longer writes the
        older act-order "group" (desc_act=True here), so that one is packed here in its layout: weight_packed [N, K/8]
        int32 along the inputs (value i in bits 4i..4i+3, the signed value + 8), weight_scale [N, G],
        weight_zero_point [N/8, G] int32 along the outputs (+ 8), weight_shape, weight_g_idx [K].
  fp8   vLLM's / transformers' fp8: weight float8_e4m3fn with weight_scale_inv [N/bn, K/bk] per block (w = q * s),
        or one weight_scale per tensor and a static input_scale.
Quantization is round-to-nearest per group (min/max, or max|w| when symmetric); LM heads stay float as those tools
leave them.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FORMATS = ("gptq", "awq", "ct-w4a16", "ct-w8a8", "ct-fp8", "fp8")
_ATTN_IN, _MLP_IN = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def rtn_int4(w: torch.Tensor, g_idx: torch.Tensor, symmetric: bool):
    """(q [N, K], zeros [N, G], scales [N, G] float16) with w ~= (q - zeros[:, g_idx]) * scales[:, g_idx], q and zeros
    integers in 0..15 (symmetric: zero 8, scale max|w| / 7.5 per group)."""
    groups = int(g_idx.max()) + 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if symmetric:
            scales[:, g] = torch.maximum(-lo, hi) / 7.5
            zeros[:, g] = 8
        else:
            scales[:, g] = (hi - lo) / 15
            zeros[:, g] = (-lo / scales[:, g]).round().clamp(0, 15)
    scales = scales.clamp(min=1e-6).half()
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    q = (w / s + z).round().clamp(0, 15)
    return q.long(), zeros.long(), scales


def dequantize_int4(q, zeros, scales, g_idx) -> torch.Tensor:
    return (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


def pack_words(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """values [..., 8m] in 0..15 -> int32 words [..., m]: bits 4i..4i+3 of word j hold values[..., 8j + order[i]]."""
    v = (values.astype(np.uint32) & 0xF).reshape(*values.shape[:-1], -1, 8)
    out = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i, src in enumerate(order):
        out |= v[..., src] << np.uint32(4 * i)
    return out.view(np.int32)


def pack_gptq(q, zeros, scales, g_idx, v2: bool = False) -> dict[str, torch.Tensor]:
    stored_zeros = zeros if v2 else zeros - 1  # v1 stores zero - 1 (a zero of 0 wraps to 15, as AutoGPTQ's does)
    return {"qweight": torch.from_numpy(pack_words(q.numpy()).T.copy()),  # along K: pack q [N, K] rows, transpose
            "qzeros": torch.from_numpy(pack_words(stored_zeros.t().numpy())),
            "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def pack_awq(q, zeros, scales) -> dict[str, torch.Tensor]:
    return {"qweight": torch.from_numpy(pack_words(q.t().numpy(), AWQ_ORDER)),
            "qzeros": torch.from_numpy(pack_words(zeros.t().numpy(), AWQ_ORDER)),
            "scales": scales.t().contiguous()}


def pack_ct_w4a16(q, zeros, scales, g_idx, symmetric: bool) -> dict[str, torch.Tensor]:
    packed = {"weight_packed": torch.from_numpy(pack_words(q.numpy())), "weight_scale": scales,
              "weight_shape": torch.tensor(q.shape), "weight_g_idx": g_idx.to(torch.int32)}
    if not symmetric:
        packed["weight_zero_point"] = torch.from_numpy(pack_words(zeros.t().numpy()).T.copy())
    return packed


def pack_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """vLLM's fp8 tensors of w (scales from max|w| / 448, e4m3's largest) and their dequantization."""
    if block is None:
        scale = w.abs().amax() / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(0.05)}, q.float() * scale
    (bn, bk), (n, k) = block, w.shape
    scale = w.reshape(n // bn, bn, k // bk, bk).abs().amax((1, 3)) / 448
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def _ct_scheme(fmt: str, group_size: int, symmetric: bool, per_tensor: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if fmt == "ct-w4a16":
        strategy = "channel" if group_size == -1 else "group"
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                                   group_size=None if group_size == -1 else group_size)
        return QuantizationScheme(targets=["Linear"], weights=weights), "pack-quantized"
    if fmt == "ct-w8a8":
        return QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                         strategy="tensor" if per_tensor else "channel"),
            input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                                               dynamic=True)), "int-quantized"
    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor" if per_tensor else "channel")
    return QuantizationScheme(targets=["Linear"], weights=weights), "float-quantized"


def _ct_compress(w: torch.Tensor, scheme, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The package's compressed tensors of w and its decompression (the reference weight)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = scheme.weights
    if args.strategy == "group":
        view = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = view.amin(-1), view.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero_point = calculate_qparams(lo, hi, args)
    compressor = BaseCompressor.load_from_registry(fmt)
    packed = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    packed = {k: v for k, v in packed.items() if v is not None}
    reference = compressor.decompress(dict(packed), scheme)["weight"].float()
    return packed, reference


def make_quantized_checkpoint(arch: str, fmt: str, out_dir, *, seed: int = 0, **kwargs) -> tuple[Path, Path]:
    """(checkpoint, reference) directories of a tiny `arch` model with every decoder linear in `fmt`; kwargs: the
    format's settings (quantize_checkpoint) and the model config's overrides."""
    settings = {k: kwargs.pop(k) for k in ("group_size", "symmetric", "desc_act", "gptq_v2", "per_tensor", "fp8_block",
                                           "float_modules")
                if k in kwargs}
    out_dir = Path(out_dir)
    return quantize_checkpoint(make_tiny_checkpoint(arch, out_dir / "float", **kwargs), fmt, out_dir, seed=seed,
                               **settings)


def quantize_checkpoint(float_dir: Path, fmt: str, out_dir, *, group_size: int = 32, symmetric: bool = False,
                        desc_act: bool = False, gptq_v2: bool = False, per_tensor: bool = False,
                        fp8_block: tuple[int, int] | None = None, float_modules: tuple[str, ...] = (),
                        seed: int = 0) -> tuple[Path, Path]:
    """(checkpoint, reference) directories under `out_dir` of the float checkpoint `float_dir` (one safetensors
    file) with every decoder linear in `fmt` but those whose names contain one of `float_modules` (listed in the
    config as AWQ's modules_to_not_convert, compressed-tensors' ignore regexes, fp8's ignored_layers)."""
    out_dir = Path(out_dir)
    ckpt, ref = out_dir / fmt, out_dir / f"{fmt}-reference"
    for d in (ckpt, ref):
        shutil.copytree(float_dir, d)
    tensors = {k: v.float() for k, v in load_file(str(float_dir / "model.safetensors")).items()}
    packed_tensors, ref_tensors = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    if fmt.startswith("ct-"):
        scheme, ct_format = _ct_scheme(fmt, group_size, symmetric, per_tensor)
    for name, w in tensors.items():
        if not name.startswith("model.layers.") or not name.endswith("proj.weight") or w.ndim != 2 \
                or any(m in name for m in float_modules):
            continue
        prefix, module = name.removesuffix(".weight"), name.split(".")[-2]
        del packed_tensors[name]
        if fmt.startswith("ct-") and not desc_act:
            packed, ref_tensors[name] = _ct_compress(w, scheme, ct_format)
            packed_tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
            continue
        if fmt == "fp8":
            packed, ref_tensors[name] = pack_fp8(w, fp8_block)
            packed_tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
            continue
        in_features = w.shape[1]
        group = in_features if group_size == -1 else group_size
        g_idx = torch.arange(in_features) // group
        if desc_act:  # one random input order per layer input: q/k/v share theirs, gate/up (each expert's) theirs
            key = (prefix.rsplit(".", 1)[0], "in" if module in _ATTN_IN + _MLP_IN else module)
            if key not in orders:
                orders[key] = torch.randperm(in_features, generator=gen)
            g_idx = torch.empty_like(g_idx)
            g_idx[orders[key]] = torch.arange(in_features) // group
        q, zeros, scales = rtn_int4(w, g_idx, symmetric)
        ref_tensors[name] = dequantize_int4(q, zeros, scales, g_idx).contiguous()
        packed = pack_gptq(q, zeros, scales, g_idx, gptq_v2) if fmt == "gptq" else \
            pack_awq(q, zeros, scales) if fmt == "awq" else pack_ct_w4a16(q, zeros, scales, g_idx, symmetric)
        packed_tensors.update({f"{prefix}.{k}": v.contiguous() for k, v in packed.items()})
    save_file(ref_tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed_tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    if fmt == "gptq":
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": symmetric,
                "checkpoint_format": "gptq_v2" if gptq_v2 else "gptq"}
    elif fmt == "fp8":
        qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic" if fp8_block else "static"}
        if fp8_block:
            qcfg["weight_block_size"] = list(fp8_block)
        qcfg["ignored_layers"] = list(float_modules)
    elif fmt == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": list(float_modules)}
    else:
        from compressed_tensors.quantization import QuantizationConfig

        ignore = ["lm_head"] + [f"re:.*{re.escape(m)}.*" for m in float_modules]
        qcfg = QuantizationConfig(config_groups={"group_0": scheme}, format=ct_format, ignore=ignore,
                                  quantization_status="compressed").model_dump(mode="json", exclude_none=True)
        if desc_act:
            qcfg["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    return ckpt, ref


def fake_quantize_activations_per_token(model: torch.nn.Module) -> None:
    """W8A8's activations on a transformers model: the input of every decoder linear rounded to int8 per token
    (symmetric, scale max|x| / 127), as the dynamic per-token scheme quantizes them."""
    def hook(_module, args):
        x = args[0]
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        return ((x / scale).round().clamp(-127, 127) * scale,)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            module.register_forward_pre_hook(hook)
