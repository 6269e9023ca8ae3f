"""A GGUF file (llama.cpp's format) opened as a Hugging Face checkpoint directory: its config, tokenizer and chat
template from the file's metadata, and its tensors dequantized to float32 safetensors, written once into a cache
directory keyed by the file (path, size, mtime) and reused after. The engine then loads that directory as any other.

transformers reads the metadata and maps GGUF tensor names to its own (undoing llama.cpp's q/k row permutation);
the `gguf` package dequantizes every type it knows (F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants, ...).
Weights are dequantized at load: the quantized blocks are not kept as stored (no native 4-bit kernels yet), so a GGUF
model serves at the speed and memory of its float weights (or of `--quantization int8` on top).
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
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:24]
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
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:  # llama.cpp omits `output` when the head is the embedding
        config.tie_word_embeddings = True
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / _DONE).write_text(json.dumps({"gguf_file": str(path)}))
