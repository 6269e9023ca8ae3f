"""`bench throughput` (offline, QPS = inf, via LLM.generate) and `bench latency` (fixed batch; decode
step time vs batch size against the roofline)."""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from pagedserve.benchmarks import datasets as ds
from pagedserve.benchmarks import driver
from pagedserve.benchmarks.plotting import pyplot


# ---------------------------------------------------------------------------------------
# throughput


def add_throughput_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput: every request at once through LLM.generate")
    driver.add_engine_args(p)
    ds.add_dataset_args(p, default_dataset="random", default_num_prompts=1000, with_tokenizer=False)
    p.add_argument("--input-len", type=int, default=None, help="alias of --random-input-len")
    p.add_argument("--output-len", type=int, default=None, help="alias of --random-output-len")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--roofline-json", default=None,
                   help="peaks from `bench roofline --output-json`: also report the fraction of the compute bound")
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_throughput)


def _make_llm(args: argparse.Namespace, **overrides):
    from pagedserve.entrypoints.llm import LLM

    return LLM.from_engine_args(driver.engine_args_from(args, **overrides))


def _generate(llm, prompts: list[list[int]], params, use_tqdm: bool):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=use_tqdm)


def run_throughput(args: argparse.Namespace) -> int:
    from pagedserve.sampling_params import SamplingParams

    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_len
    llm = _make_llm(args)
    engine = llm.llm_engine
    samples = ds.get_samples(args, engine.tokenizer, None, vocab_cap=driver.vocab_of(engine))
    print(f"workload: {args.dataset_name}: {ds.describe(samples)}")
    params = [SamplingParams(max_tokens=s.expected_output_len, ignore_eos=True, temperature=args.temperature,
                             top_p=1.0) for s in samples]
    prompts = [list(s.prompt) for s in samples]
    driver.warm_up(engine, driver.vocab_of(engine))
    t0 = time.perf_counter()
    outputs = _generate(llm, prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - t0
    in_tokens = sum(len(p) for p in prompts)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = in_tokens + out_tokens
    print(f"Throughput: {len(samples) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{out_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {in_tokens}")
    print(f"Total num output tokens:  {out_tokens}")
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(samples),
        "total_num_tokens": total,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "requests_per_second": len(samples) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": out_tokens / elapsed,
        "model": args.model,
        "dataset_name": args.dataset_name,
        "engine_args": _engine_args_dict(args),
    }
    if args.roofline_json and args.model:
        from pagedserve.benchmarks.roofline import MachinePeaks, resolve_shape, roofline_for

        with open(args.roofline_json) as f:
            peaks = MachinePeaks(**json.load(f)["machine"])
        roof = roofline_for(resolve_shape(args.model), peaks, _engine_dtype(getattr(engine.runner, "dtype", None)))
        frac = (total / elapsed) / roof.compute_bound_tok_s
        print(f"Compute bound (every token costs 2 x {roof.matmul_params / 1e6:.1f}M FLOPs): "
              f"{roof.compute_bound_tok_s:.1f} tokens/s; this run reached {100 * frac:.1f}% of it")
        result["roofline"] = roof.to_dict()
        result["fraction_of_compute_bound"] = frac
    if args.output_json:
        _write_json(args.output_json, result)
    return 0


# ---------------------------------------------------------------------------------------
# latency


def add_latency_parser(sub) -> None:
    p = sub.add_parser("latency", help="latency of one batch; --batch-sizes sweeps decode step time vs batch")
    driver.add_engine_args(p)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--batch-sizes", default=None,
                   help="comma list (e.g. 1,2,4,8,16,32,64,128): sweep the decode step time over batch size "
                        "and plot it against the roofline")
    p.add_argument("--shape", default=None, help="shape name for the roofline (default: read --model's config)")
    p.add_argument("--roofline-json", default=None, help="reuse peaks saved by `bench roofline --output-json`")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path for the sweep plot (default: next to --output-json)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_latency)


