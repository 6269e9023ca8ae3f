"""Batch-1 decode on GGUF files (Q4_0 / Q4_K_M / Q8_0 ...): pagedserve's block-quantized kernel vs llama-server on
the same file, and pagedserve's `--quantization int8` on the float checkpoint, alternated round by round, against
each format's weight-read bound (issue 52).

    python benchmarks/gguf_batch1.py --model /tmp/smol --gguf Q4_0=/tmp/smol-Q4_0.gguf --gguf Q8_0=/tmp/smol-Q8_0.gguf \\
        --llama-server /work/peers/llamacpp/build/bin/llama-server --rounds 3

Each round measures every engine once (batch1_alternating.py's rounds: pagedserve in process, the median engine step
of one request; llama-server's own timings.predicted_per_token_ms), so load drift hits them alike. The bound is
the bytes a decode step streams (every 2-D weight of the file but the embedding lookups: the head counts once; for
int8 one byte per weight of those tensors) over the memory bandwidth, measured before every round and after the last
(their median; the range is printed), so it sees the same load as the rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch1_alternating import llamacpp_round, pagedserve_round
from side_by_side import Server, find_llama_server, free_port


def streamed_bytes(gguf_path: str, one_byte_weights: bool = False) -> int:
    """Bytes of the weights one decode step reads: the 2-D tensors, the embedding only where it is the head;
    one_byte_weights: as int8 (the same tensors, a byte per weight)."""
    import gguf

    tensors = gguf.GGUFReader(gguf_path).tensors
    names = {t.name for t in tensors}
    return sum(int(t.n_elements if one_byte_weights else t.n_bytes) for t in tensors if len(t.shape) == 2
               and (t.name != "token_embd.weight" or "output.weight" not in names))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the float checkpoint the GGUF files were made from (int8 runs it)")
    p.add_argument("--gguf", action="append", required=True, help="LABEL=PATH, repeated")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from pagedserve.benchmarks.roofline import measure_peaks
    from pagedserve.entrypoints.llm import LLM

    files = dict(item.split("=", 1) for item in args.gguf)
    server_bin, _ = find_llama_server(args.llama_server)
    lengths = {"max_model_len": args.input_len + args.output_len + 16,
               "num_kv_blocks": (args.input_len + args.output_len) // 16 + 4, "num_threads": args.threads}
    load_before = os.getloadavg()[0]
    ours = {label: LLM(path, **lengths).llm_engine for label, path in files.items()}
    ours["int8"] = LLM(args.model, quantization="int8", **lengths).llm_engine
    servers = {}
    if server_bin is not None:
        for label, path in files.items():
            port = free_port()
            servers[label] = Server(f"llama.cpp {label}", [
                server_bin, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                "-c", str(args.input_len + args.output_len + 64), "-t", str(args.threads), "-tb", str(args.threads),
                "--cache-type-k", "f32", "--cache-type-v", "f32", "--no-webui"], port,
                f"/tmp/gguf_batch1_llama_{label}.log")
            servers[label].start(timeout=120)
    vocab = next(iter(ours.values())).model_config.vocab_size
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {}
    bandwidths: list[float] = []
    try:
        for engine in ours.values():  # warm-up
            pagedserve_round(engine, rng, args.input_len, 4)
        for server in servers.values():
            llamacpp_round(server.base_url, rng, args.input_len, 4, vocab)
        for i in range(args.rounds):
            bandwidths.append(measure_peaks((256,), 3, 256, args.threads).bandwidth)
            for label, engine in ours.items():
                times.setdefault(f"pagedserve {label}", []).append(
                    pagedserve_round(engine, rng, args.input_len, args.output_len))
            for label, server in servers.items():
                times.setdefault(f"llama.cpp {label}", []).append(
                    llamacpp_round(server.base_url, rng, args.input_len, args.output_len, vocab))
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in times.items()), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    bandwidths.append(measure_peaks((256,), 3, 256, args.threads).bandwidth)
    bw = statistics.median(bandwidths)
    print(f"\nbandwidth median {bw / 1e9:.1f} GB/s, range {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} "
          f"(before each round, after the last); load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("\n| engine | format | ms/token per round | median ms/token | tok/s | weight MB/token | bound / median |")
    print("|---|---|---|---:|---:|---:|---:|")
    int8_mb = streamed_bytes(next(iter(files.values())), one_byte_weights=True) / 1e6
    for name, ms in times.items():
        engine, label = name.split(" ", 1)
        mb = streamed_bytes(files[label]) / 1e6 if label in files else int8_mb
        med = statistics.median(ms)
        bound = f"{mb * 1e6 / bw * 1e3 / med:.0%}" if mb else "-"
        print(f"| {engine} | {label} | {', '.join(f'{t:.1f}' for t in ms)} | {med:.2f} | {1e3 / med:.1f} | "
              f"{f'{mb:.0f}' if mb else '-'} | {bound} |")
    median = {name: statistics.median(ms) for name, ms in times.items()}
    for label in files:
        ours_ms, theirs = median[f"pagedserve {label}"], median.get(f"llama.cpp {label}")
        vs_llama = f"{theirs / ours_ms:.2f}x llama.cpp's tok/s, " if theirs else ""
        print(f"{label}: pagedserve {vs_llama}{median['pagedserve int8'] / ours_ms:.2f}x our int8's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
