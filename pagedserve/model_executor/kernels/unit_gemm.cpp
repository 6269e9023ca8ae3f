// One translation unit of the kernels (build_config.UNITS): the matrix products (small-M GEMM, MoE experts, bf16
// weights, LoRA, block-quantized weights). Compiled together so that ATen's headers are parsed once per unit.
#include "small_gemm.cpp"
#include "moe_experts.cpp"
#include "bf16_weight_gemm.cpp"
#include "lora.cpp"
#include "quant_gemm.cpp"
