"""Pooling of a sequence's final hidden states into one vector (vLLM's Pooler): LAST token, MEAN over tokens or the
first (CLS) token, then L2 normalisation and Matryoshka truncation as the model's sentence-transformers config says.

The config comes from the checkpoint directory: `modules.json` lists the modules (a `Normalize` module means the
embeddings are L2-normalised), the Pooling module's folder (usually `1_Pooling/config.json`) names the pooling mode.
Without them, decoder models pool the LAST token and encoder models CLS, both normalised (vLLM's defaults).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling config key -> our pooling type
_MODE_KEYS = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    matryoshka_dimensions: tuple[int, ...] | None = None  # allowed `dimensions`; None: any (if is_matryoshka)
    is_matryoshka: bool = False

    @classmethod
    def from_model_dir(cls, model_dir: Path, default_pooling_type: str) -> "PoolerConfig":
        """The sentence-transformers config where the checkpoint has one, else the default type, normalised."""
        hf = _read_json(model_dir / "config.json")
        dims = hf.get("matryoshka_dimensions")
        matryoshka = bool(hf.get("is_matryoshka") or dims)
        modules = _read_json(model_dir / "modules.json")
        if not isinstance(modules, list):
            return cls(default_pooling_type, True, tuple(dims) if dims else None, matryoshka)
        pooling_type, normalize = default_pooling_type, False
        for module in modules:
            kind = str(module.get("type", ""))
            if kind.endswith("Normalize"):
                normalize = True
            elif kind.endswith("Pooling"):
                pooling = _read_json(model_dir / module.get("path", "1_Pooling") / "config.json")
                modes = [t for key, t in _MODE_KEYS.items() if pooling.get(key)]
                if len(modes) != 1:
                    raise ValueError(f"{model_dir}: unsupported sentence-transformers pooling config {pooling}; "
                                     f"supported: exactly one of {', '.join(_MODE_KEYS)}.")
                pooling_type = modes[0]
        return cls(pooling_type, normalize, tuple(dims) if dims else None, matryoshka)

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """A request's `dimensions` (ValueError naming it): only Matryoshka models, within their listed sizes."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError("dimensions: the model does not support matryoshka representation; "
                             "changing output dimensions is not supported.")
        if dimensions < 1 or dimensions > hidden_size:
            raise ValueError(f"dimensions must be in [1, {hidden_size}], got {dimensions}.")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}.")


def pool(hidden: torch.Tensor, seq_lens: torch.Tensor, config: PoolerConfig) -> torch.Tensor:
    """hidden: [T, H], the sequences' rows one after another (seq_lens [N] long, summing to T) -> [N, H] float32,
    vectorised over sequences (no per-sequence loop)."""
    ends = torch.cumsum(seq_lens, 0)
    starts = ends - seq_lens
    hidden = hidden.float()
    if config.pooling_type == "LAST":
        pooled = hidden[ends - 1]
    elif config.pooling_type == "CLS":
        pooled = hidden[starts]
    else:  # MEAN: a segment sum via index_add over each row's sequence index
        seq_index = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), seq_lens)
        sums = torch.zeros((len(seq_lens), hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
        pooled = sums.index_add_(0, seq_index, hidden) / seq_lens[:, None].to(hidden.dtype)
    return F.normalize(pooled, p=2, dim=-1) if config.normalize else pooled


def truncate_dimensions(embedding: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """Matryoshka: the first `dimensions` components, L2-renormalised (as vLLM and sentence-transformers do)."""
    if dimensions is None:
        return embedding
    return F.normalize(embedding[..., :dimensions], p=2, dim=-1)


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else {}
