"""The stacked experts of an MoE layer and their grouped computation: the (token, slot) pairs are sorted by expert id
once, each expert with tokens runs its GEMM pair over its contiguous run of rows, and the weighted rows are summed
per token (in the native call, or one index_add). The Python loop is over experts that received tokens, never over
tokens.

Weights: w13 [E, 2I, H] (gate | up, each expert's rows as one fused projection), w2 [E, H, I], optional biases
[E, 2I] / [E, H] (gpt-oss). Once loaded, on a CPU whose native small GEMM (kernels/small_gemm.cpp) runs the model
dtype, each expert's two matrices are packed for it (float32, bfloat16) or, under `--quantization int8`, quantized
per output channel and packed as int8, exactly as the dense layers' linear methods do; the float copies are then
dropped, and one native call (kernels/moe_experts.cpp) gathers every expert's rows, runs it and sums the weighted
outputs per token (no ATen index ops: on a shared 2-core CPU index_add_ alone took 50-110 ms a layer). Where the
small GEMM does not run the dtype (AVX2 CPUs: no VNNI, no AVX512-BF16) the same call takes int8 experts as the same
per-channel int8 weights in Q8_0 blocks (the block-quantized kernel's int8 dot products, VPMADDUBSW) and bfloat16
experts as stored (bf16_weight_gemm: float32 arithmetic on the widened weights). A GGUF file's experts
(quantization/gguf.py: GGUFExpertsMethod) keep the file's blocks, repacked per expert for the same block-quantized
kernel (gate and up as two parts of one product, each in its own type). Each expert's product goes to the
native kernel at every row count: only one copy of the experts is kept (they are most of an MoE model's bytes), and
an expert's rows are few (a 512-token prefill chunk routes ~32 rows to each of Qwen3-30B-A3B's 128 experts). On CUDA
(with Triton) the Triton fused-MoE kernel (triton_moe.py). Elsewhere (`--linear-backend torch`, CPUs without the
native kernels) F.linear per expert on the float weights (int8: the dequantized ones, so the numbers are the
quantized model's).
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.layers.activation import SwigluOAI, silu_and_mul
from pagedserve.model_executor.quantization.base import QuantizationConfig
from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES, GGUFExpertsMethod, int4_gguf_rows, q4_0_as_q4_1
from pagedserve.model_executor.quantization.fp8 import Fp8DequantLinearMethod
from pagedserve.model_executor.quantization.int4 import Int4LinearMethod
from pagedserve.model_executor.quantization.int8 import Int8LinearMethod, q8_0_rows, quantize_per_channel
from pagedserve.model_executor.quantization.unquantized import UnquantizedLinearMethod


def silu_activation(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(gate_up, None)


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                    expert: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                    all_experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]
                    | None = None) -> torch.Tensor:
    """sum_k weight[t, k] * expert(id[t, k], x[t]) for every token; `expert(e, rows)` runs expert e's MLP on rows,
    or `all_experts(x, pair_tokens, pair_weights, counts)` the whole sum, given the (token, slot) pairs grouped by
    expert (counts[e] pairs each): their tokens and routing weights (float32)."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token_of = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync per layer
    pair_weights = topk_weights.reshape(-1).float().index_select(0, order)
    if all_experts is not None:
        return all_experts(x, token_of, pair_weights, counts)
    rows = x.index_select(0, token_of)
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = expert(e, rows[start:start + n])
            start += n
    out = out * pair_weights.unsqueeze(1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The gated-SiLU experts on float weights by F.linear; x [T, H], w13 [E, 2I, H], w2 [E, H, I]."""
    return grouped_experts(x, topk_weights, topk_ids, w13.shape[0],
                           lambda e, rows: F.linear(silu_activation(F.linear(rows, w13[e])), w2[e]))


class _PackedStack:
    """One projection of every expert as the native small GEMM reads it: packed [E, ...] (float, bfloat16 or int8)
    and for int8 the per-column scales and shifts [E, N]."""

    copies_weights = True
    layout = None

    def __init__(self, w: torch.Tensor, int8: bool) -> None:
        ops = cpu_kernels()
        self.n = w.shape[1]
        if int8:
            qs = [quantize_per_channel(w[e]) for e in range(w.shape[0])]  # per expert: bounded float64 temporaries
            self.packed = torch.stack([ops.pack_small_gemm_weight(q) for q, _ in qs])
            self.scale = torch.stack([s.float() for _, s in qs])
            self.shift = torch.stack([128 * q.sum(dim=1, dtype=torch.int32) for q, _ in qs])  # the kernel's +128 on x
        else:
            self.packed = torch.stack([ops.pack_small_gemm_weight(w[e]) for e in range(w.shape[0])])
            self.scale = self.shift = None


class _BlockStack:
    """One product of every expert in GGUF blocks repacked for the native block-quantized kernel (gguf_gemm), which
    multiplies them with int8 dot products against activations quantized per block of 32: packed [E, bytes] (expert
    e's parts one after another in row e) and the parts' layout [parts, 2] (type, width), the same for every expert.
    Two sources: a GGUF file's experts kept as stored (`from_blocks`; gate|up as two parts), and int8 experts where
    the small GEMM runs no int8 (AVX2 CPUs without VNNI: `from_int8`, the same per-channel int8 weights as Q8_0
    blocks, quantization/int8.py: q8_0_rows) - a quarter of the bytes per product of the dequantized float32 experts
    F.linear would read."""

    copies_weights = True
    Q8_0 = NATIVE_TYPES["Q8_0"][0]
    scale = shift = None

    def __init__(self, packed: torch.Tensor, layout: list[tuple[int, int]]) -> None:
        self.packed = packed
        self.layout = torch.tensor(layout, dtype=torch.int64)
        self.n = sum(width for _, width in layout)

    @classmethod
    def from_blocks(cls, parts: list[tuple[torch.Tensor, int]], k: int) -> _BlockStack:
        """parts: (blocks [E, rows, row bytes] as stored, ggml type id) along the product's output columns."""
        ops = cpu_kernels()
        packed = [torch.cat([ops.gguf_repack(blocks[e], t, blocks.shape[1], k) for blocks, t in parts])
                  for e in range(parts[0][0].shape[0])]
        return cls(torch.stack(packed), [(t, blocks.shape[1]) for blocks, t in parts])

    @classmethod
    def from_int8(cls, w: torch.Tensor) -> _BlockStack | None:
        """None where a weight does not fit Q8_0 (K not a multiple of 32, a scale outside float16's range)."""
        ops = cpu_kernels()
        n, k = w.shape[1], w.shape[2]
        packed = []
        for e in range(w.shape[0]):
            rows = q8_0_rows(*quantize_per_channel(w[e]))
            if rows is None:
                return None
            packed.append(ops.gguf_repack(rows, cls.Q8_0, n, k))
        return cls(torch.stack(packed), [(cls.Q8_0, n)])


class _StoredStack:
    """One projection of every bfloat16 expert where the small GEMM runs no bfloat16 (AVX2 CPUs without AVX512-BF16):
    the weights as loaded, [E, N, K], multiplied by bf16_weight_gemm in float32 arithmetic (PyTorch's bfloat16
    F.linear there reads the weight once per row, at a fraction of the memory bandwidth)."""

    copies_weights = False
    scale = shift = layout = None

    def __init__(self, w: torch.Tensor) -> None:
        self.packed = w.contiguous()
        self.n = w.shape[1]


class _ExpertProjection(nn.Module):
    """One expert's projection as a checkpoint format stores it: a 4-bit format's tensors (GPTQ / AWQ /
    compressed-tensors W4A16, or the float weight `--quantization int4` rounds: read as Int4Weights once loaded) or
    FP8 weights with their scales (dequantized once loaded)."""

    def __init__(self, method: Int4LinearMethod | Fp8DequantLinearMethod, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        method.create_weights(self, in_features, out_features, False)


class FusedMoE(nn.Module):
    """The experts of one layer: parameters w13_weight, w2_weight (and w13_bias, w2_bias with `bias`) for the
    checkpoint loader; `activation` maps the [rows, 2I] gate|up product to [rows, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, quant_config: QuantizationConfig,
                 prefix: str, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_activation) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = activation
        self.method = quant_config.get_linear_method(self, prefix)
        self.float_method = quant_config.float_config.method  # where 4-bit experts end up dequantized
        kinds = (Int8LinearMethod, UnquantizedLinearMethod, GGUFExpertsMethod, Int4LinearMethod)
        if not isinstance(self.method, kinds) or getattr(self.method, "per_token_activations", False):
            raise ValueError(f"MoE experts run float, FP8, int8 (--quantization int8), 4-bit (GPTQ, AWQ, "
                             f"compressed-tensors W4A16, --quantization int4) or GGUF-block weights; quantization "
                             f"{quant_config.name!r} is not built for them.")
        self.checkpoint_experts = None
        if isinstance(self.method, GGUFExpertsMethod):  # the file's blocks; float weights only if dequantized
            self.method.create_weights(self, num_experts, hidden, intermediate)
            self.w13_weight = self.w2_weight = None
        elif isinstance(self.method, (Int4LinearMethod, Fp8DequantLinearMethod)):  # each expert's, as stored
            self.checkpoint_experts = nn.ModuleList(nn.ModuleDict({
                "gate_proj": _ExpertProjection(self.method, hidden, intermediate),
                "up_proj": _ExpertProjection(self.method, hidden, intermediate),
                "down_proj": _ExpertProjection(self.method, intermediate, hidden)}) for _ in range(num_experts))
            self.w13_weight = self.w2_weight = None
        else:
            self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False) if bias else None
        self.native13 = self.native2 = None  # the stacks the native call reads, once loaded where it runs

    def process_weights_after_loading(self) -> None:
        if isinstance(self.method, GGUFExpertsMethod):
            self._process_gguf_blocks()
        elif isinstance(self.method, Fp8DequantLinearMethod):
            self._process_dequantized_experts(self.method.dequantize)
        elif self.checkpoint_experts is not None:
            self._process_int4_experts()
        else:
            int8 = isinstance(self.method, Int8LinearMethod)
            self._process_float_experts(self.w13_weight.detach(), self.w2_weight.detach(), int8,
                                        self.method.allow_native if int8 else self.method.backend == "native")

    def _process_float_experts(self, w13: torch.Tensor, w2: torch.Tensor, int8: bool, allow: bool) -> None:
        """Float (or, int8: quantized per channel) experts packed for the native call where it runs their dtype."""
        ops = cpu_kernels() if allow and w13.device.type == "cpu" and w13.dtype in (torch.float32, torch.bfloat16) \
            else None
        stacks = self._native_stacks(ops, w13, w2, int8) if ops is not None else None
        if stacks is not None:
            self.native13, self.native2 = stacks
            if self.native13.copies_weights:  # every product reads the kernels' copies
                empty = torch.empty(0, dtype=w13.dtype)
                self.w13_weight = nn.Parameter(empty, requires_grad=False)
                self.w2_weight = nn.Parameter(empty.clone(), requires_grad=False)
        elif int8:  # no native int8 here: F.linear on the dequantized weights (the quantized model's numbers)
            for name, w in (("w13_weight", w13), ("w2_weight", w2)):
                deq = torch.stack([(q.double() * s[:, None]).to(w.dtype)
                                   for q, s in (quantize_per_channel(w[e]) for e in range(w.shape[0]))])
                setattr(self, name, nn.Parameter(deq, requires_grad=False))

    def _process_gguf_blocks(self) -> None:
        """The file's blocks repacked per expert for the native call, or, where it does not run (no native kernels,
        float16), dequantized into the float weights F.linear reads."""
        parts = self.method.native_parts(self) if self.gguf_dtype.device.type == "cpu" else None
        if parts is not None:
            gate_up, down = parts
            self.native13 = _BlockStack.from_blocks(gate_up, self.down_proj_qweight.shape[1])
            self.native2 = _BlockStack.from_blocks(down, self.gate_proj_qweight.shape[1])
        else:
            self._use_float_experts(*self.method.dequantized(self))
        for proj in GGUFExpertsMethod.PROJECTIONS:
            delattr(self, f"{proj}_qweight")

    def _process_int4_experts(self) -> None:
        """Each expert's 4-bit weights as GGUF Q4_0 / Q4_1 rows (quantization/gguf.py: int4_gguf_rows) for the native
        call, like a GGUF file's experts: half a byte per weight. Where blocks cannot hold them (act-order, groups of
        fewer than 32) or the kernels do not run, dequantized to float experts."""
        stacks = self._int4_block_stacks()
        if stacks is not None:
            self.native13, self.native2 = stacks
            self.checkpoint_experts = None
        else:
            def dequantize(projection: nn.Module) -> torch.Tensor:
                weights = self.method.int4_weights(projection)
                return weights.dequantize().to(weights.dtype)
            self._process_dequantized_experts(dequantize)

    def _process_dequantized_experts(self, dequantize: Callable[[nn.Module], torch.Tensor]) -> None:
        """The checkpoint's experts dequantized (`dequantize(projection)`: its float weight) into float experts."""
        def stacked(proj: str) -> torch.Tensor:
            return torch.stack([dequantize(e[proj]) for e in self.checkpoint_experts])

        w13, w2 = torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1), stacked("down_proj")
        self.checkpoint_experts = None
        self._use_float_experts(w13, w2)

    def _use_float_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Dequantized experts as float ones: on the float layers' kernels (packed where they run the dtype)."""
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        self._process_float_experts(w13, w2, False, self.float_method.backend == "native")

    def _int4_block_stacks(self) -> tuple[_BlockStack, _BlockStack] | None:
        """The two block stacks, or None where the kernels do not run here (another device or dtype) or blocks cannot
        hold an expert's weights."""
        ops = cpu_kernels()
        if ops is None or not ops.native_gguf_type(NATIVE_TYPES["Q4_1"][0]):
            return None
        rows: dict[str, list[tuple[torch.Tensor, str]]] = {p: [] for p in GGUFExpertsMethod.PROJECTIONS}
        for expert in self.checkpoint_experts:
            for proj in rows:
                weights = self.method.int4_weights(expert[proj])
                if weights.q.device.type != "cpu" or weights.dtype not in (torch.float32, torch.bfloat16):
                    return None
                converted = int4_gguf_rows(weights)
                if converted is None:
                    return None
                rows[proj].append(converted)
        parts = {}
        for proj, converted in rows.items():  # one type per projection: Q4_1 if any expert's is
            type_name = "Q4_1" if any(t == "Q4_1" for _, t in converted) else "Q4_0"
            blocks = [q4_0_as_q4_1(r) if t != type_name else r for r, t in converted]
            parts[proj] = (torch.stack(blocks), NATIVE_TYPES[type_name][0])
        down = self.checkpoint_experts[0]["down_proj"]
        return (_BlockStack.from_blocks([parts["gate_proj"], parts["up_proj"]], down.out_features),
                _BlockStack.from_blocks([parts["down_proj"]], down.in_features))

    @staticmethod
    def _native_stacks(ops, w13: torch.Tensor, w2: torch.Tensor, int8: bool) -> tuple | None:
        """The two stacks for the native call on this CPU, best first: the small GEMM's packed weights where it runs
        the weight dtype; else Q8_0 blocks (int8) or the bfloat16 weights as stored; None where none runs here."""
        k13, k2 = w13.shape[2], w2.shape[2]
        wdtype = torch.int8 if int8 else w13.dtype
        if ops.native_small_gemm(wdtype, k13) and ops.native_small_gemm(wdtype, k2):
            return _PackedStack(w13, int8), _PackedStack(w2, int8)
        if int8 and ops.native_gguf_type(_BlockStack.Q8_0):
            q13 = _BlockStack.from_int8(w13)
            q2 = _BlockStack.from_int8(w2) if q13 is not None else None
            return (q13, q2) if q2 is not None else None
        if wdtype == torch.bfloat16 and ops.native_bf16_weight_gemm(k13) and ops.native_bf16_weight_gemm(k2):
            return _StoredStack(w13), _StoredStack(w2)
        return None

    def _native_experts(self, x: torch.Tensor, pair_tokens: torch.Tensor, pair_weights: torch.Tensor,
                        counts: list[int]) -> torch.Tensor:
        """Every expert over its tokens and their weighted sum per token in one native call (kernels/moe_experts.cpp;
        the stacks' kinds pick its kernels)."""
        a, b = self.native13, self.native2
        act = self.activation
        code, alpha, limit = (1, act.alpha, act.limit) if isinstance(act, SwigluOAI) else (0, 0.0, 0.0)
        # Its output is written by ATen's worker threads, which do not inherit the engine's inference mode: created
        # as an inference tensor, those writes would raise ("Inplace update to inference tensor outside
        # InferenceMode") whenever the experts spread over the threads (two or more per thread).
        with torch.inference_mode(False):
            return cpu_kernels().fused_moe_experts(x, pair_tokens, pair_weights, counts, a.packed, b.packed, a.n, b.n,
                                                   a.scale, a.shift, b.scale, b.shift, a.layout, b.layout,
                                                   self.w13_bias, self.w2_bias, code, alpha, limit)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        b2 = None if self.w2_bias is None else self.w2_bias[e]
        return F.linear(self.activation(F.linear(rows, self.w13_weight[e], b13)), self.w2_weight[e], b2)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and importlib.util.find_spec("triton") is not None:
            # imported here: Triton is an optional dependency of CPU installs
            from pagedserve.model_executor.layers.fused_moe.triton_moe import triton_fused_experts
            return triton_fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                                        self.w13_bias, self.w2_bias)
        if self.native13 is not None:
            return grouped_experts(x, topk_weights, topk_ids, self.num_experts, all_experts=self._native_experts)
        return grouped_experts(x, topk_weights, topk_ids, self.num_experts, self._expert)