def run_latency(args: argparse.Namespace) -> int:
    if args.batch_sizes:
        return run_batch_sweep(args)
    from pagedserve.sampling_params import SamplingParams

    llm = _make_llm(args, max_num_seqs=max(args.max_num_seqs, args.batch_size))
    engine = llm.llm_engine
    vocab = driver.vocab_of(engine)
    space = ds.token_space_from_tokenizer(engine.tokenizer) if engine.tokenizer is not None else ds.TokenSpace(vocab)
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, top_p=1.0)

    def run_once() -> float:
        # fresh random prompts every iteration: repeating them would hit the prefix cache (seed 004)
        prompts = [space.sample(rng, args.input_len) for _ in range(args.batch_size)]
        t = time.perf_counter()
        _generate(llm, prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    for _ in range(args.num_iters_warmup):
        run_once()
    latencies = []
    from tqdm import tqdm

    for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm):
        latencies.append(run_once())
    lat = np.array(latencies)
    pcts = [10, 25, 50, 75, 90, 99]
    print(f"Avg latency: {lat.mean():.4f} seconds")
    for p in pcts:
        print(f"{p}% percentile latency: {np.percentile(lat, p):.4f} seconds")
    result = {
        "avg_latency": float(lat.mean()),
        "latencies": lat.tolist(),
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in pcts},
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "avg_per_token_ms": float(lat.mean() / args.output_len * 1000),
        "engine_args": _engine_args_dict(args),
    }
    if args.output_json:
        _write_json(args.output_json, result)
    return 0


