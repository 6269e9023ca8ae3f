"""What a structured-output constraint costs (issue 13): the same requests with and without a JSON-schema
constraint, in one process, alternating rounds; grammar compile time; mask time per step.

    python benchmarks/structured_output_overhead.py --model /work/peers/models/smollm2-135m \\
        --num-requests 32 --max-tokens 64 --rounds 2 --num-threads 2

One unmeasured warm-up round of every arm, then --rounds measured ones, arms alternating. Every request generates
exactly --max-tokens tokens in every arm: the free arm ignores EOS, and the constrained arms' schema (an array of at
least 10,000 small objects) cannot be complete before max_tokens, so tok/s compares the same amount of work. The
constrained arm runs with the masks as the engine picks them for these threads (--masks auto), or both ways
(--masks both): overlapped (every row's mask filled on a worker thread beside the forward) and checked first (rows
sampled without masks, only rejected rows masked on the engine thread); see engine/structured_output.py. "mask
ms/step" is the time spent filling masks per step, on whichever thread filled them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedserve import EngineArgs, SamplingParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import StructuredOutputsParams

LONG_SCHEMA = {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 8}},
    "required": ["id", "tag"], "additionalProperties": False}}
# A constraint a model keeps to: printable ASCII and newlines (the demo model, trained on Python sources, writes
# nothing else). Like the schema above it cannot end before max_tokens.
ASCII_REGEX = r"[\x20-\x7e\n]{0,100000}"
# Schemas for the compile-time measurement: nested objects, arrays, enums, required fields, $ref.
COMPILE_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}},
     "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d+$"},
                                                         "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                                 "y": {"type": "number"}}}}},
    {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]} for i in range(30)},
     "required": [f"field_{i}" for i in range(0, 30, 3)]},
    LONG_SCHEMA,
]


def run_arm(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, int]:
    """-> (output tok/s, mean step ms, steps)"""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    tokens = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        tokens += engine.last_iteration.num_generation_tokens
        steps += 1
    elapsed = time.perf_counter() - t0
    return tokens / elapsed, 1000 * elapsed / steps, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--constraint", choices=["json_schema", "ascii_regex"], default="json_schema",
                   help="json_schema: an array of objects (a random or tiny model mostly breaks it, so most rows "
                        "need their masks); ascii_regex: printable ASCII (a model that keeps to its constraint)")
    p.add_argument("--masks", choices=["auto", "overlapped", "checked-first", "both"], default="auto",
                   help="how the constrained arm runs its masks (auto: as the engine picks for these threads)")
    args = p.parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, num_threads=args.num_threads, dtype=args.dtype,
                                                   max_num_seqs=args.num_requests, enable_prefix_caching=False))
    vocab = engine.config.model.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.num_requests)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA)
                                 if args.constraint == "json_schema" else StructuredOutputsParams(regex=ASCII_REGEX))
    manager = engine.structured_output
    t0 = time.perf_counter()
    manager.ll_tokenizer  # built once per engine, on the first constrained request: measured apart
    tokenizer_ms = 1000 * (time.perf_counter() - t0)
    compile_ms = []
    for i, schema in enumerate(COMPILE_SCHEMAS):
        for salt in range(4):  # distinct keys: every compile is a cache miss
            t0 = time.perf_counter()
            manager.grammar(StructuredOutputsParams(json={**schema, "description": f"{i}-{salt}"}))
            compile_ms.append(1000 * (time.perf_counter() - t0))
    auto = "overlapped" if manager.overlap_masks else "checked-first"
    modes = {"auto": [auto], "both": ["overlapped", "checked-first"]}.get(args.masks, [args.masks])
    arms = [("free", free, None)] + [(f"{args.constraint} {mode}", constrained, mode == "overlapped") for mode in modes]
    rows: dict[str, list] = {name: [] for name, _, _ in arms}
    for _, params, overlap in arms:  # warm-up of every arm (first-use costs), not measured
        manager.overlap_masks = overlap if overlap is not None else manager.overlap_masks
        run_arm(engine, prompts, params)
    for _ in range(args.rounds):
        for name, params, overlap in arms:
            if overlap is not None:
                manager.overlap_masks = overlap
            before = manager.mask_time, manager.checked_rows, manager.rejected_rows
            tps, step_ms, steps = run_arm(engine, prompts, params)
            checked, rejected = manager.checked_rows - before[1], manager.rejected_rows - before[2]
            rows[name].append((tps, step_ms, 1000 * (manager.mask_time - before[0]) / steps,
                               rejected / checked if checked else None))
    compile_ms.sort()
    free_tps = statistics.median(r[0] for r in rows["free"])
    result = {
        "model": engine.config.model.path, "dtype": engine.config.model.dtype, "num_requests": args.num_requests,
        "input_len": args.input_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "constraint": args.constraint, "threads": torch.get_num_threads(), "engine_picks": auto,
        "arms": {name: {"tok_s": statistics.median(r[0] for r in rs), "step_ms": statistics.median(r[1] for r in rs),
                        "ratio": statistics.median(r[0] for r in rs) / free_tps,
                        "mask_ms_per_step": statistics.median(r[2] for r in rs),
                        "rejected_fraction": rs[0][3]} for name, rs in rows.items()},
        "compile_ms_p50": compile_ms[len(compile_ms) // 2], "compile_ms_max": compile_ms[-1],
        "grammar_tokenizer_build_ms": tokenizer_ms,
    }
    print(json.dumps(result, indent=2))
    print("| arm | output tok/s | ratio to free | step ms | mask fill ms/step | checked rows rejected |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for name, arm in result["arms"].items():
        rejected = "" if arm["rejected_fraction"] is None else f"{100 * arm['rejected_fraction']:.0f}%"
        print(f"| {name} | {arm['tok_s']:.1f} | {arm['ratio']:.2f}x | {arm['step_ms']:.1f} | "
              f"{arm['mask_ms_per_step']:.2f} | {rejected} |")
    print(f"{result['threads']} torch threads (the engine picks {auto}); grammar compile p50 "
          f"{result['compile_ms_p50']:.1f} ms, max {result['compile_ms_max']:.1f} ms over {len(compile_ms)} schemas "
          f"(llguidance tokenizer, once per engine: {tokenizer_ms:.0f} ms)")

if __name__ == "__main__":
    main()
