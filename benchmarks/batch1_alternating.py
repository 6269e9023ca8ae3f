"""Batch-1 decode, pagedserve vs llama-server, alternated round by round, against the weight-read bound.

    python benchmarks/batch1_alternating.py --model /tmp/smollm2 --gguf /tmp/smollm2-f32.gguf \\
        --llama-server /tmp/llamacpp/build/bin/llama-server --rounds 5

A single batch-1 measurement on this VM moves by 30% and more from one minute to the next (its neighbours'
load), so one number per engine says little about their ratio. Here each round measures both: pagedserve
(in process, one request decoding, median engine step over `--output-len` steps) and then llama-server (one
/completion of the same lengths alone, its own `timings.predicted_per_token_ms`); the machine's bandwidth is
measured before the first round and after the last. Reported: every round, the median per engine, and the
bound / measured fraction per round. Needs llama-server and the GGUF (see benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side import Server, find_llama_server, free_port, llamacpp_ms_per_token  # noqa: E402


def pagedserve_round(engine, rng, input_len: int, output_len: int) -> float:
    """Median engine step (ms) while one request decodes `output_len` tokens after a prompt of `input_len`."""
    from pagedserve.sampling_params import SamplingParams

    engine.add_request(f"r{time.monotonic_ns()}", rng.integers(0, engine.model_config.vocab_size, input_len).tolist(),
                       SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0))
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return statistics.median(steps) * 1e3


def llamacpp_round(base_url: str, rng, input_len: int, output_len: int, vocab: int) -> float:
    ms = llamacpp_ms_per_token(base_url, rng.integers(3, vocab, input_len).tolist(), output_len)
    if ms is None:
        raise RuntimeError("llama-server /completion gave no timings")
    return ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama-server", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from pagedserve.benchmarks.roofline import measure_peaks, roofline_for, shape_from_config
    from pagedserve.entrypoints.llm import LLM

    server_bin, _ = find_llama_server(args.llama_server)
    if server_bin is None:
        raise SystemExit("llama-server not found (see benchmarks/README.md)")
    peaks = measure_peaks((1024,), 3, 256, args.threads, device="cpu", dtype="float32")
    roof = roofline_for(shape_from_config(args.model), peaks, "float32")
    bandwidths = [peaks.bandwidth]
    llm = LLM(args.model, num_threads=args.threads, max_model_len=args.input_len + args.output_len + 16,
              num_kv_blocks=(args.input_len + args.output_len) // 16 + 4)
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    port = free_port()
    server = Server("llama.cpp", [server_bin, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                                  "-c", str(args.input_len + args.output_len + 64), "-t", str(args.threads),
                                  "-tb", str(args.threads), "--cache-type-k", "f32", "--cache-type-v", "f32",
                                  "--no-webui"], port, "/tmp/batch1_llama_server.log")
    server.start(timeout=120)
    rng = np.random.default_rng(0)
    rows = []
    try:
        pagedserve_round(engine, rng, args.input_len, 8)  # warm-up of both
        llamacpp_round(server.base_url, rng, args.input_len, 8, vocab)
        for i in range(args.rounds):
            rows.append((pagedserve_round(engine, rng, args.input_len, args.output_len),
                         llamacpp_round(server.base_url, rng, args.input_len, args.output_len, vocab)))
            print(f"round {i + 1}: pagedserve {rows[-1][0]:.2f} ms/token, llama.cpp {rows[-1][1]:.2f} ms/token",
                  flush=True)
    finally:
        server.stop()
    bandwidths.append(measure_peaks((1024,), 3, 256, args.threads, device="cpu", dtype="float32").bandwidth)
    bound_ms = [roof.weight_bytes / bw * 1e3 for bw in bandwidths]
    bound = statistics.median(bound_ms)
    ps, lc = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    print(f"\nweight-read bound: {roof.weight_bytes / 1e6:.0f} MB / {min(bandwidths) / 1e9:.1f}-"
          f"{max(bandwidths) / 1e9:.1f} GB/s (before / after) = {min(bound_ms):.2f}-{max(bound_ms):.2f} ms/token")
    print("\n| engine | " + " | ".join(f"round {i + 1}" for i in range(len(rows))) + " | median (ms/token) | bound / median |")
    print("|---|" + "---:|" * (len(rows) + 2))
    for name, k, med in (("pagedserve", 0, ps), ("llama.cpp", 1, lc)):
        print(f"| {name} | " + " | ".join(f"{r[k]:.1f}" for r in rows) + f" | {med:.1f} | {bound / med:.0%} |")
    print(f"\npagedserve / llama.cpp per round: " + ", ".join(f"{r[0] / r[1]:.2f}" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