def run_batch_sweep(args: argparse.Namespace) -> int:
    """Median decode step time for each batch size B (steps where all B requests decode)."""
    from pagedserve.benchmarks.roofline import MachinePeaks, measure_peaks, resolve_shape, roofline_for

    sizes = sorted({int(x) for x in args.batch_sizes.split(",") if x.strip()})
    bmax = max(sizes)
    if args.plot or args.output_json:
        pyplot()  # the sweep ends in a plot: fail now, not after it, when matplotlib is missing
    ea = driver.engine_args_from(args, max_num_seqs=max(args.max_num_seqs, bmax))
    engine = driver.build_engine(ea)
    vocab = driver.vocab_of(engine)
    space = ds.token_space_from_tokenizer(engine.tokenizer)
    driver.warm_up(engine, vocab)
    rng = np.random.default_rng(args.seed)
    rows = []
    from tqdm import tqdm

    for b in tqdm(sizes, desc="batch sizes", disable=args.disable_tqdm):
        samples = [ds.SampleRequest(p := space.sample(rng, args.input_len), len(p), args.output_len,
                                    request_id=f"b{b}-{i}") for i in range(b)]
        res = driver.run_trace(engine, samples, f"B={b}")
        decode = [s for s in res.steps if s.prompt_tokens == 0 and s.num_reqs == b]
        if not decode:
            decode = [s for s in res.steps if s.prompt_tokens == 0]
        st = np.array([s.step_time for s in decode]) if decode else np.array([np.nan])
        ft = np.array([s.forward_time for s in decode]) if decode else np.array([np.nan])
        med = float(np.median(st))
        rows.append({"batch_size": b, "num_decode_steps": len(decode), "step_ms_median": med * 1000,
                     "step_ms_p10": float(np.percentile(st, 10)) * 1000,
                     "step_ms_p90": float(np.percentile(st, 90)) * 1000,
                     "forward_ms_median": float(np.median(ft)) * 1000,
                     "decode_tok_s": b / med if med > 0 else 0.0,
                     "context_mid": args.input_len + args.output_len // 2})
    device = _engine_device(engine)
    engine_dtype = getattr(engine.runner, "dtype", None)
    engine = None
    driver.release()

    shape = resolve_shape(args.shape or args.model)
    if args.roofline_json:
        with open(args.roofline_json) as f:
            peaks = MachinePeaks(**json.load(f)["machine"])
    else:
        print("measuring machine peaks for the roofline ...")
        peaks = measure_peaks(threads=args.num_threads, device=device, dtype=_engine_dtype(engine_dtype))
    dtype = _engine_dtype(engine_dtype)
    roof = roofline_for(shape, peaks, dtype)
    for r in rows:
        est = roof.step_time(r["batch_size"], r["context_mid"])
        r["roofline_step_ms"] = est * 1000
        r["fraction_of_roofline"] = est * 1000 / r["step_ms_median"] if r["step_ms_median"] else 0.0
    # measured B_sat: the largest B whose step time is within 20% of the B=1 time
    base = rows[0]["step_ms_median"]
    flat = [r["batch_size"] for r in rows if r["step_ms_median"] <= 1.2 * base]
    b_sat_measured = max(flat) if flat else sizes[0]

    print("{s:{c}^{n}}".format(s=" Decode step time vs batch size ", n=72, c="="))
    print(f"{'B':>5} {'step ms (p50)':>14} {'p10':>8} {'p90':>8} {'tok/s':>10} {'roofline ms':>12} {'% of roof':>10}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['step_ms_median']:>14.2f} {r['step_ms_p10']:>8.2f} {r['step_ms_p90']:>8.2f} "
              f"{r['decode_tok_s']:>10.1f} {r['roofline_step_ms']:>12.2f} {100 * r['fraction_of_roofline']:>9.0f}%")
    print(f"B_sat (roofline, {shape.name}, {dtype}): {roof.b_sat:.1f}")
    print(f"B_sat (measured: largest B within 20% of the B=1 step time): {b_sat_measured}")
    print(f"batch-1 decode bound: {roof.decode_bound_tok_s:.1f} tok/s; compute bound: {roof.compute_bound_tok_s:.1f} tok/s")
    result = {"rows": rows, "b_sat_roofline": roof.b_sat, "b_sat_measured": b_sat_measured,
              "roofline": roof.to_dict(), "machine": peaks.__dict__, "input_len": args.input_len,
              "output_len": args.output_len, "engine_args": _engine_args_dict(args)}
    plot = args.plot or (os.path.splitext(args.output_json)[0] + ".png" if args.output_json else None)
    if plot:
        plot_sweep(rows, roof, b_sat_measured, plot)
        result["plot"] = plot
        print(f"saved {plot}")
    if args.output_json:
        _write_json(args.output_json, result)
    return 0


def plot_sweep(rows: list[dict], roof, b_sat_measured: int, path: str) -> None:
    plt = pyplot()

    b = np.array([r["batch_size"] for r in rows], dtype=float)
    ms = np.array([r["step_ms_median"] for r in rows])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot(b, ms, "o-", label="measured decode step (median)")
    ax.fill_between(b, [r["step_ms_p10"] for r in rows], [r["step_ms_p90"] for r in rows], alpha=0.2)
    bb = np.geomspace(max(1, b.min()), max(b.max(), 2 * roof.b_sat), 100)
    ctx = rows[0]["context_mid"]
    ax.plot(bb, [roof.step_time(x, ctx) * 1000 for x in bb], "--", label="roofline max(memory, compute)")
    ax.axhline(roof.weight_bytes / roof.bandwidth * 1000, color="gray", lw=0.8, ls=":", label="weight read time")
    ax.axvline(roof.b_sat, color="red", lw=1, ls="--", label=f"B_sat roofline = {roof.b_sat:.1f}")
    ax.axvline(b_sat_measured, color="green", lw=1, ls="-.", label=f"B_sat measured ~ {b_sat_measured}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B (decode)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{roof.shape}: decode step time vs batch")
    ax.legend(fontsize=8)
    ax2.plot(b, [r["decode_tok_s"] for r in rows], "o-", label="measured tokens/s")
    ax2.plot(bb, [x / roof.step_time(x, ctx) for x in bb], "--", label="roofline tokens/s")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.axvline(roof.b_sat, color="red", lw=1, ls="--")
    ax2.set_xlabel("batch size B")
    ax2.set_ylabel("decode tokens/s")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------


def _engine_device(engine) -> str:
    try:
        return str(engine.runner.device).split(":")[0]
    except AttributeError:
        return "cpu"


def _engine_dtype(torch_dtype) -> str:
    name = str(torch_dtype).replace("torch.", "")
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def _engine_args_dict(args: argparse.Namespace) -> dict:
    import dataclasses

    try:
        return dataclasses.asdict(driver.engine_args_from(args))
    except Exception:
        return {}


def _write_json(path: str, obj) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    print(f"saved {path}")
