"""Embedding throughput (issue 54): sentences per second at batch 32, pagedserve's pooling runner (`LLM.embed`) vs
sentence-transformers' `encode(batch_size=32)` on the same checkpoint, dtype and thread count, in one process with
the two alternating round by round (this machine's speed drifts; a paired ratio per round is what is reported).

    python benchmarks/embedding_throughput.py [--shape small|qwen3-0.6b|minilm|bert-base] [--threads 1] [--rounds 5]
        [--tokens 64]

The checkpoint is a random-weight Qwen3 or BERT of the chosen shape (tests/tiny_pooling_models.py, the tiny
tokenizer's 768-token vocabulary), saved with sentence-transformers' modules (Qwen3: last-token pooling, normalised:
the Qwen3-Embedding recipe; BERT: mean pooling, normalised: all-MiniLM-L6-v2's), so both engines read the same
files. Each round embeds the same 32 sentences of about
`--tokens` tokens; before timing, the lowest cosine similarity between the two engines' embeddings is printed
(1.0000 in float32; ~0.99 in bfloat16, where the two round differently).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SHAPES = {  # Qwen3 config overrides
    "small": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=64),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
}
ENCODER_SHAPES = {  # BERT config overrides: all-MiniLM-L6-v2's and bert-base's
    "minilm": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12),
    "bert-base": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
}
BATCH = 32


def max_model_len(shape: str) -> int:
    return 512 if shape in ENCODER_SHAPES else 4096


def make_benchmark_inputs(shape: str, tokens_per_sentence: int) -> tuple[Path, list[str], int]:
    """(checkpoint directory, the BATCH sentences, their tokens in all) for a shape: a random-weight checkpoint with
    sentence-transformers' modules, saved to a fresh temporary directory."""
    from tiny_models import build_tiny_tokenizer, tiny_corpus
    from tiny_pooling_models import (build_encoder_tokenizer, make_tiny_embedding_checkpoint,
                                     make_tiny_encoder_checkpoint)

    out = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    if shape in ENCODER_SHAPES:
        tokenizer = build_encoder_tokenizer("bert")
        path = make_tiny_encoder_checkpoint("bert", out, tokenizer=tokenizer, pooling="mean", **ENCODER_SHAPES[shape])
    else:
        tokenizer = build_tiny_tokenizer()
        path = make_tiny_embedding_checkpoint("qwen3", out, tokenizer=tokenizer,
                                              max_position_embeddings=max_model_len(shape), **SHAPES[shape])
    ids = tokenizer.encode(" ".join(tiny_corpus()[:400]), add_special_tokens=False)
    sentences = [tokenizer.decode(ids[i * tokens_per_sentence:(i + 1) * tokens_per_sentence]) for i in range(BATCH)]
    return path, sentences, sum(len(tokenizer.encode(s)) for s in sentences)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(ENCODER_SHAPES), default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="about this many tokens per sentence")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM

    torch.set_num_threads(args.threads)
    path, sentences, num_tokens = make_benchmark_inputs(args.shape, args.tokens)

    st = SentenceTransformer(str(path), device="cpu", model_kwargs={"dtype": getattr(torch, args.dtype)})
    llm = LLM(str(path), runner="pooling", dtype=args.dtype, num_threads=args.threads, max_num_seqs=BATCH,
              max_num_batched_tokens=max(2048, num_tokens), max_model_len=max_model_len(args.shape),
              enable_prefix_caching=False)
    torch.set_num_threads(args.threads)

    def run_st():
        return st.encode(sentences, batch_size=BATCH, convert_to_tensor=True)

    def run_ps():
        return torch.tensor([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)])

    cos = F.cosine_similarity(run_ps(), run_st().float(), dim=-1)
    print(f"shape {args.shape}, {args.dtype}, {args.threads} thread(s), batch {BATCH}, {num_tokens} tokens; "
          f"min cosine vs sentence-transformers {cos.min().item():.6f}")
    # wall time, and the process's CPU time (all its threads): on a loaded machine the wall time includes the time
    # other jobs held the cores, the CPU time does not
    times: dict[str, list[float]] = {"pagedserve": [], "sentence-transformers": []}
    cpu_times: dict[str, list[float]] = {"pagedserve": [], "sentence-transformers": []}
    for r in range(args.rounds):
        order = [("pagedserve", run_ps), ("sentence-transformers", run_st)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(time.process_time() - c0)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| engine | sentences/s (median of rounds) | tokens/s | CPU ms per sentence (median) |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {BATCH / med:.1f} | {num_tokens / med:.0f} | "
              f"{1000 * statistics.median(cpu_times[name]) / BATCH:.2f} |")
    print_paired_ratios({"wall": times, "CPU": cpu_times}, "sentence-transformers")
    return 0


def print_paired_ratios(times_by_clock: dict[str, dict[str, list[float]]], peer: str) -> None:
    """pagedserve's speed over `peer`'s, round by round (each round ran both), per clock: median [min-max]."""
    for label, times in times_by_clock.items():
        ratios = [v / p for p, v in zip(times["pagedserve"], times[peer])]
        print(f"pagedserve / {peer} per round ({label} time): median {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
