"""The LoRA linear layer: the base projection plus every row's adapter delta, batched over the step's rows.

Adapters sit in `max_loras` slots of stacked weights, laid out for the native kernel (kernels/lora.cpp), scaling
folded into B and the rank padded with zeros to R (max_lora_rank rounded up to 16, a vector of float32 lanes):

    lora_a [slots, in, S x R]   per slot the transposed A of each of the S output slices, side by side
    lora_b [slots, R, out']     per slot B transposed, slice s's output columns taking slice s's R ranks, each
                                slice's columns zero-padded to a multiple of 16 (the kernel loads whole vectors)

Where the kernel takes bfloat16 weights in pairs of k (builds with AVX512-BF16: `lora_bf16_pairs`), a bfloat16
model's stacks are stored that way, [slots, in/2, S x R, 2] and [slots, R/2, out', 2].

Fused projections (QKV, gate/up) get one A per slice (q, k, v each have their own) and expand into their output
columns. One step, without a per-adapter loop (Punica's BGMV / S-LoRA's idea; `delta_op` picks the path):
  * on a CPU with the native kernels (float32, bfloat16): one `lora_add` call per projection, by row index: each row
    is multiplied by its own slot's A and B only, rows of a slot grouped into tiles sharing one read of its weights.
    The native whole-stack decode (layers/fused_decode.py) calls the same kernel after its products, so a decode
    step with adapter rows stays in one native call;
  * on CUDA with Triton: the same operation by row index in two Triton kernels (lora/triton_ops.py);
  * elsewhere: every row against every slot's A, a one-hot row -> slot mask keeping its own, one expand per slice
    (max_loras x the shrink's arithmetic; the masked slots contribute nothing).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from pagedserve.model_executor.layers.linear import Linear

RANK_ALIGN = 16  # the slots' rank is padded to a multiple of this: one vector of float32 lanes in the kernel


def padded(n: int) -> int:
    """n rounded up to a multiple of RANK_ALIGN (the slots' rank; lora_b's slice widths)."""
    return -(-n // RANK_ALIGN) * RANK_ALIGN


# lora_add(y, x, lora_a, lora_b, row_slots, slice_sizes): y += each row's delta, in place
DeltaOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]], None]


def delta_op(device: torch.device, dtype: torch.dtype, kernels: ModuleType | None) -> tuple[DeltaOp | None, bool]:
    """The op adding the batched delta on this device, and whether it takes bfloat16 weights in pairs of k: the
    native CPU kernel (float32, bfloat16), Triton's on CUDA, or None (the torch path)."""
    if device.type == "cpu" and kernels is not None and dtype in (torch.float32, torch.bfloat16):
        return kernels.lora_add, dtype == torch.bfloat16 and kernels.lora_bf16_pairs()
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from pagedserve.lora import triton_ops
        return triton_ops.lora_add, False
    return None, False


class LoRAMapping:
    """The step's row -> slot selection, shared by every LoRA layer of the model: row_slots [T] long (a slot or -1),
    and for the torch path its one-hot mask [T, slots, 1] in the model dtype; both None when no row of the step
    has an adapter (the layers then run the base product alone)."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.rank = padded(max_rank)
        self.row_slots: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def set_rows(self, row_slots: torch.Tensor | None, dtype: torch.dtype, with_mask: bool = False) -> None:
        """row_slots: [T] long, each row's slot or -1 (no adapter); None: no row has one. with_mask: build the
        one-hot mask too (the layers run the torch path)."""
        self.row_slots = row_slots
        self.mask = None
        if row_slots is not None and with_mask:
            one_hot = torch.nn.functional.one_hot(row_slots + 1, self.max_loras + 1)[:, 1:]
            self.mask = one_hot.to(dtype).unsqueeze(-1)


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, slice_sizes: list[int], mapping: LoRAMapping, dtype: torch.dtype,
                 device: torch.device, op: DeltaOp | None, pairs: bool = False) -> None:
        """op, pairs: `delta_op`'s (None: the torch path)."""
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.mapping = mapping
        self.slice_sizes = slice_sizes
        self.op = op
        s, r = mapping.max_loras, mapping.rank
        # each slice's first column in lora_b (padded widths), and the end
        self.b_offsets = [sum(padded(size) for size in slice_sizes[:j]) for j in range(len(slice_sizes) + 1)]
        self.pairs = pairs and base.in_features % 2 == 0
        k, pair = (2, (2,)) if self.pairs else (1, ())
        a_shape, b_shape = (base.in_features // k, len(slice_sizes) * r), (r // k, self.b_offsets[-1])
        self.lora_a = torch.zeros(s, *a_shape, *pair, dtype=dtype, device=device)
        self.lora_b = torch.zeros(s, *b_shape, *pair, dtype=dtype, device=device)

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Per output slice the adapter's (A [rank, in], B [out, rank] scaled), or None for a slice it leaves alone."""
        r = self.mapping.rank
        a_t = torch.zeros(self.in_features, len(self.slice_sizes) * r)
        b_t = torch.zeros(r, self.b_offsets[-1])
        for j, (ab, size) in enumerate(zip(weights, self.slice_sizes)):
            if ab is not None:
                a, b = ab
                a_t[:, j * r:j * r + a.shape[0]] = a.t()
                b_t[:b.shape[1], self.b_offsets[j]:self.b_offsets[j] + size] = b.t()
        for stack, matrix in ((self.lora_a, a_t), (self.lora_b, b_t)):
            if self.pairs:  # [k, n] -> [k/2, n, 2]: rows 2i and 2i + 1 side by side
                matrix = matrix.view(matrix.shape[0] // 2, 2, matrix.shape[1]).transpose(1, 2)
            stack[slot].copy_(matrix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        row_slots = self.mapping.row_slots
        if row_slots is None:
            return y
        if self.op is not None:
            self.op(y, x if x.stride(-1) == 1 else x.contiguous(), self.lora_a, self.lora_b, row_slots,
                    self.slice_sizes)
            return y
        # every row against every slot, then its own slot kept: [T, slots, S x R]
        h = torch.einsum("ti,sin->tsn", x, self.lora_a).mul_(self.mapping.mask)
        r, offset = self.mapping.rank, 0
        for j, size in enumerate(self.slice_sizes):  # per output slice of the fused projection (at most 3)
            b = self.lora_b[:, :, self.b_offsets[j]:self.b_offsets[j] + size]
            y[:, offset:offset + size].add_(torch.einsum("tsr,sro->to", h[:, :, j * r:(j + 1) * r], b))
            offset += size
        return y

    def native_decode_tensors(self):
        """The base weight's, for the native whole-stack decode (its LoRA delta: `lora_add`, with lora_a and
        lora_b)."""
        return self.base.native_decode_tensors()
