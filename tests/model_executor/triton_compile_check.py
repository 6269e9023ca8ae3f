"""Compiles every Triton kernel (attention, the layers' small ops, fused MoE) ahead of time for an NVIDIA target (default sm_90, the H100/H200) without a
GPU: Triton's front end, its MLIR passes and the bundled ptxas all run on the CPU. This catches what the interpreter
lets through (typing of loop bounds, tl.dot shape and dtype rules, shared-memory overflow).

    python tests/model_executor/triton_compile_check.py bf16 fp32      # run by tests/model_executor/test_triton_attention.py, outside the interpreter
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be real JIT functions here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedserve.model_executor.attention import triton as ta  # noqa: E402
from pagedserve.model_executor import triton_layer_ops as tlo  # noqa: E402
from pagedserve.model_executor.layers.fused_moe import triton_moe as tmoe  # noqa: E402
from pagedserve.lora import triton_ops as tlora  # noqa: E402

HEAD_DIM, BLOCK_SIZE = 128, 16
INDEX_ARGS = ("slot_ptr", "block_table_ptr", "context_lens_ptr", "block_ids_ptr", "sorted_ids_ptr",
              "block_expert_ptr", "slots_ptr", "y_offsets_ptr", "b_offsets_ptr", "sizes_ptr")  # int64 tensors
PARTIAL_ARGS = ("part_out_ptr", "part_max_ptr", "part_sum_ptr", "topk_weight_ptr", "h_ptr",
                "sinks_ptr")  # float32 workspace etc.


def compile_kernel(kernel, dtype: str, target: GPUTarget, **constexprs) -> int:
    """Compiles `kernel` with its tensors in `dtype` (a Triton type name); returns its shared memory in bytes."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INDEX_ARGS:
            signature[name] = "*i64"
        elif name in PARTIAL_ARGS:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name in ("scale", "eps", "soft_cap") else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target)
    return compiled.metadata.shared


def main(dtypes: list[str], arch: int = 90) -> None:
    target = GPUTarget("cuda", arch, 32)
    for dtype in dtypes:
        fp32 = dtype == "fp32"
        kernels = {
            "write_kv": (ta._write_kv_kernel, dict(BLOCK_H=8, BLOCK_D=HEAD_DIM)),
            "decode": (ta._decode_partition_kernel, dict(
                BLOCK_SIZE=BLOCK_SIZE, PARTITION=ta.DECODE_PARTITION, BLOCK_N=ta.DECODE_BLOCK_N, BLOCK_G=16,
                BLOCK_D=HEAD_DIM, FP32_DOT=fp32, WINDOW=False, SOFT_CAP=False)),
            # a sliding-window, soft-capped layer's variant (Gemma 2)
            "decode_window_cap": (ta._decode_partition_kernel, dict(
                BLOCK_SIZE=BLOCK_SIZE, PARTITION=ta.DECODE_PARTITION, BLOCK_N=ta.DECODE_BLOCK_N, BLOCK_G=16,
                BLOCK_D=HEAD_DIM, FP32_DOT=fp32, WINDOW=True, SOFT_CAP=True)),
            "decode_reduce": (ta._decode_reduce_kernel, dict(BLOCK_P=4, BLOCK_D=HEAD_DIM, SINKS=False)),
            # gpt-oss's sinks in the merge
            "decode_reduce_sinks": (ta._decode_reduce_kernel, dict(BLOCK_P=4, BLOCK_D=HEAD_DIM, SINKS=True)),
            "rms_norm": (tlo._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK_N=1024)),  # hidden 1024
            "rms_norm_heads": (tlo._rms_norm_kernel, dict(HAS_RESIDUAL=False, BLOCK_N=HEAD_DIM)),  # q/k norm
            "silu_and_mul": (tlo._silu_and_mul_kernel, dict(BLOCK=tlo.SILU_BLOCK)),
            "rotary": (tlo._rotary_kernel, dict(BLOCK=HEAD_DIM // 2)),
            "lora_shrink": (tlora._shrink_kernel, dict(RANK=16, BLOCK=tlora.BLOCK_K)),
            "lora_expand": (tlora._expand_kernel, dict(RANK=16, BLOCK=tlora.BLOCK_N)),
            "prefill": (ta._prefill_kernel, dict(
                BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=ta.PREFILL_BLOCK_M, BLOCK_N=ta.PREFILL_BLOCK_N, BLOCK_D=HEAD_DIM,
                FP32_DOT=fp32, WINDOW=False, SOFT_CAP=False, SINKS=False)),
            "prefill_window_cap": (ta._prefill_kernel, dict(
                BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=ta.PREFILL_BLOCK_M, BLOCK_N=ta.PREFILL_BLOCK_N, BLOCK_D=HEAD_DIM,
                FP32_DOT=fp32, WINDOW=True, SOFT_CAP=True, SINKS=False)),
            # a gpt-oss sliding layer's variant: window and sinks
            "prefill_window_sinks": (ta._prefill_kernel, dict(
                BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=ta.PREFILL_BLOCK_M, BLOCK_N=ta.PREFILL_BLOCK_N, BLOCK_D=HEAD_DIM,
                FP32_DOT=fp32, WINDOW=True, SOFT_CAP=False, SINKS=True)),
            # the experts' down projection with biases and routing weights (gpt-oss)
            "fused_moe": (tmoe._grouped_gemm_kernel, dict(
                GATHER_TOKENS=False, HAS_BIAS=True, MUL_WEIGHT=True, IEEE=fp32, BLOCK_M=tmoe.BLOCK_M,
                BLOCK_N=tmoe.BLOCK_N, BLOCK_K=tmoe.BLOCK_K)),
        }
        for name, (kernel, constexprs) in kernels.items():
            shared = compile_kernel(kernel, dtype, target, **constexprs)
            print(f"{dtype} {name}: compiled for sm_{arch}, {shared} bytes of shared memory", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["bf16", "fp32"])
