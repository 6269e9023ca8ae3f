"""The runner's side of multi-LoRA: the model's projections wrapped in LoRA layers (vLLM's module replacement),
adapters kept in host memory (LRU, --max-cpu-loras) and copied into the slot the scheduler gave them
(core/lora_slots.py) when the slot holds another, and each step's row -> slot mapping.

A step without adapter rows runs exactly the base model (the LoRA layers add nothing, and the native whole-stack
decode runs as without LoRA); a step with some adds the batched delta after each adapted projection (layers.py): a
decode step in the native whole-stack decode where the model has one (the same kernel, called after its products),
others through the layers.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.layers import LoRALinear, LoRAMapping, delta_op
from pagedserve.lora.peft_loader import LoRAWeights, load_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.model_executor.kernels import cpu_kernels

# each LoRA layer's output slices: the checkpoint's projections fused into it, in order
SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRAModelManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype) -> None:
        if any(not hasattr(layer.mlp, "gate_up_proj") for layer in model.layers):
            raise ValueError("LoRA is supported on the dense decoder models (not on mixture-of-experts layers).")
        self.model = model
        self.config = config
        self.dtype = dtype
        self.mapping = LoRAMapping(config.max_loras, config.max_lora_rank)
        self.layers: list[dict[str, LoRALinear]] = []
        op, pairs = delta_op(device, dtype, cpu_kernels() if device.type == "cpu" else None)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            half = mlp.gate_up_proj.out_features // 2
            sizes = {"qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size], "o_proj": [attn.o_proj.out_features],
                     "gate_up_proj": [half, half], "down_proj": [mlp.down_proj.out_features]}
            wrapped = {}
            for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
                wrapped[name] = LoRALinear(getattr(owner, name), sizes[name], self.mapping, dtype, device, op,
                                           pairs)
                setattr(owner, name, wrapped[name])
            self.layers.append(wrapped)
        self.batched = op is not None  # by row index (else the torch path, with the one-hot mask)
        # the native whole-stack decode (None: the model has none; it exists on CPU with the kernels, whose op the
        # layers then run) and its LoRA tensors in layer order
        self.fused_decode = model.fused_decode
        self.decode_tensors = [t for layer in self.layers for name in SLICES for t in
                               (layer[name].lora_a, layer[name].lora_b)]
        self.slot_contents: list[LoRARequest | None] = [None] * config.max_loras
        self.host_cache: OrderedDict[int, tuple[LoRARequest, LoRAWeights]] = OrderedDict()

    # ------------------------------------------------------------------ adapters
    def add_adapter(self, lora: LoRARequest) -> LoRAWeights:
        """The adapter's weights in host memory (read from disk unless cached): ValueError if it does not fit."""
        cached = self.host_cache.get(lora.lora_int_id)
        if cached is not None and cached[0] == lora:
            self.host_cache.move_to_end(lora.lora_int_id)
            return cached[1]
        weights = load_adapter(lora.lora_path, self.config.max_lora_rank, len(self.layers))
        for (i, module), (a, b) in weights.modules.items():
            name = next(n for n, parts in SLICES.items() if module in parts)
            layer = self.layers[i][name]
            size = layer.slice_sizes[SLICES[name].index(module)]
            if a.shape[1] != layer.in_features or b.shape[0] != size:
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: layer {i} {module} is {b.shape[0]}x{a.shape[1]}; "
                                 f"the model's is {size}x{layer.in_features}.")
        self.host_cache[lora.lora_int_id] = (lora, weights)
        self.host_cache.move_to_end(lora.lora_int_id)
        while len(self.host_cache) > self.config.max_cpu_loras:
            self.host_cache.popitem(last=False)
        return weights

    def remove_adapter(self, lora_int_id: int) -> None:
        self.host_cache.pop(lora_int_id, None)
        self.slot_contents = [None if s is not None and s.lora_int_id == lora_int_id else s
                              for s in self.slot_contents]

    def _load_slot(self, slot: int, lora: LoRARequest) -> None:
        weights = self.add_adapter(lora)
        for i, layer in enumerate(self.layers):
            for name, lin in layer.items():
                lin.set_slot(slot, [weights.modules.get((i, module)) for module in SLICES[name]])
        self.slot_contents[slot] = lora

    # ------------------------------------------------------------------ the step
    def prepare_step(self, lora_slots: dict[int, int], spans: list[tuple[LoRARequest | None, int]],
                     device: torch.device) -> None:
        """spans: the step's spans in forward order, (adapter or None, number of rows)."""
        if all(lora is None for lora, _ in spans):
            self.mapping.set_rows(None, self.dtype)
            self.model.fused_decode = self.fused_decode
            if self.fused_decode is not None:
                self.fused_decode.set_lora([], None)
            return
        slots = []
        for lora, _ in spans:
            if lora is None:
                slots.append(-1)
                continue
            slot = lora_slots[lora.lora_int_id]
            if self.slot_contents[slot] != lora:
                self._load_slot(slot, lora)
            slots.append(slot)
        counts = torch.tensor([n for _, n in spans])
        row_slots = torch.repeat_interleave(torch.tensor(slots), counts).to(device)
        self.mapping.set_rows(row_slots, self.dtype, with_mask=not self.batched)
        # without the kernel's delta (a dtype it does not take) the layers run one by one
        self.model.fused_decode = self.fused_decode if self.batched else None
        if self.model.fused_decode is not None:
            self.model.fused_decode.set_lora(self.decode_tensors, row_slots)
