"""Pooling of a sequence's final hidden states into one vector (vLLM's Pooler): LAST token, MEAN over tokens or the
first (CLS) token, then L2 normalisation and Matryoshka truncation as the model's sentence-transformers config says
(embedding models), or a classification head's logits and their activation (sequence classification models).

The config comes from the checkpoint directory: `modules.json` lists the modules (a `Normalize` module means the
embeddings are L2-normalised), the Pooling module's folder (usually `1_Pooling/config.json`) names the pooling mode.
Without them, decoder models pool the LAST token and encoder models CLS, both normalised (vLLM's defaults).
`resolve_pooler_config` decides, from --runner / --task and the architecture, whether the engine pools at all.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.model_executor.models.registry import is_encoder_only

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling config key -> our pooling type
_MODE_KEYS = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


RUNNERS = ("auto", "generate", "pooling")
TASKS = ("auto", "generate", "embed", "classify", "score")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    matryoshka_dimensions: tuple[int, ...] | None = None  # allowed `dimensions`; None: any (if is_matryoshka)
    is_matryoshka: bool = False
    task: str = "embed"  # what the model computes: embed (an embedding model) | classify (a classification head)
    num_labels: int = 0  # classify: the head's outputs

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """Request tasks this model serves: an embedding model scores by cosine similarity, a classifier only
        with a single label (a cross-encoder's relevance logit)."""
        if self.task == "embed":
            return ("embed", "score")
        return ("classify", "score") if self.num_labels == 1 else ("classify",)

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


def resolve_pooler_config(model_dir: Path, architecture: str, runner: str, task: str,
                          hf_overrides: dict | None = None) -> PoolerConfig | None:
    """vLLM's runner selection: None for a generative engine, else what the pooling engine computes. `auto` pools
    for architectures that are pooling models (*ForSequenceClassification: classify; *Model: embed); a causal LM
    pools (embed: last token, as Qwen3-Embedding) when asked with runner pooling or a pooling task."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}.")
    native = "classify" if architecture.endswith("ForSequenceClassification") else \
        "embed" if architecture.endswith("Model") else None
    if runner == "generate" or task == "generate":
        if native is not None or task not in ("auto", "generate") or runner == "pooling":
            raise ValueError(f"runner {runner!r} with task {task!r} cannot serve {architecture}: "
                             f"{'it is a pooling model' if native else 'generation and pooling exclude each other'}.")
        return None
    if runner == "auto" and task == "auto" and native is None:
        return None
    model_task = native or "embed"  # a causal LM as an embedder
    default_pooling = "CLS" if is_encoder_only(architecture) else "LAST"  # (a cross-encoder reads its CLS token)
    if task in ("embed", "classify") and task != model_task:
        raise ValueError(f"task {task!r} is not supported by {architecture}: it serves {model_task!r}"
                         f"{' (a classifier needs a *ForSequenceClassification checkpoint)' if task == 'classify' else ''}.")
    if model_task == "classify":
        config = PoolerConfig(default_pooling, False, task="classify", num_labels=num_labels(model_dir, hf_overrides))
    else:
        config = PoolerConfig.from_model_dir(model_dir, default_pooling)
    if task == "score" and "score" not in config.supported_tasks:
        raise ValueError(f"task 'score' needs a classifier with one label; {architecture} has {config.num_labels}.")
    return config


def num_labels(model_dir: Path, hf_overrides: dict | None = None) -> int:
    """A classification head's outputs, as transformers' PretrainedConfig counts them (id2label, else num_labels);
    a head made from LM head rows (classifier_from_token, models/adapters.py) has one per token, or one for a
    two-way softmax (a Qwen3-Reranker's P(yes))."""
    from_tokens = classifier_from_token(model_dir, hf_overrides)
    if from_tokens is not None:
        tokens, two_way = from_tokens
        return 1 if two_way else len(tokens)
    cfg = _read_json(model_dir / "config.json") | (hf_overrides or {})
    return len(cfg["id2label"]) if cfg.get("id2label") else int(cfg.get("num_labels", 2))


def classifier_from_token(model_dir: Path, hf_overrides: dict | None = None) -> tuple[list[str], bool] | None:
    """vLLM's `classifier_from_token` (config.json or --hf-overrides): the tokens whose LM head rows make a causal
    LM's classification head, and whether it is a two-way softmax (`is_original_qwen3_reranker`, or method
    `from_2_way_softmax`: softmax over the logits of [no, yes], whose yes probability is sigmoid(logit_yes -
    logit_no): one label). None for a checkpoint with its own head."""
    cfg = _read_json(model_dir / "config.json") | (hf_overrides or {})
    tokens = cfg.get("classifier_from_token")
    if not tokens:
        return None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}.")
    two_way = bool(cfg.get("is_original_qwen3_reranker")) or cfg.get("method") == "from_2_way_softmax"
    if two_way and len(tokens) != 2:
        raise ValueError(f"a two-way softmax head (is_original_qwen3_reranker) needs two tokens [no, yes], "
                         f"got {tokens!r}.")
    return list(tokens), two_way


def reduce_spans(hidden: torch.Tensor, span_lens: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden: [T, H], spans' rows one after another (span_lens [N] long, summing to T) -> [N, H] float32: each
    span's last row (LAST), first row (CLS) or row sum (MEAN), vectorised over spans (no per-span loop)."""
    ends = torch.cumsum(span_lens, 0)
    hidden = hidden.float()
    if pooling_type == "LAST":
        return hidden[ends - 1]
    if pooling_type == "CLS":
        return hidden[ends - span_lens]
    # MEAN: a segment sum via index_add over each row's span index
    span_index = torch.repeat_interleave(torch.arange(len(span_lens), device=hidden.device), span_lens)
    sums = torch.zeros((len(span_lens), hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    return sums.index_add_(0, span_index, hidden)


def truncate_dimensions(embedding: torch.Tensor, dimensions: int | None, normalize: bool = True) -> torch.Tensor:
    """Matryoshka: the first `dimensions` components, L2-renormalised (as vLLM does) unless normalize is False."""
    if dimensions is None:
        return embedding
    embedding = embedding[..., :dimensions]
    return F.normalize(embedding, p=2, dim=-1) if normalize else embedding


def classification_activation(logits: torch.Tensor) -> torch.Tensor:
    """[N, num_labels] -> probabilities: sigmoid for a single label (a cross-encoder's relevance), else softmax."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else {}
