"""KV cache groups (vLLM's hybrid KV cache manager): which layers share one block table.

A model whose layers all attend alike (all full attention, or all the same sliding window: Mistral) has one group.
A hybrid model (Gemma 2/3: sliding layers beside full ones; Qwen2's upper layers) has a group per attention kind,
each kind split into groups of the same number of layers: every block of the pool then holds that many layers'
K/V, whichever group it serves, and a sliding group's blocks behind its window go back to the pool while the full
groups keep the whole context (core/kv_cache_manager.py). Group i's layer j stores its K/V in the model's KV
tensor j (model_loader.allocate_kv_cache): a block id belongs to one group at a time, so the groups share tensors.

Plain Python: the scheduler side (window per group) and the model side (tensor per layer) read the same layout.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # global layer indices
    sliding_window: int | None  # None: full attention (the group keeps every block of the context)


def make_kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """The groups of a model whose layer i attends with window layer_windows[i] (None: full attention): full
    attention first (group 0, whose table a draft model and the KV connector read), then each window's. Groups of a
    hybrid model have the size of the smallest kind (the last group of a kind may have fewer layers)."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    return [KVCacheGroup(tuple(layers[i:i + size]), window)
            for window, layers in sorted(kinds.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
            for i in range(0, len(layers), size)]


def layer_cache_slots(groups: Sequence[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    """Global layer index -> (its group, its KV tensor: its position in the group)."""
    return {layer: (g, position) for g, group in enumerate(groups) for position, layer in enumerate(group.layers)}
