"""A GGUF file (llama.cpp's format) opened as a Hugging Face checkpoint directory: its config, tokenizer and chat
template from the file's metadata, and its tensors as safetensors, written once into a cache directory keyed by the
file (path, size, mtime) and reused after. The engine then loads that directory as any other.

transformers reads the metadata and maps GGUF tensor names to its own (undoing llama.cpp's q/k row permutation);
the `gguf` package dequantizes every type it knows (F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants, ...).
The decoder layers' linear weights and the LM head (`output`, or the tied `token_embd`: then untied, the
embedding's float rows kept for lookups) in a type with a native kernel (quantization/gguf.py: Q8_0, Q4_0, Q5_0, Q4_K, Q6_K)
stay in their blocks, as stored: their raw rows (in transformers' row order) are written with their type, and
config.json gets quantization_config {"quant_method": "gguf", "linear_types": {module: type}}. A fused q/k/v or
gate/up layer stays quantized only if all its projections do. An MoE layer's experts (llama.cpp stacks them, one
tensor per projection: `ffn_{gate,up,down}_exps`) are read here, not by transformers: in native types they are
written as stored, [experts, rows, row bytes], and run on the same kernel (layers/fused_moe/experts.py); the experts'
widths, which transformers' GGUF config map does not read, come from the metadata. Everything else is dequantized
to float32.

The linears kept in blocks are never dequantized: transformers is shown each of them as a column of its row
numbers (a float32 [N, 1] tensor), so what it hands back is the row order it would have put the dequantized rows
in. Dequantizing them all, as transformers' own loader does, holds 4 bytes per parameter at once (an 8B model's
32 GB, more than a 24 GB machine has). The file is parsed once for transformers' three loads (config, tokenizer,
tensors): each parse read the whole vocabulary again, most of a conversion's time.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("pagedserve")

_CACHE_ROOT = Path.home() / ".cache" / "pagedserve" / "gguf"
_DONE = "pagedserve_gguf.json"  # written last: a directory without it is an interrupted conversion
_FORMAT = "4"  # of the converted directory (2: quantized linears kept as blocks, 3: Q4_1/Q5_1/Q5_K too, 4: MoE experts
# in blocks); cache key

# llama.cpp's per-layer linear tensors -> the checkpoint's module names (Qwen2-MoE's shared expert: *_shexp); fused
# groups of our layers
_LINEAR_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                 "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
          ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"))
# an MoE layer's experts, stacked [experts, rows, row bytes] in one tensor per projection
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# metadata transformers' GGUF config map leaves out (it keeps Qwen3MoeConfig's default 768, right for 30B-A3B only)
_MOE_SIZES = {"expert_feed_forward_length": "moe_intermediate_size",
              "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


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
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    reader = gguf.GGUFReader(str(path))
    with _parsed_once(reader):
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _set_moe_sizes(reader, config)
    with torch.device("meta"):  # only the parameter names, for transformers' GGUF -> HF name map
        skeleton = AutoModelForCausalLM.from_config(config)
    kept = _block_linears(reader)
    tensors = _load_tensors(path, skeleton, reader, kept)
    quantized = _quantized_linears(reader, kept, tensors)
    if quantized is None:  # a kept linear came back as more than a reordering of its rows: dequantize everything
        tensors = _load_tensors(path, skeleton, reader, {})
        quantized = _quantized_linears(reader, {}, tensors)
    expert_files, expert_types = _experts(reader)
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
    files.update(expert_files)
    save_file(files, str(out / "model.safetensors"))
    if quantized or expert_types:
        cfg = json.loads((out / "config.json").read_text())
        linear_types = {m: t for m, (t, _, _) in quantized.items()} | expert_types
        cfg["quantization_config"] = {"quant_method": "gguf", "linear_types": dict(sorted(linear_types.items()))}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / _DONE).write_text(json.dumps({"gguf_file": str(path)}))


def _set_moe_sizes(reader, config) -> None:
    """The experts' (and Qwen2-MoE's shared expert's) width from the file's metadata into `config`."""
    arch = reader.fields["general.architecture"].contents()
    for key, attr in _MOE_SIZES.items():
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            setattr(config, attr, int(field.contents()))


def _expert_tensor(t) -> tuple[int, str] | None:
    """(layer, projection) of an MoE layer's stacked experts tensor `blk.<i>.ffn_<p>_exps.weight`, else None."""
    parts = t.name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES and parts[3] == "weight":
        return int(parts[1]), _EXPERT_NAMES[parts[2]]
    return None


def _experts(reader) -> tuple[dict, dict]:
    """(safetensors entries, {module: type}) of the MoE layers' experts, read here rather than by transformers:
    a layer whose three projections are all in native types keeps them as stored ([experts, rows, row bytes] uint8
    as `model.layers.<i>.mlp.experts.<proj>.qweight`, their types in linear_types); another is dequantized to the
    hub's per-expert float32 weights. Each expert's rows are in the checkpoint's order (llama.cpp permutes none)."""
    import gguf
    import numpy as np
    import torch

    from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES, row_bytes

    layers: dict[int, dict] = {}
    for t in reader.tensors:
        found = _expert_tensor(t)
        if found is not None:
            layers.setdefault(found[0], {})[found[1]] = t
    files, types = {}, {}
    for i, projections in sorted(layers.items()):
        prefix = f"model.layers.{i}.mlp.experts"
        native = len(projections) == len(_EXPERT_NAMES) and all(
            t.tensor_type.name in NATIVE_TYPES and len(t.shape) == 3
            and t.data.shape == (int(t.shape[2]), int(t.shape[1]), row_bytes(t.tensor_type.name, int(t.shape[0])))
            for t in projections.values())
        for proj, t in projections.items():
            if native:
                files[f"{prefix}.{proj}.qweight"] = torch.from_numpy(np.array(t.data))
                types[f"{prefix}.{proj}"] = t.tensor_type.name
                continue
            rows = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)))
            for e in range(rows.shape[0]):
                files[f"{prefix}.{e}.{proj}.weight"] = rows[e].float().contiguous()
    return files, types


