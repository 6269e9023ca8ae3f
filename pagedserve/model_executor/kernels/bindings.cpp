// The Python module of one instruction-set build: every kernel file's entry points (ops.h). The only file that
// includes pybind11 and torch's type casters for it (torch/csrc/utils/pybind.h: a quarter of torch/extension.h's
// compile time, which also brings the whole C++ frontend); the kernel files include only torch_slice.h.
#include "ops.h"
#include "vec.h"

#include <torch/csrc/utils/pybind.h>

// The products and attention release the GIL while they run: the server's event loop (streaming the tokens) shares
// the process with the engine thread, and an MoE model's decode step is Python layers calling these (a GGUF LM head
// alone holds a CPU for ~5 ms).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, py::call_guard<py::gil_scoped_release>(),
        "decode attention over a paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("out") = py::none(), py::arg("window") = 0, py::arg("soft_cap") = 0.0,
        py::arg("sinks") = py::none());
  m.def("paged_prefill_attention", &paged_prefill_attention, py::call_guard<py::gil_scoped_release>(),
        "causal attention of one prefill chunk over its "
        "sequence's paged KV cache (CPU, AVX-512)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_ids"), py::arg("first"), py::arg("scale"), py::arg("out"), py::arg("causal") = true,
        py::arg("window") = 0, py::arg("soft_cap") = 0.0, py::arg("sinks") = py::none());
  m.def("native_prefill", &native_prefill, "whether paged_prefill_attention handles this head_dim in this build");
  m.def("write_kv", &write_kv, "write new K/V rows (float32 or bfloat16) into the paged cache at their slots");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row ([rows, n] or [T, heads, n]); with residual: residual += x in "
        "place, then its RMSNorm; with out (may be x): written there (float32 or bfloat16)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("out") = py::none());
  m.def("fused_moe_experts", &fused_moe_experts, py::call_guard<py::gil_scoped_release>(), "an MoE layer's experts on packed stacks: the (token, slot) pairs "
        "sorted by expert (pair_tokens, pair_weights; counts per expert), each expert act(x[rows] W13^T + b13) W2^T + "
        "b2, and per token the sum of its pairs' rows times their weights; int8 with scales and shifts, GGUF blocks "
        "with their parts' layouts; activation 0 "
        "silu, 1 gpt-oss's clamped SwiGLU");
  m.def("native_bf16_weight_gemm", &native_bf16_weight_gemm, "whether bf16_weight_gemm runs in this build (AVX2) for "
        "this K (a multiple of 8)");
  m.def("bf16_weight_gemm", &bf16_weight_gemm, py::call_guard<py::gil_scoped_release>(), "x W^T (+ b) for a bfloat16 weight [N, K] as stored, in float32 "
        "arithmetic (CPUs without bfloat16 instructions); x float32 or bfloat16, y in x's dtype", py::arg("x"),
        py::arg("weight"), py::arg("bias") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] projection (float32 or bfloat16)");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul,
        "gelu(gate, tanh approximation) * up of a fused [gate | up] projection (float32 or bfloat16)");
  m.def("rotary_inplace", &rotary_inplace, "Neox-style rotary embedding in place (float32 or bfloat16)");
  m.def("argmax_rows", &argmax_rows,
        "each row's argmax, the first index on ties (float32 or bfloat16 [rows, n], contiguous rows)");
  m.def("native_small_gemm", &native_small_gemm, "whether small_gemm runs this dtype (and K; 0: any) natively in "
        "this build", py::arg("dtype"), py::arg("k") = 0);
  m.def("pack_small_gemm_weight", &pack_small_gemm_weight, "a [N, K] weight packed for small_gemm");
  m.def("small_gemm", &small_gemm, py::call_guard<py::gil_scoped_release>(),
        "x W^T (+ b) for a few rows x on a weight packed by pack_small_gemm_weight",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("small_gemm_int8", &small_gemm_int8, py::call_guard<py::gil_scoped_release>(),
        "x W^T (+ b) on an int8 weight packed by pack_small_gemm_weight, x "
        "quantized per row on the fly", py::arg("x"), py::arg("packed"), py::arg("col_scale"), py::arg("col_shift"),
        py::arg("n"), py::arg("bias") = py::none());
  m.def("decode_layers", &decode_layers, py::call_guard<py::gil_scoped_release>(),
        "a decode step's decoder layers in one call (the Python layers' ops, in "
        "their order); returns (hidden, residual)", py::arg("x"), py::arg("residual"), py::arg("weights"),
        py::arg("widths"), py::arg("caches"), py::arg("cos"), py::arg("sin"), py::arg("slot_mappings"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("layer_groups"), py::arg("windows"),
        py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("lora") = std::vector<torch::Tensor>(),
        py::arg("lora_rows") = py::none(), py::arg("soft_caps") = std::vector<double>(),
        py::arg("sandwich_norms") = std::vector<torch::Tensor>(), py::arg("activation") = 0,
        py::arg("extra_rope") = std::vector<torch::Tensor>(), py::arg("layer_rope") = std::vector<int64_t>());
  m.def("lora_add", &lora_add, "y += each row's LoRA adapter delta B[slot] (A[slot] x), in place, by the rows' slot "
        "index (-1: none); a [slots, in, S x R], b [slots, R, out] (float32 or bfloat16)", py::arg("y"), py::arg("x"),
        py::arg("a"), py::arg("b"), py::arg("row_slots"), py::arg("slices"));
  m.def("lora_bf16_pairs", &lora_bf16_pairs, "whether lora_add takes bfloat16 weights in pairs of k (a [slots, "
        "in/2, S x R, 2], b [slots, R/2, out', 2]) in this build");
  m.def("amx_tiles", &ps::amx_tiles,
        "whether small_gemm calls (bfloat16: any rows, K % 32 == 0; int8 weights: 2+ rows, K % 64 == 0, with AMX-INT8) and "
        "bfloat16 prefill and decode attention run on AMX tiles");
  m.def("set_amx_tiles", &set_amx_tiles, "turn the AMX path on or off where available; returns amx_tiles()");
  m.def("small_gemm_chunks", &small_gemm_chunks,
        "whether small_gemm calls of 9-20 rows take K in chunks (on CPUs where that was measured faster)");
  m.def("set_small_gemm_chunks", &set_small_gemm_chunks, "turn those chunks on or off; returns small_gemm_chunks()");
  m.def("small_gemm_prefetch", &small_gemm_prefetch,
        "how many k steps ahead small_gemm calls of up to 8 rows prefetch their weights (a per-CPU default)");
  m.def("set_small_gemm_prefetch", &set_small_gemm_prefetch,
        "set that distance (0-64 k steps); returns small_gemm_prefetch()");
  m.def("native_gguf_type", &native_gguf_type, "whether gguf_gemm runs this ggml type (Q8_0, Q4_0, Q4_1, Q5_0, "
        "Q5_1, Q4_K, Q5_K, Q6_K)");
  m.def("gguf_repack", &gguf_repack, "a GGUF tensor's blocks ([N, row bytes] uint8 as stored) repacked for gguf_gemm",
        py::arg("raw"), py::arg("type"), py::arg("n"), py::arg("k"));
  m.def("gguf_gemm", &gguf_gemm, py::call_guard<py::gil_scoped_release>(), "x W^T (+ b) on GGUF block-quantized weights: `packed` the repacked parts (side "
        "by side along N, e.g. a fused layer's shards) one after another, `layout` [parts, 2] int64 their (type, "
        "width); x quantized to int8 on the fly per block of 32 (or, per_row_activations, with one scale per row); "
        "col_scale [N] multiplies each output column (before the bias)", py::arg("x"), py::arg("packed"),
        py::arg("layout"), py::arg("bias") = py::none(), py::arg("col_scale") = py::none(),
        py::arg("per_row_activations") = false);
  m.def("isa", &kernel_isa, "the instruction-set level this build targets");
}
