"""KV blocks in and out of the pool's cache tensors, as the KV connector's payloads.

A block's payload: every layer's K and V of that block, the bytes of (layers, 2, block, heads, dim) in the cache
dtype. The draft model's cache is not part of it: a loaded block only costs the drafter acceptance."""
from __future__ import annotations

from collections.abc import Sequence

import torch

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V, each (blocks, block, heads, dim)


@torch.inference_mode()
def read_kv_blocks(kv_caches: KVCaches, block_ids: list[int]) -> list[bytes]:
    ids = torch.tensor(block_ids, device=kv_caches[0][0].device)
    blocks = torch.stack([torch.stack([k.index_select(0, ids), v.index_select(0, ids)], dim=1)
                          for k, v in kv_caches], dim=1)  # (n, layers, 2, block, heads, dim)
    raw = blocks.contiguous().view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()
    return [row.tobytes() for row in raw]


@torch.inference_mode()
def write_kv_blocks(kv_caches: KVCaches, block_ids: list[int], payloads: list[bytes]) -> None:
    k0 = kv_caches[0][0]
    raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    blocks = raw.view(k0.dtype).view(len(block_ids), len(kv_caches), 2, *k0.shape[1:]).to(k0.device)
    ids = torch.tensor(block_ids, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, ids, blocks[:, layer, 0])
        v.index_copy_(0, ids, blocks[:, layer, 1])
