"""Multi-LoRA's kernel against the products it follows, per decoder layer and decode step: the base projections on
the native small GEMM (packed weights) vs `lora_add` with 4 rank-16 slots and the rows mixed evenly, on the SmolLM2
and Qwen3-0.6B shapes' matrices, float32 and bfloat16, 16 and 32 rows; CPU time, one thread (BENCHMARKS.md
section 23).

    python benchmarks/lora_kernel_overhead.py
"""
import time

import torch

from pagedserve.model_executor.kernels import cpu_kernels

torch.set_num_threads(1)
k = cpu_kernels()
SHAPES = {"smollm2-135m": (576, 1536, 576, 192), "qwen3-0.6b": (1024, 3072, 2048, 1024)}
def bench(f, n):
    f(); t0 = time.process_time()
    for _ in range(n): f()
    return (time.process_time() - t0) / n * 1e6
def pairs(w): return w.view(w.shape[0], w.shape[1] // 2, 2, w.shape[2]).transpose(2, 3).contiguous()
for shape, (h, inter, q, kv) in SHAPES.items():
    projs = {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [inter, inter]), "down": (inter, [h])}
    for dt in (torch.float32, torch.bfloat16):
        for rows in (16, 32):
            tb = tl = 0
            for inf, slices in projs.values():
                out = sum(slices)
                x = torch.randn(rows, inf).to(dt); w = (torch.randn(out, inf) * .05).to(dt)
                a = (torch.randn(4, inf, 16 * len(slices)) * .05).to(dt); b = (torch.randn(4, 16, out) * .05).to(dt)
                if dt == torch.bfloat16 and k.lora_bf16_pairs(): a, b = pairs(a), pairs(b)
                rs = torch.arange(rows) % 4
                p = k.pack_small_gemm_weight(w); y = k.small_gemm(x, p, out)
                n = 30 if shape == "qwen3-0.6b" else 100
                tb += bench(lambda x=x, p=p, out=out: k.small_gemm(x, p, out), n)
                tl += bench(lambda y=y, x=x, a=a, b=b, rs=rs, slices=slices: k.lora_add(y, x, a, b, rs, slices), n)
            print(f"{shape} {str(dt)[6:]} rows {rows}: base products {tb:.0f} us, LoRA delta {tl:.0f} us per layer "
                  f"({tl / tb:.1%})", flush=True)
