"""The LoRA linear layer: the base projection plus every row's adapter delta, batched over the step's rows.

Adapters sit in `max_loras` slots of stacked weights: A of every slot and output slice stacked as one
[slices x slots x R, in] matrix, B per output slice as [slots x R, out_slice] (scaling folded in, rank padded with
zeros to R = max_lora_rank). One step (Punica's BGMV / S-LoRA's idea, without a per-adapter loop):

    shrink  h = x @ A_all^T                   [T, slices x slots x R]: every row against every slot
    select  h *= mask                        the step's row -> slot one-hot (zeros for rows without adapter)
    expand  y[:, slice] += h[:, slice] @ B   the masked columns contribute nothing

So a step mixing adapters and the base model is three products per projection, whatever the mix; the cost is
max_loras x rank extra columns (small next to the base product at serving ranks). Fused projections (QKV,
gate/up) get one A per slice (q, k, v each have their own) and expand into their output columns. The products run
on the same GEMM paths as the base linears (`products`: an unquantized config's layers, so on a CPU the native
small GEMM on packed weights for decode-sized steps, oneDNN above), repacked when a slot's adapter changes.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.quantization.base import QuantizationConfig


class LoRAMapping:
    """The step's row -> slot selection, shared by every LoRA layer of the model: mask [T, slots x R] in the model
    dtype, or None when no row of the step has an adapter (the layers then run the base product alone)."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.mask: torch.Tensor | None = None

    def set_rows(self, row_slots: torch.Tensor | None, dtype: torch.dtype) -> None:
        """row_slots: [T] long, each row's slot or -1 (no adapter); None: no row has one."""
        if row_slots is None:
            self.mask = None
            return
        rows = torch.nonzero(row_slots >= 0).flatten()
        mask = torch.zeros(row_slots.shape[0], self.max_loras, self.max_rank, dtype=dtype, device=row_slots.device)
        mask[rows, row_slots[rows]] = 1
        self.mask = mask.view(row_slots.shape[0], -1)


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, slice_sizes: list[int], mapping: LoRAMapping, dtype: torch.dtype,
                 device: torch.device, products: QuantizationConfig) -> None:
        """products: the (unquantized) config whose linear layers multiply the stacks."""
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.mapping = mapping
        self.slice_sizes = slice_sizes
        self.products = products
        s, r = mapping.max_loras, mapping.max_rank
        # the stacks as loaded (what the product layers are packed from)
        self.lora_a = torch.zeros(len(slice_sizes), s, r, base.in_features, dtype=dtype, device=device)
        self.lora_b = [torch.zeros(s, r, size, dtype=dtype, device=device) for size in slice_sizes]
        # (shrink, [expand per slice]): the product layers, in a tuple so that they stay outside the module tree
        # (the model's own linears are what it walks)
        self._products: tuple[Linear, list[Linear]]
        self._pack()

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Per output slice the adapter's (A [rank, in], B [out, rank] scaled), or None for a slice it leaves alone."""
        self.lora_a[:, slot].zero_()
        for j, ab in enumerate(weights):
            self.lora_b[j][slot].zero_()
            if ab is not None:
                a, b = ab
                self.lora_a[j, slot, :a.shape[0]].copy_(a)
                self.lora_b[j][slot, :b.shape[1]].copy_(b.t())
        self._pack()

    def _product(self, weight: torch.Tensor) -> Linear:
        """A linear layer computing x @ weight^T (weight [out, in]) on the products' GEMM path."""
        layer = Linear(weight.shape[1], weight.shape[0], False, self.products)
        layer.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
        layer.process_weights_after_loading()
        return layer

    def _pack(self) -> None:
        self._products = (self._product(self.lora_a.view(-1, self.in_features)),
                          [self._product(b.view(-1, size).t()) for b, size in zip(self.lora_b, self.slice_sizes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask = self.mapping.mask
        if mask is None:
            return y
        num_slices = len(self.slice_sizes)
        shrink, expand = self._products
        h = shrink(x.contiguous())
        if num_slices == 1:
            return y.add_(expand[0](h.mul_(mask)))
        # select and regroup in one op: [T, slice, slots x R] -> [slice, T, slots x R], each slice's rows contiguous
        selected = torch.empty((num_slices, *mask.shape), dtype=h.dtype, device=h.device)
        torch.mul(h.view(x.shape[0], num_slices, -1).transpose(0, 1), mask, out=selected)
        offset = 0
        for j, size in enumerate(self.slice_sizes):  # per output slice of the fused projection (2 or 3)
            y[:, offset:offset + size].add_(expand[j](selected[j]))
            offset += size
        return y

    def native_decode_tensors(self):
        """The base weight's, for the native whole-stack decode (it runs only steps without adapter rows)."""
        return self.base.native_decode_tensors()
