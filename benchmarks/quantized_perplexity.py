"""Perplexity of the demo model (pagedserve/demo_model) in each weight format, scored by the engine itself (prompt
logprobs over the held-out windows of its model card, tools/eval_demo_model.py), all with float32 activations:

  float32; --quantization int8 and int4 (quantized as the float weights load); and pre-quantized checkpoints written
  from the same weights by the tests' packers (tests/quantized_checkpoints.py), loaded through their formats' paths:
  GPTQ and AWQ (int4, groups of 128, zero points), compressed-tensors W4A16 (groups of 128) and W8A8 int8.

The 4-bit files are round-to-nearest, not GPTQ's / AWQ's own calibrated rounding: they measure the format's path and
its grid (what the file costs against float32 with the plainest rounding), not those algorithms.

    python benchmarks/quantized_perplexity.py [--max-tokens 4096] [--threads 1]
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tools/ and the tests' packers, outside the package

from quantized_checkpoints import quantize_checkpoint  # noqa: E402
from tools.eval_demo_model import held_out_windows  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.demo_model_path import default_model_path  # noqa: E402


def perplexity(model: str, quantization: str | None, windows: list[list[int]], threads: int) -> tuple[float, float]:
    """(perplexity, seconds) of the engine on `windows`: every token after a window's first, scored in context."""
    llm = LLM(model, quantization=quantization, dtype="float32", num_threads=threads, num_kv_blocks=512)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=windows, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    seconds = time.perf_counter() - t0
    nll = [-entry[token].logprob for window, out in zip(windows, outs)
           for token, entry in zip(window[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll)), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = Path(default_model_path())
    windows = [list(map(int, w)) for w in held_out_windows(demo, max_tokens=args.max_tokens)]
    tokens = sum(len(w) - 1 for w in windows)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [("float32", str(demo), None), ("int8 (--quantization)", str(demo), "int8"),
                ("int4 RTN g128 (--quantization)", str(demo), "int4")]
        for fmt, label in (("gptq", "GPTQ file, int4 g128"), ("awq", "AWQ file, int4 g128"),
                           ("ct-w4a16", "compressed-tensors W4A16 g128"), ("ct-w8a8", "compressed-tensors W8A8")):
            ckpt, _ = quantize_checkpoint(demo, fmt, Path(tmp) / fmt, group_size=128)
            rows.append((label, str(ckpt), None))
        results = [(label, *perplexity(model, quant, windows, args.threads)) for label, model, quant in rows]
    base = results[0][1]
    print(f"demo model, {tokens} held-out tokens in {len(windows)} windows, float32 activations, "
          f"{args.threads} thread(s)\n")
    print("| weights | perplexity | vs float32 | scoring s |\n|---|---|---|---|")
    for label, ppl, seconds in results:
        delta = "-" if label == "float32" else f"{100 * (ppl / base - 1):+.2f}%"
        print(f"| {label} | {ppl:.2f} | {delta} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