def _block_module(t, names: set) -> str | None:
    """The checkpoint module of GGUF tensor t if it can stay in its blocks: a decoder layer's linear weight or the LM
    head (`output`, or `token_embd` where there is no `output`), 2-D, in a type with a native kernel; else None."""
    from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES, row_bytes

    parts = t.name.split(".")  # blk.<i>.<name>.weight
    if t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in names):
        module = "lm_head"
    elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR_NAMES and parts[3] == "weight":
        module = f"model.layers.{parts[1]}.{_LINEAR_NAMES[parts[2]]}"
    else:
        return None
    type_name = t.tensor_type.name
    if type_name not in NATIVE_TYPES or len(t.shape) != 2:
        return None
    return module if t.data.shape == (int(t.shape[1]), row_bytes(type_name, int(t.shape[0]))) else None


def _block_linears(reader) -> dict:
    """{GGUF tensor name: module} of the tensors that stay in their blocks, but the tied head's `token_embd`, whose
    float rows the embedding needs anyway: transformers is shown these as their row numbers."""
    names = {t.name for t in reader.tensors}
    modules = {t.name: _block_module(t, names) for t in reader.tensors if t.name != "token_embd.weight"}
    return {name: module for name, module in modules.items() if module is not None}


@contextmanager
def _parsed_once(reader):
    """transformers' GGUF loads (config, tokenizer, tensors) handed `reader` instead of parsing the file again each:
    its metadata, every vocabulary string read through numpy, took ~9 s a parse for Qwen3's 151,936 tokens. And the
    GGUF -> HF name map built once per architecture and layer count (transformers asks for it once per module:
    ~6 s of rebuilding it for Qwen3-0.6B's 427)."""
    import functools

    import gguf

    # transformers imports both from the package when it loads
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = lambda *args, **kwargs: reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _load_tensors(path: Path, skeleton, reader, kept: dict) -> dict:
    """transformers' tensors of the file (its names, its processing), with each tensor named in `kept` read as the
    column of its row numbers instead of its dequantized rows."""
    import gguf
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    numbered = copy.copy(reader)
    f32 = gguf.GGMLQuantizationType.F32
    numbered.tensors = [t._replace(tensor_type=f32, data=np.arange(t.data.shape[0], dtype=np.float32)[:, None])
                        if t.name in kept else t for t in reader.tensors
                        if _expert_tensor(t) is None]  # the experts are read by _experts
    with _parsed_once(numbered):
        return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def _quantized_linears(reader, kept: dict, tensors: dict) -> dict | None:
    """{module: (type name, qweight [N, row bytes] uint8, qtype [N] uint8)} of the decoder layers' linear weights
    kept quantized, their raw rows in the order of transformers' `tensors`: for those in `kept` the row numbers it
    returned (None if one is not a reordering of its rows); a tied head's from matching its dequantized rows against
    the embedding's (and every linear's when `kept` is empty). A kept shard of a fused layer that cannot stay
    quantized whole is dequantized into `tensors`."""
    import gguf
    import numpy as np
    import torch

    from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES

    found, orders = {}, {}
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:
        module = _block_module(t, names)
        if module is None:
            continue
        type_name, n = t.tensor_type.name, int(t.shape[1])
        raw = np.asarray(t.data)
        if t.name in kept:
            column = tensors.get(f"{module}.weight")
            order = column.reshape(-1).long() if column is not None and column.shape == (n, 1) else None
            if order is None or not torch.equal(order.sort().values, torch.arange(n)):
                return None
        else:  # dequantized by transformers (the tied head; every linear after a fallback): its rows matched
            target = (tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight")) if module == "lm_head"
                      else tensors.get(f"{module}.weight"))
            if target is None or target.dim() != 2:
                continue
            rows = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, t.tensor_type))).float()
            order = _row_order(rows, target.float())
            if order is None:
                logger.warning("GGUF tensor %s: rows not matched to %s; dequantized.", t.name, module)
                continue
        orders[module] = (t, order)
        qweight = torch.from_numpy(raw.copy())[order]
        qtype = torch.full((n,), NATIVE_TYPES[type_name][0], dtype=torch.uint8)
        found[module] = (type_name, qweight, qtype)
    for group in _FUSED:  # a fused layer is quantized only whole; its shards' rows padded to one width
        for parent in {m[:-len(name)] for m in found for name in group if m.endswith(f".{name}")}:
            members = [parent + name for name in group]
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
    for module, (t, order) in orders.items():  # a kept linear left out above: its float rows in place of the numbers
        if module not in found and t.name in kept:
            rows = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            tensors[f"{module}.weight"] = torch.from_numpy(np.ascontiguousarray(rows)).float()[order]
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
