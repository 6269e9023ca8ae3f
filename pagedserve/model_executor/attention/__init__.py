"""Paged attention: one backend per file (backend.py: the contract; cpu.py, triton.py, torch_sdpa.py), chosen by
selector.py; metadata.py: what a step tells every backend."""
from pagedserve.model_executor.attention.metadata import (
    AttentionMetadata,
    PrefillSpan,
    chunk_causal_mask,
)

__all__ = ["AttentionMetadata", "PrefillSpan", "chunk_causal_mask"]
