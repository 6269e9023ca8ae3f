"""Roofline of this machine for a model shape (seed 000: "Latency와 Throughput의 상충 - Roofline 모델").

Measured:
  * peak matmul FLOP/s  - GEMMs (fp32 by default, or the model dtype) of a few large square sizes,
                           torch threads = cores, best of N;
  * memory bandwidth     - bytes/s of a large tensor copy (read + write) and sum (read), best of N;
  * GEMV bandwidth       - bytes/s of a (1 x K) @ (K x N) matmul over a weight bigger than cache:
                           what a batch-1 decode step really gets out of memory.

Model (per decode step of batch B, context C, weights W bytes, matmul params P):
  * compute time  = 2 * P * B / peak_flops
  * memory time   = (W + B * C * kv_bytes_per_token) / bandwidth
  * step time    ~= max(compute, memory)
  * batch-1 decode bound (tok/s)  = bandwidth / W
  * compute bound (tok/s)         = peak_flops / (2 * P)
  * B_sat = where the two meet (ignoring KV reads) = peak_flops * W / (2 * P * bandwidth).
    Below B_sat a decode step costs about the same whatever B is (weights are read once per
    step and shared) - the "free" region; above it, step time grows linearly with B.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from pagedserve.benchmarks.shapes import ModelShape, get_shape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclass
class MachinePeaks:
    threads: int
    matmul_flops: float  # FLOP/s, best fp32 GEMM
    matmul_size: int
    copy_bandwidth: float  # bytes/s, counting read + write
    sum_bandwidth: float  # bytes/s, read only
    gemv_bandwidth: float  # bytes/s reading the weight of a (1 x K) @ (K x N) matmul

    @property
    def bandwidth(self) -> float:
        """The memory bandwidth the roofline uses: the best of the three measurements."""
        return max(self.copy_bandwidth, self.sum_bandwidth, self.gemv_bandwidth)


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_peaks(sizes: tuple[int, ...] = (1024, 2048, 3072), repeats: int = 3, bw_mib: int = 512,
                  threads: int | None = None, device: str = "cpu", dtype: str = "float32") -> MachinePeaks:
    """dtype: the GEMM dtype (the model's: fp32 on CPU, usually bf16 on GPU); bandwidth is dtype-free."""
    import torch

    mm_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, torch.float32)

    threads = threads or os.cpu_count() or 1
    if device == "cpu":
        torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    best_flops, best_n = 0.0, sizes[0]
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=mm_dtype)
        b = torch.randn(n, n, device=device, dtype=mm_dtype)

        def mm():
            torch.mm(a, b)
            sync()

        t = _best_time(mm, repeats)
        f = 2.0 * n ** 3 / t
        if f > best_flops:
            best_flops, best_n = f, n
        del a, b

    numel = bw_mib * (1 << 20) // 4
    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)

    def cp():
        y.copy_(x)
        sync()

    def sm():
        x.sum()
        sync()

    copy_bw = 2 * x.numel() * 4 / _best_time(cp, repeats)
    sum_bw = x.numel() * 4 / _best_time(sm, repeats)
    del x, y
    k = 4096
    w = torch.randn(k, numel // k, device=device)
    v = torch.randn(1, k, device=device)

    def gemv():
        torch.mm(v, w)
        sync()

    gemv_bw = w.numel() * 4 / _best_time(gemv, repeats)
    return MachinePeaks(threads, best_flops, best_n, copy_bw, sum_bw, gemv_bw)


@dataclass
class Roofline:
    shape: str
    dtype: str
    params: int
    matmul_params: int
    weight_bytes: int  # bytes read per decode step (all matmul weights incl. the LM head)
    kv_bytes_per_token: int
    peak_flops: float
    bandwidth: float
    compute_bound_tok_s: float  # peak_flops / (2 * matmul_params)
    decode_bound_tok_s: float  # batch-1 decode: bandwidth / weight_bytes
    b_sat: float
    ridge_flop_per_byte: float

    def step_time(self, batch: int, context: int = 0) -> float:
        """Roofline estimate of one decode step (seconds) for `batch` sequences of `context` tokens."""
        compute = 2.0 * self.matmul_params * batch / self.peak_flops
        memory = (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.bandwidth
        return max(compute, memory)

    def fraction(self, measured_tok_s: float, batch: int = 1, context: int = 0) -> float:
        """Measured decode tokens/s over the roofline's bound for that batch."""
        return measured_tok_s / (batch / self.step_time(batch, context))

    def to_dict(self) -> dict:
        return asdict(self)


def roofline_for(shape: ModelShape, peaks: MachinePeaks, dtype: str = "float32") -> Roofline:
    nbytes = DTYPE_BYTES[dtype]
    mp = shape.matmul_params()
    w = mp * nbytes
    comp = peaks.matmul_flops / (2.0 * mp)
    dec = peaks.bandwidth / w
    return Roofline(shape=shape.name, dtype=dtype, params=shape.num_params(), matmul_params=mp, weight_bytes=w,
                    kv_bytes_per_token=shape.kv_bytes_per_token(nbytes), peak_flops=peaks.matmul_flops,
                    bandwidth=peaks.bandwidth, compute_bound_tok_s=comp, decode_bound_tok_s=dec,
                    b_sat=comp / dec, ridge_flop_per_byte=peaks.matmul_flops / peaks.bandwidth)


def shape_from_config(model_dir: str) -> ModelShape:
    """A ModelShape from a checkpoint's config.json (our random ones or real hub ones)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    arch = (c.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        arch = "Qwen3ForCausalLM" if c.get("model_type") == "qwen3" else "LlamaForCausalLM"
    return ModelShape(
        name=c.get("pagedserve_shape") or os.path.basename(os.path.normpath(model_dir)), architecture=arch,
        hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"], head_dim=c.get("head_dim"),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


def resolve_shape(name_or_dir: str) -> ModelShape:
    if os.path.isdir(name_or_dir):
        return shape_from_config(name_or_dir)
    return get_shape(name_or_dir)


def format_report(r: Roofline, peaks: MachinePeaks) -> str:
    g = 1e9
    lines = [
        "{s:{c}^{n}}".format(s=" Roofline ", n=50, c="="),
        f"{'Threads:':<40} {peaks.threads}",
        f"{'Peak matmul (GFLOP/s):':<40} {peaks.matmul_flops / g:.1f}  (n={peaks.matmul_size})",
        f"{'Copy bandwidth (GB/s, r+w):':<40} {peaks.copy_bandwidth / g:.1f}",
        f"{'Sum bandwidth (GB/s):':<40} {peaks.sum_bandwidth / g:.1f}",
        f"{'GEMV bandwidth (GB/s):':<40} {peaks.gemv_bandwidth / g:.1f}",
        f"{'Ridge point (FLOP/byte):':<40} {r.ridge_flop_per_byte:.2f}",
        "{s:{c}^{n}}".format(s=f" {r.shape} ({r.dtype}) ", n=50, c="-"),
        f"{'Params (M):':<40} {r.params / 1e6:.1f}",
        f"{'Matmul params incl. LM head (M):':<40} {r.matmul_params / 1e6:.1f}",
        f"{'Weight bytes per decode step (MB):':<40} {r.weight_bytes / 1e6:.1f}",
        f"{'KV bytes per token (KB):':<40} {r.kv_bytes_per_token / 1e3:.1f}",
        f"{'Compute bound (tok/s):':<40} {r.compute_bound_tok_s:.1f}",
        f"{'Batch-1 decode bound (tok/s):':<40} {r.decode_bound_tok_s:.1f}",
        f"{'Batch-1 decode step floor (ms):':<40} {1000 / r.decode_bound_tok_s:.2f}",
        f"{'B_sat (batch where compute = memory):':<40} {r.b_sat:.1f}",
        "=" * 50,
    ]
    return "\n".join(lines)
