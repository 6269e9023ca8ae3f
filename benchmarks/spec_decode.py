"""Speculative decoding, off vs n-gram vs draft model, on a workload where it should pay (code edits: the prompt
holds a function and the output copies it back with a small change) and on one where it should not hurt (random
token prompts). One process, every arm an engine of its own, rounds alternating between arms, closed loop at
each concurrency (C requests in flight, the next one added when one finishes). Greedy, exact output lengths.

    python benchmarks/spec_decode.py --concurrency 1,4,16,32 --rounds 3 --num-threads 1

Reported per arm: output tok/s over the wall time (median of rounds) and per CPU-second of this process (with one
thread, the work itself: on a machine shared with other processes the wall time swings, the CPU time much less).

The model is the embedded demo model (trained on the Python standard library; random weights would accept
nothing). The draft model is the demo model's first --draft-layers layers with its final norm and LM head (an
early-exit draft written as a real checkpoint into --work-dir: same tokenizer, its own KV cache in the engine).
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import random
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedserve import EngineArgs, SamplingParams
from pagedserve.demo_model_path import default_model_path
from pagedserve.engine.llm_engine import LLMEngine


def make_early_exit_draft(target_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """A draft checkpoint: the target's first `num_layers` layers, embeddings, final norm and LM head."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    keep = {k: v for k, v in load_file(target_dir / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, out_dir / "model.safetensors")
    for name in os.listdir(target_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json",
                                                     "chat_template.jinja"):
            (out_dir / name).write_bytes((target_dir / name).read_bytes())
    return out_dir


def code_edit_prompts(tokenizer, n: int, seed: int, min_tokens: int = 80, max_tokens: int = 400) -> list[list[int]]:
    """Functions of the standard library, then a comment asking for the same function with one name changed,
    then its first quarter with the change made: the continuation is mostly a copy of the prompt."""
    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))
    rng.shuffle(files)
    prompts = []
    for path in files:
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        source = path.read_text().splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.args.args:
                continue
            func = "\n".join(source[node.lineno - 1:node.end_lineno])
            old = node.args.args[0].arg
            new = old + "_value"
            edited = func.replace(old, new).splitlines()
            head = "\n".join(edited[:max(2, len(edited) // 4)])  # the edit has started: the rest is a copy
            text = f"{func}\n\n\n# The same function, with `{old}` renamed to `{new}`:\n{head}"
            ids = tokenizer.encode(text)
            if min_tokens <= len(ids) <= max_tokens:
                prompts.append(ids)
                break
        if len(prompts) == n:
            return prompts
    return prompts


def random_prompts(vocab_size: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(32, 400))] for _ in range(n)]


def run_closed_loop(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int,
                    tag: str) -> tuple[float, float, dict[str, list[int]]]:
    """(wall seconds, this process's CPU seconds, outputs by prompt index): C requests in flight, the next added as
    soon as one finishes. With one thread the CPU time is the work itself, little moved by other processes on a
    shared machine (the wall time is what a user sees)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(range(len(prompts)))
    outputs: dict[str, list[int]] = {}
    in_flight = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i = pending.pop(0)
            engine.add_request(f"{tag}-{i}", prompts[i], params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id.rsplit("-", 1)[1]] = out.outputs[0].token_ids
                in_flight -= 1
    return time.perf_counter() - t0, time.process_time() - c0, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--num-prompts", type=int, default=0, help="per concurrency; default max(4, 2 * C)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ngram", default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
                                       '"prompt_lookup_max": 4}')
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--work-dir", default="/tmp/pagedserve-spec-bench")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    target = Path(default_model_path())
    draft = make_early_exit_draft(target, Path(args.work_dir) / f"demo-draft-{args.draft_layers}l", args.draft_layers)
    common = dict(dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=64, num_kv_blocks=4096)
    arms = {
        "off": EngineArgs(**common),
        "ngram": EngineArgs(**common, speculative_config=args.ngram),
        "draft": EngineArgs(**common, speculative_config={"model": str(draft), "num_speculative_tokens": args.draft_k}),
    }
    engines = {name: LLMEngine.from_engine_args(a) for name, a in arms.items()}
    tokenizer = engines["off"].tokenizer
    workloads = {"code-edit": lambda n, s: code_edit_prompts(tokenizer, n, s),
                 "random": lambda n, s: random_prompts(engines["off"].model_config.vocab_size, n, s)}
    rows = []
    for workload, make in workloads.items():
        for c in [int(x) for x in args.concurrency.split(",")]:
            prompts = make(args.num_prompts or max(4, 2 * c), 1000 + c)
            for engine in engines.values():  # warm-up, unmeasured
                run_closed_loop(engine, prompts[:1], 1, 8, "warm")
            times: dict[str, list[float]] = {name: [] for name in engines}
            cpu_times: dict[str, list[float]] = {name: [] for name in engines}
            outputs: dict[str, dict] = {}
            spec: dict[str, tuple[int, int, int]] = {}
            for r in range(args.rounds):
                for name, engine in (engines.items() if r % 2 == 0 else reversed(engines.items())):
                    before = engine.scheduler.spec_stats.snapshot()
                    dt, cpu, outs = run_closed_loop(engine, prompts, c, args.max_tokens, f"{name}{r}")
                    after = engine.scheduler.spec_stats
                    times[name].append(dt)
                    cpu_times[name].append(cpu)
                    outputs[name] = outs
                    d = spec.get(name, (0, 0, 0))
                    spec[name] = (d[0] + after.num_drafts - before.num_drafts,
                                  d[1] + after.num_draft_tokens - before.num_draft_tokens,
                                  d[2] + after.num_accepted_tokens - before.num_accepted_tokens)
            tokens = len(prompts) * args.max_tokens
            base = tokens / statistics.median(times["off"])
            cpu_base = tokens / statistics.median(cpu_times["off"])
            for name in engines:
                tps = tokens / statistics.median(times[name])
                cpu_tps = tokens / statistics.median(cpu_times[name])
                drafts, drafted, accepted = spec[name]
                row = dict(workload=workload, concurrency=c, arm=name, num_prompts=len(prompts),
                           output_tok_s=round(tps, 1), vs_off=round(tps / base, 3),
                           output_tok_per_cpu_s=round(cpu_tps, 1), cpu_vs_off=round(cpu_tps / cpu_base, 3),
                           identical_to_off=outputs[name] == outputs["off"],
                           acceptance_rate=round(accepted / drafted, 3) if drafted else None,
                           mean_acceptance_length=round(1 + accepted / drafts, 2) if drafts else None,
                           drafts_per_output_token=round(drafts / (tokens * args.rounds), 3),
                           times_s=[round(t, 2) for t in times[name]],
                           cpu_times_s=[round(t, 2) for t in cpu_times[name]])
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; torch {torch.__version__}; threads {args.num_threads}")
    print("| workload | C | arm | output tok/s | vs off | tok per CPU-s | vs off (CPU) | identical | acceptance rate "
          "| mean acceptance length |")
    print("|---|---:|---|---:|---:|---:|---:|:---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['concurrency']} | {r['arm']} | {r['output_tok_s']} | {r['vs_off']:.2f}x | "
              f"{r['output_tok_per_cpu_s']} | {r['cpu_vs_off']:.2f}x | "
              f"{'yes' if r['identical_to_off'] else 'NO'} | {r['acceptance_rate'] if r['acceptance_rate'] is not None else '-'} | "
              f"{r['mean_acceptance_length'] or '-'} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
