"""A GGUF file (llama.cpp's format) opened as a Hugging Face checkpoint directory: its config, tokenizer and chat
template from the file's metadata, and its tensors as safetensors, written once into a cache directory keyed by the
file (path, size, mtime) and reused after. The engine then loads that directory as any other.

transformers reads the metadata and maps GGUF tensor names to its own (undoing llama.cpp's q/k row permutation);
the `gguf` package dequantizes every type it knows (F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants, ...).
The decoder layers' linear weights and the LM head (`output`, or the tied `token_embd`: then untied, the
embedding's float rows kept for lookups) in a type with a native kernel (quantization/gguf.py: Q8_0, Q4_0, Q5_0, Q4_K, Q6_K)
stay in their blocks, as stored: their raw rows (in transformers' row order) are written with their type, and
config.json gets quantization_config {"quant_method": "gguf", "linear_types": {module: type}}. A fused q/k/v or
gate/up layer stays quantized only if all its projections do. Everything else is dequantized to float32.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger("pagedserve")

_CACHE_ROOT = Path.home() / ".cache" / "pagedserve" / "gguf"
_DONE = "pagedserve_gguf.json"  # written last: a directory without it is an interrupted conversion
_FORMAT = "3"  # of the converted directory (2: quantized linears kept as blocks, 3: Q4_1/Q5_1/Q5_K too); cache key

# llama.cpp's per-layer linear tensors -> the checkpoint's module names; fused groups of our layers
_LINEAR_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_checkpoint_dir(path: Path) -> Path:
    """The checkpoint directory of the GGUF file `path`, converted on first use; ValueError for a file transformers
    cannot read (an architecture it has no mapping for, a truncated file)."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_FORMAT}".encode()).hexdigest()[:24]
    out = _CACHE_ROOT / key
    if (out / _DONE).exists():
        return out
    try:
        import gguf  # noqa: F401  (transformers' reader needs it; say so plainly when it is missing)
    except ImportError as exc:
        raise ValueError("Loading a GGUF file needs the `gguf` package: pip install gguf.") from exc
    t0 = time.perf_counter()
    try:
        _convert(path, out)
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        raise ValueError(f"Could not load GGUF file {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    logger.info("Converted GGUF %s to %s in %.1f s", path, out, time.perf_counter() - t0)
    return out


def _convert(path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):  # only the parameter names, for transformers' GGUF -> HF name map
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    quantized = _quantized_linears(path, tensors)
    if "lm_head" in quantized:  # the head multiplies the blocks; the embedding keeps its float rows for lookups
        config.tie_word_embeddings = False
        tensors.pop("lm_head.weight", None)
    elif config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:  # llama.cpp omits `output` when the head is the embedding
        config.tie_word_embeddings = True
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    files = {k: v.float().contiguous() for k, v in tensors.items()}
    for module, (_, qweight, qtype) in quantized.items():
        files.pop(f"{module}.weight", None)
        files[f"{module}.qweight"], files[f"{module}.qtype"] = qweight, qtype
    save_file(files, str(out / "model.safetensors"))
    if quantized:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "gguf",
                                      "linear_types": {m: t for m, (t, _, _) in sorted(quantized.items())}}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / _DONE).write_text(json.dumps({"gguf_file": str(path)}))


def _quantized_linears(path: Path, tensors: dict) -> dict:
    """{module: (type name, qweight [N, row bytes] uint8, qtype [N] uint8)} of the decoder layers' linear weights
    kept quantized. The raw rows are put in the order of transformers' dequantized `tensors` (llama's q/k rows are
    permuted back): found by matching the dequantized rows, and checked equal; a tensor whose rows do not match
    exactly is dequantized instead."""
    import gguf
    import numpy as np
    import torch

    from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES, row_bytes

    found = {}
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.<i>.<name>.weight; output.weight, or token_embd.weight for a tied head
        if t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in names):
            module = "lm_head"
            target = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR_NAMES and parts[3] == "weight":
            module = f"model.layers.{parts[1]}.{_LINEAR_NAMES[parts[2]]}"
            target = tensors.get(f"{module}.weight")
        else:
            continue
        type_name = t.tensor_type.name
        if type_name not in NATIVE_TYPES or target is None or target.dim() != 2:
            continue
        n, k = target.shape
        raw = np.asarray(t.data).reshape(n, -1)
        if raw.shape[1] != row_bytes(type_name, k):
            continue
        rows = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, t.tensor_type))).float()
        order = _row_order(rows, target.float())
        if order is None:
            logger.warning("GGUF tensor %s: rows not matched to %s; dequantized.", t.name, module)
            continue
        qweight = torch.from_numpy(raw.copy())[order]
        qtype = torch.full((n,), NATIVE_TYPES[type_name][0], dtype=torch.uint8)
        found[module] = (type_name, qweight, qtype)
    for group in _FUSED:  # a fused layer is quantized only whole; its shards' rows padded to one width
        for layer in {m.rsplit(".", 2)[0] for m in found if m != "lm_head"}:
            members = [f"{layer}.{name}" for name in group]
            present = [m for m in members if m in found]
            if not present:
                continue
            if len(present) < len(members):
                for m in present:
                    del found[m]
                continue
            width = max(found[m][1].shape[1] for m in members)
            for m in members:
                type_name, qweight, qtype = found[m]
                padded = torch.zeros(qweight.shape[0], width, dtype=torch.uint8)
                padded[:, :qweight.shape[1]] = qweight
                found[m] = (type_name, padded, qtype)
    return found


def _row_order(rows, target):
    """`order` with rows[order] == target exactly (None if there is none): identity, or found by sorting both on a
    random projection of each row."""
    import torch

    if rows.shape != target.shape:
        return None
    if torch.equal(rows, target):
        return torch.arange(rows.shape[0])
    probe = torch.randn(rows.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    src, dst = (rows.double() @ probe).argsort(), (target.double() @ probe).argsort()
    order = torch.empty_like(src)
    order[dst] = src
    return order if torch.equal(rows[order], target) else None
