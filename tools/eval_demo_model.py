"""Held-out evaluation of the packaged demo model (and the data pipeline shared with training).

The demo model in ``pagedserve/demo_model`` is trained by ``tools.train_demo_model`` on
the Python standard library sources of the interpreter that trained it. A deterministic ~3% of
those files (chosen by a hash of their relative path) is held out. This module owns the file
listing, the held-out split, the tokenization and the packing, so training and evaluation compute
the held-out loss in exactly the same way.

Usage::

    python -m tools.eval_demo_model [--model-dir DIR] [--max-tokens N]

or from Python::

    from tools.eval_demo_model import evaluate_held_out_loss
    loss = evaluate_held_out_loss(model_dir, max_tokens=20_000)   # nats/token

The loss is the mean next-token cross-entropy (nats/token) over packed, non-overlapping windows of
``seq_len`` tokens (each window predicts ``seq_len - 1`` tokens); ``max_tokens`` keeps the first
``max_tokens // seq_len`` windows. Weights are loaded as shipped and computed in float32.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

# Data selection rules (shared with training; changing them changes the held-out set).
SKIP_DIR_NAMES = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
MAX_FILE_BYTES = 200_000
HELD_OUT_PERCENT = 3
DEFAULT_SEQ_LEN = 256
TEST_SUBSET_TOKENS = 20_000  # the subset the unit test re-evaluates (see eval.json)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str) -> bool:
    """Deterministic ~HELD_OUT_PERCENT% split by a hash of the posix relative path."""
    h = int(hashlib.sha1(rel_path.encode("utf-8")).hexdigest(), 16)
    return h % 100 < HELD_OUT_PERCENT


def list_stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted posix relative paths of the stdlib *.py files used as data."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIR_NAMES)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            try:
                if full.stat().st_size > MAX_FILE_BYTES or full.is_symlink():
                    continue
            except OSError:
                continue
            out.append(full.relative_to(root).as_posix())
    return sorted(out)


def read_text(root: Path, rel_path: str) -> str | None:
    try:
        text = (root / rel_path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def load_split(root: Path | None = None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Return (train, held_out) lists of (rel_path, text), each in sorted path order."""
    root = Path(root) if root is not None else stdlib_root()
    train, held = [], []
    for rel in list_stdlib_files(root):
        text = read_text(root, rel)
        if text is None:
            continue
        (held if is_held_out(rel) else train).append((rel, text))
    return train, held


def held_out_fingerprint(held: list[tuple[str, str]]) -> str:
    """sha256 over the held-out paths and contents: identifies the exact evaluation data."""
    h = hashlib.sha256()
    for rel, text in held:
        h.update(rel.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


def encode_documents(tokenizer_json: str | Path, texts: list[str], bos_id: int, eos_id: int) -> list[int]:
    """``<|bos|> + text + <|eos|>`` for each document, concatenated in order into one id stream."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    stream: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream.append(bos_id)
        stream.extend(enc.ids)
        stream.append(eos_id)
    return stream


def pack(stream: list[int], seq_len: int):
    """Non-overlapping windows of ``seq_len`` tokens (the tail that does not fill one is dropped)."""
    import torch

    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def mean_loss(model, windows, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy in nats over all predicted tokens of ``windows``."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch_size):
            x = windows[i : i + batch_size]
            logits = model(input_ids=x).logits.float()
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += x[:, 1:].numel()
    return total / max(count, 1)


def held_out_windows(model_dir: str | Path, seq_len: int = DEFAULT_SEQ_LEN, max_tokens: int | None = None,
                     root: Path | None = None):
    """Tokenize + pack the held-out files with the tokenizer in ``model_dir``."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    _, held = load_split(root)
    stream = encode_documents(model_dir / "tokenizer.json", [t for _, t in held], cfg["bos_token_id"],
                              cfg["eos_token_id"])
    windows = pack(stream, seq_len)
    if max_tokens is not None:
        windows = windows[: max(1, max_tokens // seq_len)]
    return windows


def load_model_float32(model_dir: str | Path):
    """Load the shipped weights offline with transformers and upcast to float32 for compute."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    model.eval()
    return model


def evaluate_held_out_loss(model_dir: str | Path, max_tokens: int | None = None, seq_len: int | None = None,
                           model=None) -> float:
    """Held-out loss (nats/token) of the checkpoint in ``model_dir`` on the stdlib held-out files.

    ``max_tokens`` limits evaluation to the first ``max_tokens // seq_len`` windows (what the unit
    test uses); ``seq_len`` defaults to the value recorded in ``eval.json`` (else 256).
    """
    import torch

    model_dir = Path(model_dir)
    if seq_len is None:
        eval_json = model_dir / "eval.json"
        seq_len = json.loads(eval_json.read_text())["seq_len"] if eval_json.exists() else DEFAULT_SEQ_LEN
    windows = held_out_windows(model_dir, seq_len, max_tokens)
    if model is None:
        model = load_model_float32(model_dir)
    prev = torch.get_num_threads()
    torch.set_num_threads(min(prev, 2))
    try:
        return mean_loss(model, windows)
    finally:
        torch.set_num_threads(prev)


def main(argv: list[str] | None = None) -> int:
    from pagedserve.demo_model_path import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=default_model_path())
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"evaluate only the first N held-out tokens (the unit test uses {TEST_SUBSET_TOKENS})")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    loss = evaluate_held_out_loss(args.model_dir, args.max_tokens)
    print(f"held_out_loss: {loss:.4f}")
    ref = Path(args.model_dir) / "eval.json"
    if ref.exists():
        rec = json.loads(ref.read_text())
        key = "held_out_loss" if args.max_tokens is None else "held_out_loss_subset"
        if args.max_tokens is None or rec.get("subset_max_tokens") == args.max_tokens:
            print(f"recorded {key}: {rec[key]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
