"""A decode step with the native decode-layer loop vs the Python layers, alternated in one engine.

    python benchmarks/decode_loop_ab.py --model /work/peers/models/smollm2-135m --cases int8:1:300 int8:32:300

Each case is PRECISION:BATCH:CONTEXT (precision float32, bfloat16 or int8: float32 activations, int8 weights).
Per case one engine; then `--rounds` rounds, alternating which path goes first: BATCH requests of CONTEXT random
prompt tokens are prefilled, and the median of `--steps` pure-decode steps is taken with the loop
(the model's `fused_decode`, layers/fused_decode.py over kernels/decode_layers.cpp) and with it switched off (the Python layers run the
same native ops one by one). Both paths compute the same tokens (tests/model_executor/test_decode_layers.py), so only the time
differs. Reported: every round's median step per path, and the ratio of the means.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def median_decode_step(engine, batch: int, context: int, steps: int, seed: int) -> float:
    """Median step (ms) over `steps` decode steps of `batch` requests whose prompts are all prefilled."""
    from pagedserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=steps + 30, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(f"{seed}-{i}", [rng.randrange(1000, 20000) for _ in range(context)], params)
    while not (len(engine.scheduler.running) == batch
               and all(r.num_computed_tokens >= context for r in engine.scheduler.running)):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def engine_for_case(case: str, args):
    """(LLM, batch, context) for a PRECISION:BATCH:CONTEXT case: room for BATCH requests of CONTEXT prompt tokens
    and `args.steps` decode steps, no prefix caching (every round prefills its own prompts)."""
    from pagedserve import LLM

    precision, batch, context = case.split(":")
    batch, context = int(batch), int(context)
    quantization = "int8" if precision == "int8" else None
    dtype = "float32" if quantization else precision
    llm = LLM(args.model, dtype=dtype, quantization=quantization, num_threads=args.num_threads,
              num_kv_blocks=2 * batch * (context + args.steps + 64) // 16 + 64, max_num_seqs=batch,
              max_model_len=context + args.steps + 64, enable_prefix_caching=False)
    return llm, batch, context


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--cases", nargs="+", default=["bfloat16:1:300", "bfloat16:32:300"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()

    for case in args.cases:
        llm, batch, context = engine_for_case(case, args)
        model = llm.llm_engine.runner.model
        native = model.fused_decode
        if native is None:
            raise SystemExit(f"{case}: this engine runs no native decode stack (no small GEMM for these weights)")
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for loop in ((True, False) if r % 2 == 0 else (False, True)):
                model.fused_decode = native if loop else None  # None: the Python layers run
                times[loop].append(median_decode_step(llm.llm_engine, batch, context, args.steps, seed=2 * r + loop))
        ratio = statistics.mean(times[False]) / statistics.mean(times[True])
        print(f"{case}: Python layers {' / '.join(f'{x:.2f}' for x in times[False])} ms, "
              f"native loop {' / '.join(f'{x:.2f}' for x in times[True])} ms, ratio {ratio:.3f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
