"""What a structured-output constraint costs (issue 13): the same requests with and without a JSON-schema
constraint, in one process, alternating rounds; grammar compile time; mask time per step.

    python benchmarks/structured_output_overhead.py --model /work/peers/models/smollm2-135m \\
        --num-requests 32 --max-tokens 64 --rounds 2 --num-threads 2

One unmeasured warm-up round of both arms, then --rounds measured ones. Every request generates exactly
--max-tokens tokens in both arms: the free arm ignores EOS, and the
constrained arm's schema (an array of at least 10,000 small objects) cannot be complete before max_tokens, so
tok/s compares the same amount of work. Masks are filled on a worker thread while the forward runs
(engine/structured_output.py); "mask ms/step" is that thread's time, "visible" what is left of it after the
forward: the constrained arm's extra step time.
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
    args = p.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, num_threads=args.num_threads, dtype=args.dtype,
                                  max_num_seqs=args.num_requests, enable_prefix_caching=False))
    vocab = engine.config.model.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.num_requests)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA))
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
    rows = {"free": [], "json_schema": []}
    mask_ms = []
    run_arm(engine, prompts, free)  # warm-up of both arms (first-use costs), not measured
    run_arm(engine, prompts, constrained)
    for _ in range(args.rounds):
        rows["free"].append(run_arm(engine, prompts, free))
        before = manager.mask_time
        tps, step_ms, steps = run_arm(engine, prompts, constrained)
        rows["json_schema"].append((tps, step_ms, steps))
        mask_ms.append(1000 * (manager.mask_time - before) / steps)
    free_tps = statistics.median(r[0] for r in rows["free"])
    cons_tps = statistics.median(r[0] for r in rows["json_schema"])
    free_step = statistics.median(r[1] for r in rows["free"])
    cons_step = statistics.median(r[1] for r in rows["json_schema"])
    compile_ms.sort()
    result = {
        "model": engine.config.model.path, "dtype": engine.config.model.dtype, "num_requests": args.num_requests,
        "input_len": args.input_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "free_tok_s": free_tps, "json_schema_tok_s": cons_tps, "ratio": cons_tps / free_tps,
        "free_step_ms": free_step, "json_schema_step_ms": cons_step, "mask_ms_per_step": statistics.median(mask_ms),
        "compile_ms_p50": compile_ms[len(compile_ms) // 2], "compile_ms_max": compile_ms[-1],
        "grammar_tokenizer_build_ms": tokenizer_ms,
    }
    print(json.dumps(result, indent=2))
    print(f"| arm | output tok/s | step ms |\n| --- | --- | --- |\n| free | {free_tps:.1f} | {free_step:.1f} |\n"
          f"| json_schema | {cons_tps:.1f} ({cons_tps / free_tps:.2f}x) | {cons_step:.1f} |")
    print(f"mask fill {result['mask_ms_per_step']:.2f} ms/step (worker thread, overlapped with the forward); "
          f"grammar compile p50 {result['compile_ms_p50']:.1f} ms, max {result['compile_ms_max']:.1f} ms "
          f"over {len(compile_ms)} schemas (llguidance tokenizer, once per engine: {tokenizer_ms:.0f} ms)")


if __name__ == "__main__":
    main()
