"""The native whole-stack decode (kernels/decode_layers.cpp): every decoder layer of a decode-only step in one
native call, the layers' ops in their order (so bitwise the Python layers' results) without the Python and
dispatch cost of each op, tens of microseconds per layer.

A model opts in by building a FusedDecodeStack over its DecoderLayers once their weights are processed
(`FusedDecodeStack.build`): there is one where the attention backend supports it (the CPU backend, its kernels
built), the model runs on one tensor-parallel rank, and every linear's method hands over native tensors
(quantization/base.py: the native small GEMM's packed weights, float or int8, or GGUF blocks for quant_gemm.cpp).
Each step it runs only when every row is a decode row within the linears' row limit; otherwise, and for layers
with forward hooks (the engine's fault injection, a user's, which must run), the Python layers do. A sliding-window
layer's attention takes its window, and a hybrid model's layer its KV cache group's block table and slots
(core/kv_cache_groups.py), as in Python. With multi-LoRA, the LoRA model manager hands it each step's adapter
tensors and row slots (`set_lora`): the kernel adds each projection's batched delta after it. Gemma 2/3's layer
runs too: its norms after attention and MLP, GeGLU, the attention's soft cap, RoPE tables per layer type.
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pagedserve.model_executor.attention.backend import AttentionBackend, KVCache
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.parallel_state import ParallelState
from pagedserve.model_executor.quantization.base import NativeLinearTensors


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # an MLP's gate activation -> decode_layers' code


class FusedDecodeStack:
    def __init__(self, layers: nn.ModuleList, kernels: ModuleType, tensors: list[torch.Tensor], widths: list[int],
                 max_rows: int, rms_norm_eps: float, layer_groups: list[int],
                 sandwich_norms: list[torch.Tensor]) -> None:
        self.layers = layers
        self.layer_groups = layer_groups  # per layer: its KV cache group (its block table and slots)
        self.windows = [layer.self_attn.sliding_window or 0 for layer in layers]
        # Gemma: the attention's soft cap, norms after attention and MLP (sandwich_norms: two per layer, or none),
        # GeGLU, and RoPE per layer type (cos_sin a dict by type: each layer's index into it)
        self.soft_caps = [layer.self_attn.logits_soft_cap or 0.0 for layer in layers]
        self.sandwich_norms = sandwich_norms
        self.activation = ACTIVATIONS[layers[0].mlp.activation]
        self.layer_types = [getattr(layer, "layer_type", None) for layer in layers]
        self.kernels = kernels
        self.tensors = tensors  # per layer, in decode_layers' order
        self.widths = widths  # per layer: the QKV, o_proj and gate_up output widths
        self.max_rows = max_rows
        self.weight_dtype = tensors[1].dtype  # the first QKV packed weight: the model dtype, int8, or uint8 (GGUF)
        attn = layers[0].self_attn
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, rms_norm_eps, attn.scale)
        self.lora: list[torch.Tensor] = []  # the step's LoRA tensors (lora/layers.py), empty: no adapter row
        self.lora_rows: torch.Tensor | None = None

    @classmethod
    def build(cls, layers: nn.ModuleList, attn_backend: AttentionBackend, parallel: ParallelState,
              rms_norm_eps: float, layer_groups: list[int]) -> FusedDecodeStack | None:
        """The stack over `layers` (DecoderLayers, weights processed; layer i of KV cache group layer_groups[i]), or
        None where it cannot run."""
        kernels = cpu_kernels() if attn_backend.supports_fused_decode_stack and parallel.tp_size == 1 else None
        if kernels is None or len(layers) == 0:
            return None
        none = torch.empty(0)

        def product(lin: Linear) -> list[torch.Tensor]:
            t: NativeLinearTensors = native[lin]
            scale = t.int8_scale if t.gguf_layout is None else t.gguf_layout  # GGUF blocks: the kernel's layout
            return [t.packed_weight, none if t.bias is None else t.bias,
                    none if scale is None else scale, none if t.int8_shift is None else t.int8_shift]

        tensors: list[torch.Tensor] = []
        sandwich_norms: list[torch.Tensor] = []
        widths: list[int] = []
        native: dict[Linear, NativeLinearTensors] = {}
        if layers[0].mlp.activation not in ACTIVATIONS:
            return None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                t = lin.native_decode_tensors()
                if t is None:
                    return None
                native[lin] = t
            q_norm = none if attn.q_norm is None else attn.q_norm.weight
            k_norm = none if attn.k_norm is None else attn.k_norm.weight
            # Gemma's layer: its pre-MLP norm takes the residual add (Llama's post-attention norm's place), its
            # post-attention and post-MLP norms run on the attention's and the MLP's outputs
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            if sandwich:
                sandwich_norms += [layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight]
            tensors += [layer.input_layernorm.weight, *product(attn.qkv_proj), q_norm, k_norm,
                        *product(attn.o_proj), mlp_norm.weight,
                        *product(mlp.gate_up_proj), *product(mlp.down_proj)]
            widths += [attn.qkv_proj.out_features, attn.o_proj.out_features, mlp.gate_up_proj.out_features]
        if sandwich_norms and len(sandwich_norms) != 2 * len(layers):
            return None  # a mix of layer kinds
        return cls(layers, kernels, tensors, widths, min(t.max_rows for t in native.values()), rms_norm_eps,
                   layer_groups, sandwich_norms)

    def set_lora(self, tensors: list[torch.Tensor], row_slots: torch.Tensor | None) -> None:
        """The next steps' LoRA: per layer lora_a and lora_b of QKV, o, gate/up and down, and each row's slot (-1:
        none); ([], None): no adapter row."""
        self.lora, self.lora_rows = tensors, row_slots

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list[KVCache], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after every layer, or None when this step is not one the stack runs."""
        rows = x.shape[0]
        if meta.prefills or meta.num_decodes != rows or rows > self.max_rows \
                or self.weight_dtype not in (x.dtype, torch.int8, torch.uint8) \
                or any(layer._forward_pre_hooks or layer._forward_hooks for layer in self.layers):
            return None
        groups = [meta, *meta.group_metadata]
        layer_rope: list[int] = []
        if isinstance(cos_sin, dict):  # per layer type (Gemma 3): the first type's tables, then the others'
            kinds = list(cos_sin)
            layer_rope = [kinds.index(kind) for kind in self.layer_types]
            cos_sin, extra_rope = cos_sin[kinds[0]], [t for kind in kinds[1:] for t in cos_sin[kind]]
        else:
            extra_rope = []
        return self.kernels.decode_layers(x, residual, self.tensors, self.widths, [t for kv in kv_caches for t in kv],
                                          *cos_sin, [m.slot_mapping for m in groups],
                                          [m.decode_block_tables for m in groups], meta.decode_context_lens,
                                          self.layer_groups, self.windows, *self.shape, self.lora, self.lora_rows,
                                          self.soft_caps, self.sandwich_norms, self.activation, extra_rope,
                                          layer_rope)
