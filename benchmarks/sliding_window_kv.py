"""Gemma 3's sliding-window KV cache at a long context: KV bytes per token and decode speed, window on vs off.

    python benchmarks/sliding_window_kv.py [--layers 6] [--context 8192] [--decode 32] [--rounds 2]

A random-weight checkpoint of gemma-3-1b's shape (hidden 1152, 4 heads / 1 KV head of 256, MLP 6912, vocabulary
262144, window 512, five sliding layers to one full one) with --layers layers, and the same checkpoint with the
window off (every layer full attention: `sliding_window` removed from config.json). Each round serves one
--context-token prompt (chunked prefill, 2048-token budget) and --decode output tokens on each, alternating:

  * KV bytes per token: the most KV blocks in use at once (the pool's) x bytes per block / tokens of the request;
    with the window on the sliding layers hold about a window, the full layers the whole context
    (core/kv_cache_groups.py). Also the same figure for the whole 26-layer model, from its groups' layout.
  * decode tok/s: output tokens after the first over the time from the first to the last (one request).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

GEMMA3_1B = dict(hidden_size=1152, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 intermediate_size=6912, vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256,
                 rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, max_position_embeddings=32768,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
NUM_LAYERS_1B = 26
PATTERN = 6  # every sixth layer attends to everything


def layer_types(num_layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(num_layers)]


def make_checkpoint(out: Path, num_layers: int) -> None:
    """gemma-3-1b's shape with random weights in bfloat16 and the benchmark shapes' tokenizer of its vocabulary."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from pagedserve.benchmarks.shapes import ModelShape, build_tokenizer

    config = Gemma3TextConfig(num_hidden_layers=num_layers, layer_types=layer_types(num_layers), **GEMMA3_1B)
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    build_tokenizer(ModelShape("gemma-3-1b", "Gemma3ForCausalLM", GEMMA3_1B["hidden_size"], num_layers, 4, 1,
                               GEMMA3_1B["intermediate_size"], GEMMA3_1B["vocab_size"],
                               special_tokens=((1, "<eos>"), (2, "<bos>")), eos="<eos>")).save_pretrained(out)


def window_off(src: Path, out: Path) -> None:
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["sliding_window"] = None
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(cfg))


def serve_one(llm, prompt: list[int], num_decode: int) -> tuple[int, int, float, float]:
    """(most KV blocks in use at once, most in use while decoding, prefill seconds, decode tok/s) for one
    request."""
    from pagedserve import SamplingParams

    engine = llm.llm_engine
    pool = engine.kv_cache_manager.block_pool
    engine.add_request("r", prompt, SamplingParams(max_tokens=num_decode, ignore_eos=True, temperature=0.0))
    peak, held, times = 0, 0, []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        used = pool.num_used_blocks  # before the step: a finished request's blocks are gone after it
        if engine.step():
            times.append(time.perf_counter())
        peak = max(peak, used, pool.num_used_blocks)
        if len(times) > 1 and engine.has_unfinished_requests():  # a decode step's blocks (the sliding groups freed)
            held = max(held, pool.num_used_blocks)
    return peak, held, times[0] - t0, (len(times) - 1) / (times[-1] - times[0])


def whole_model_kv_bytes_per_token(context: int, block_size: int, per_layer_block: int) -> tuple[float, float]:
    """(window on, window off) KV bytes per token of the 26-layer model at `context` tokens: each group holds its
    layers' share of a block (the full group the whole context, each sliding group a window and a chunk)."""
    from pagedserve.core.kv_cache_groups import make_kv_cache_groups

    window = GEMMA3_1B["sliding_window"]
    groups = make_kv_cache_groups([None if t == "full_attention" else window for t in layer_types(NUM_LAYERS_1B)])
    group_size = max(len(g.layers) for g in groups)
    blocks = sum(-(-context // block_size) if g.sliding_window is None else -(-(window - 1) // block_size) + 1
                 for g in groups)
    on = blocks * group_size * per_layer_block / context
    return on, NUM_LAYERS_1B * per_layer_block * -(-context // block_size) / context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve import LLM

    tmp = Path(tempfile.mkdtemp(prefix="sliding_kv_"))
    try:
        make_checkpoint(tmp / "on", args.layers)
        window_off(tmp / "on", tmp / "off")
        max_len = args.context + args.decode
        llms = {name: LLM(str(tmp / name), num_threads=args.threads, dtype="bfloat16", max_model_len=max_len,
                          num_kv_blocks=-(-max_len // 16) + 8, max_num_batched_tokens=2048,
                          enable_prefix_caching=False)
                for name in ("on", "off")}
        prompt = torch.randint(10, GEMMA3_1B["vocab_size"], (args.context,), generator=torch.Generator().manual_seed(1))
        results: dict[str, list] = {"on": [], "off": []}
        for r in range(args.rounds):
            for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
                result = serve_one(llms[name], prompt.tolist(), args.decode)
                results[name].append(result)
                print(f"round {r} window {name}: blocks peak {result[0]}, while decoding {result[1]}; prefill "
                      f"{result[2]:.1f} s, decode {result[3]:.2f} tok/s, load {os.getloadavg()[0]:.1f}", flush=True)
        print(f"\n{args.layers} layers of gemma-3-1b, {args.context}-token prompt, {args.decode} decoded, bf16")
        print("| window | KV bytes/token while decoding | at the prefill's peak | prefill s | decode tok/s |\n"
              "|---|---|---|---|---|")
        tokens = args.context + args.decode
        for name, llm in llms.items():
            per_block = llm.llm_engine.runner.kv_bytes_per_block
            peak, held = max(r[0] for r in results[name]), max(r[1] for r in results[name])
            prefill, tps = (sorted(r[i] for r in results[name])[len(results[name]) // 2] for i in (2, 3))
            print(f"| {name} | {held * per_block / tokens:,.0f} | {peak * per_block / tokens:,.0f} | {prefill:.1f} "
                  f"| {tps:.2f} |")
        per_layer = llms["off"].llm_engine.runner.kv_bytes_per_block // args.layers
        on, off = whole_model_kv_bytes_per_token(args.context, 16, per_layer)
        print(f"26-layer gemma-3-1b from its groups: {on:,.0f} vs {off:,.0f} KV bytes/token ({off / on:.1f}x)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
