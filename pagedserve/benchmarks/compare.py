"""`bench compare` (seed 002's NAIVE / STATIC / CONTINUOUS / CONTINUOUS+CHUNKED experiment on the real
engine) and `bench chunked-itl` (seed 004's "one decode while 3 long prompts arrive" experiment).

compare modes (one workload, one run, fresh engine per mode, each warmed up first):

  naive        one request at a time through the engine (submit, wait until it finishes, next)
  static       classic static batching emulated on the engine: take up to --static-batch-size available
               requests, wait until *all* of them finish, only then take the next batch, and compute
               what padding costs: every prompt left-padded to the batch's longest, every request decoding
               to the batch's longest output (only each request's own tokens are timed and counted).
  continuous   iteration-level scheduling, enable_chunked_prefill=False (a prompt is prefilled in one step)
  chunked      continuous + chunked prefill (budget = --max-num-batched-tokens)
  prefix       continuous + chunked + prefix caching (only useful when the workload shares prefixes;
               run by default only for shared-prefix workloads)
  hf-naive     transformers generate, one request at a time          (skip with --skip-hf)
  hf-static    transformers generate, left-padded static batches      (skip with --skip-hf)

Prefix caching is off in every engine mode but `prefix`, so each row changes one thing.
"""
from __future__ import annotations

import argparse
import json
import os
from datetime import datetime

import numpy as np

from pagedserve.benchmarks import datasets as ds
from pagedserve.benchmarks import driver
from pagedserve.benchmarks.metrics import cdf
from pagedserve.benchmarks.plotting import pyplot

ENGINE_MODES = ("naive", "static", "continuous", "chunked", "prefix")
HF_MODES = ("hf-naive", "hf-static")
LABELS = {"naive": "NAIVE", "static": "STATIC", "continuous": "CONTINUOUS", "chunked": "CONTINUOUS+CHUNKED",
          "prefix": "+PREFIX-CACHING", "hf-naive": "HF generate (1 at a time)", "hf-static": "HF generate (static padded)"}


def add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="NAIVE / STATIC / CONTINUOUS / +CHUNKED / +PREFIX (+ HF baselines) on one workload")
    driver.add_engine_args(p)
    ds.add_dataset_args(p, default_dataset="mixed", default_num_prompts=100, with_tokenizer=False)
    p.add_argument("--modes", default=None,
                   help=f"comma list of {','.join(ENGINE_MODES + HF_MODES)} "
                        "(default: all; 'prefix' only for workloads with shared prefixes)")
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: --static-batch-size")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="arrivals per second (gamma/Poisson, see --burstiness); inf = all at t=0")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--output-dir", default=None, help="default: bench_results/compare-<date>")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_compare)


def _shares_prefix(args) -> bool:
    return args.dataset_name == "shared-prefix" or (args.dataset_name == "random" and args.random_prefix_len > 0)


def mode_engine_overrides(mode: str) -> dict:
    return {
        "naive": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
        "static": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
        "continuous": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
        "chunked": dict(enable_chunked_prefill=True, enable_prefix_caching=False),
        "prefix": dict(enable_chunked_prefill=True, enable_prefix_caching=True),
    }[mode]


def run_compare(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pagedserve.benchmarks.serve import arrival_offsets

    pyplot()  # the run ends in plots: fail now, not after it, when matplotlib is missing
    if args.modes:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in ENGINE_MODES + HF_MODES]
        if bad:
            raise ValueError(f"unknown modes {bad}")
    else:
        modes = [m for m in ENGINE_MODES if m != "prefix" or _shares_prefix(args)] + list(HF_MODES)
    if args.skip_hf:
        modes = [m for m in modes if m not in HF_MODES]
    out_dir = args.output_dir or os.path.join("bench_results", "compare-" + datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)

    results: dict[str, driver.TraceResult] = {}
    samples = None
    arrivals = None
    max_len = None
    vocab = None
    dtype = "float32"
    for mode in [m for m in modes if m in ENGINE_MODES]:
        ea = driver.engine_args_from(args, **mode_engine_overrides(mode))
        engine = driver.build_engine(ea)
        if samples is None:
            vocab = driver.vocab_of(engine)
            samples = ds.get_samples(args, engine.tokenizer, None, vocab_cap=vocab)
            arrivals = arrival_offsets(len(samples), args.request_rate, args.burstiness, args.seed)
            max_len = int(engine.model_config.max_model_len)
            print(f"workload: {args.dataset_name}: {ds.describe(samples)}")
            dtype = str(getattr(engine.runner, "dtype", "float32")).replace("torch.", "")
        driver.warm_up(engine, vocab)
        static = {"naive": 1, "static": args.static_batch_size}.get(mode)
        pbar = tqdm(total=len(samples), desc=LABELS[mode], disable=args.disable_tqdm)
        res = driver.run_trace(engine, samples, mode, arrivals, static_batch=static, pbar=pbar, pad_static=True)
        pbar.close()
        if static:
            res.notes = f"static batches of {static}, padded (prompts to the longest, outputs to the longest)"
        results[mode] = res
        engine = None
        driver.release()

    hf_modes = [m for m in modes if m in HF_MODES]
    if hf_modes:
        from pagedserve.benchmarks.hf_baseline import load_hf_model, run_hf

        if args.model is None or not os.path.isdir(args.model):
            raise ValueError("the HF baselines need --model to be a local checkpoint dir (or pass --skip-hf)")
        if samples is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
            samples = ds.get_samples(args, tok, args.model)
            arrivals = arrival_offsets(len(samples), args.request_rate, args.burstiness, args.seed)
            max_len = args.max_model_len or 2048
            print(f"workload: {args.dataset_name}: {ds.describe(samples)}")
        if args.num_threads:
            import torch

            torch.set_num_threads(args.num_threads)
        model = load_hf_model(args.model, dtype if args.dtype == "auto" else args.dtype)
        hb = args.hf_batch_size or args.static_batch_size
        for mode in hf_modes:
            pbar = tqdm(total=len(samples), desc=LABELS[mode], disable=args.disable_tqdm)
            results[mode] = run_hf(model, samples, mode, 1 if mode == "hf-naive" else hb, arrivals, max_len,
                                   pbar=pbar)
            pbar.close()
        del model

    summaries = {m: r.summary() for m, r in results.items()}
    table = markdown_table(summaries, max_len)
    print(table)
    with open(os.path.join(out_dir, "compare.md"), "w") as f:
        f.write(f"# bench compare\n\nworkload: {args.dataset_name}: {ds.describe(samples)}; "
                f"request rate {args.request_rate}; model {args.model}\n\n{table}\n")
    payload = {
        "model": args.model,
        "dataset_name": args.dataset_name,
        "workload": ds.describe(samples),
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "static_batch_size": args.static_batch_size,
        "max_model_len": max_len,
        "modes": list(results),
        "summaries": summaries,
        "traces": {m: r.to_dict() for m, r in results.items()},
        "engine_args": _safe_engine_args(args),
    }
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump(payload, f, default=str)
    plots = plot_compare(results, out_dir)
    print(f"saved {out_dir}/compare.md, compare.json and {len(plots)} plots")
    return 0


def _safe_engine_args(args) -> dict:
    import dataclasses

    try:
        return dataclasses.asdict(driver.engine_args_from(args))
    except Exception:
        return {}


def _pct(value: float | None) -> str:
    return "-" if value is None or value != value else f"{100 * value:.1f}%"


def markdown_table(summaries: dict[str, dict], max_len: int | None) -> str:
    head = ("| mode | req/s | output tok/s | total tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | "
            "ITL p99 (ms) | KV waste (own allocator) | KV waste if contiguous max_len"
            f"{f' ({max_len})' if max_len else ''} | engine overhead (all / >=32 running) | preemptions | notes |")
    lines = [head, "|" + "---|" * 13]
    for m, s in summaries.items():
        lines.append(
            f"| {LABELS.get(m, m)} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
            f"{s['total_token_throughput']:.1f} | {s['p50_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | "
            f"{s['p50_itl_ms']:.1f} | {s['p99_itl_ms']:.1f} | {100 * s['kv_waste_paged']:.1f}% | "
            f"{100 * s['kv_waste_contiguous_max_len']:.1f}% | {_pct(s.get('engine_overhead_all'))} / "
            f"{_pct(s.get('engine_overhead_ge32'))} | {s['num_preemptions']} | {s.get('notes', '')} |")
    return "\n".join(lines)


def plot_compare(results: dict[str, driver.TraceResult], out_dir: str) -> list[str]:
    plt = pyplot()

    paths = []
    names = list(results)
    sums = {m: results[m].summary() for m in names}
    # throughput bars
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names)), 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [sums[m]["output_throughput"] for m in names], 0.4, label="output tok/s")
    ax.bar(x + 0.2, [sums[m]["total_token_throughput"] for m in names], 0.4, label="total tok/s")
    ax.set_xticks(x, [LABELS.get(m, m) for m in names], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title("throughput")
    ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "throughput.png"))
    # CDFs
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    for m in names:
        done = [r for r in results[m].requests if r.token_times]
        xs, ys = cdf([r.ttft * 1000 for r in done])
        a1.plot(xs, ys, label=LABELS.get(m, m))
        xs, ys = cdf([g * 1000 for r in done for g in r.itls])
        a2.plot(xs, ys, label=LABELS.get(m, m))
    a1.set_xscale("log")
    a1.set_xlabel("TTFT (ms)")
    a1.set_ylabel("CDF")
    a1.set_title("TTFT")
    a2.set_xscale("log")
    a2.set_xlabel("ITL (ms)")
    a2.set_title("ITL")
    a1.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "latency_cdf.png"))
    # timelines
    for m in names:
        if m in HF_MODES:
            continue
        paths.append(plot_timeline(results[m], os.path.join(out_dir, f"timeline_{m}.png"), LABELS.get(m, m)))
    return paths


def plot_timeline(res: driver.TraceResult, path: str, title: str) -> str:
    plt = pyplot()

    steps = [s for s in res.steps if s.scheduled_tokens > 0]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    if steps:
        i = np.arange(len(steps))
        pre = np.array([s.prompt_tokens for s in steps])
        dec = np.array([s.decode_tokens for s in steps])
        idle = np.array([max(0, s.budget - s.scheduled_tokens) for s in steps])
        a1.stackplot(i, pre, dec, idle, labels=["prefill (chunk) tokens", "decode tokens", "idle budget"],
                     colors=["tab:orange", "tab:blue", "0.85"], step="post")
        a1.set_yscale("symlog", linthresh=max(4, int(np.median(dec)) if len(dec) else 4))
        a1.set_ylabel("tokens per step (symlog)")
        a1.legend(loc="upper right", fontsize=8)
        used = np.array([s.used_blocks for s in steps])
        total = max(s.num_blocks for s in steps) or 1
        a2.plot(i, used / total * 100, label=f"KV blocks used (% of {total})", color="tab:green")
        a2.set_ylim(bottom=0)
        a2b = a2.twinx()
        a2b.plot(i, [s.running for s in steps], color="tab:purple", lw=0.8, label="running requests")
        a2b.plot(i, [s.waiting for s in steps], color="tab:red", lw=0.8, ls="--", label="waiting requests")
        a2b.set_ylabel("requests")
        a2b.set_ylim(bottom=0)
        a2.set_ylabel("% of KV pool")
        a2.set_xlabel("engine step")
        h1, l1 = a2.get_legend_handles_labels()
        h2, l2 = a2b.get_legend_handles_labels()
        a2.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    a1.set_title(f"{title}: batch composition per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _save(fig, out_dir: str, name: str) -> str:
    plt = pyplot()

    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------
# chunked-prefill ITL experiment (seed 004)


def add_chunked_itl_parser(sub) -> None:
    p = sub.add_parser("chunked-itl",
                       help="one decode running while long prompts arrive: ITL vs max_num_batched_tokens")
    driver.add_engine_args(p)
    p.add_argument("--budgets", default="512,1024,2048", help="max_num_batched_tokens values (chunked)")
    p.add_argument("--no-unchunked", action="store_true", help="skip the enable_chunked_prefill=False run")
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--decode-output-len", type=int, default=300)
    p.add_argument("--num-long", type=int, default=3)
    p.add_argument("--long-prompt-len", type=int, default=3500)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--insert-after", type=int, default=20, help="decode tokens generated before the long prompts arrive")
    p.add_argument("--output-dir", default=None, help="default: bench_results/chunked-itl-<date>")
    p.set_defaults(func=run_chunked_itl)


def run_chunked_itl(args: argparse.Namespace) -> int:
    if args.insert_after >= args.decode_output_len:
        raise ValueError("--insert-after must be smaller than --decode-output-len")
    pyplot()  # the run ends in a plot: fail now, not after it, when matplotlib is missing
    out_dir = args.output_dir or os.path.join("bench_results", "chunked-itl-" + datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    configs = [(f"chunked {b}", dict(enable_chunked_prefill=True, max_num_batched_tokens=int(b)))
               for b in args.budgets.split(",") if b.strip()]
    if not args.no_unchunked:
        configs.append(("unchunked", dict(enable_chunked_prefill=False)))
    rows, traces = [], {}
    samples = None
    for label, ov in configs:
        ea = driver.engine_args_from(args, enable_prefix_caching=False, **ov)
        engine = driver.build_engine(ea)
        vocab = driver.vocab_of(engine)
        if samples is None:
            space = ds.token_space_from_tokenizer(engine.tokenizer)
            space = ds.TokenSpace(min(space.vocab_size, vocab), space.special_ids)
            rng = np.random.default_rng(args.seed)
            samples = [ds.SampleRequest(p := space.sample(rng, args.decode_prompt_len), len(p),
                                        args.decode_output_len, request_id="decode")]
            for k in range(args.num_long):
                samples.append(ds.SampleRequest(p := space.sample(rng, args.long_prompt_len), len(p),
                                                args.long_output_len, request_id=f"long-{k}"))
        driver.warm_up(engine, vocab)
        long_idx = list(range(1, len(samples)))
        released = []

        def on_step(engine, step, now, timings):
            d = timings.get("decode")
            if not released and d is not None and d.output_len >= args.insert_after:
                released.append(now)
                return long_idx
            return ()

        arrivals = [0.0] + [None] * args.num_long
        res = driver.run_trace(engine, samples, label, arrivals, on_step=on_step)
        budget = driver._budget(engine)
        engine = None
        driver.release()
        row = itl_window_stats(res, label, budget)
        rows.append(row)
        traces[label] = res
        print(f"{label}: max ITL in window {row['max_itl_window_ms']:.1f} ms, "
              f"long TTFT {row['long_ttft_min_ms']:.0f}-{row['long_ttft_max_ms']:.0f} ms")

    table = chunked_itl_table(rows, args)
    print(table)
    with open(os.path.join(out_dir, "chunked_itl.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, "chunked_itl.json"), "w") as f:
        json.dump({"rows": rows, "traces": {k: v.to_dict() for k, v in traces.items()},
                   "decode_output_len": args.decode_output_len, "long_prompt_len": args.long_prompt_len,
                   "num_long": args.num_long, "model": args.model, "engine_args": _safe_engine_args(args)},
                  f, default=str)
    plot_chunked_itl(traces, rows, os.path.join(out_dir, "chunked_itl.png"))
    print(f"saved {out_dir}/chunked_itl.md, chunked_itl.json, chunked_itl.png")
    return 0


def itl_window_stats(res: driver.TraceResult, label: str, budget: int) -> dict:
    reqs = {r.request_id: r for r in res.requests}
    dec = reqs["decode"]
    longs = [r for rid, r in reqs.items() if rid.startswith("long-")]
    t_in = min(r.arrival for r in longs)
    t_out = max(r.token_times[0] for r in longs if r.token_times)
    t = dec.token_times
    gaps = [(a, b) for a, b in zip(t, t[1:])]
    window = [b - a for a, b in gaps if b > t_in and a < t_out]
    before = [b - a for a, b in gaps if b <= t_in]
    after = [b - a for a, b in gaps if a >= t_out]
    ttfts = [r.ttft for r in longs if r.ttft is not None]
    prefill_steps = sum(1 for s in res.steps if s.prompt_tokens > 0 and t_in <= s.t_start <= t_out)
    ms = 1000.0
    return {
        "config": label,
        "max_num_batched_tokens": budget,
        "max_itl_window_ms": max(window) * ms if window else 0.0,
        "p99_itl_window_ms": float(np.percentile(window, 99)) * ms if window else 0.0,
        "mean_itl_window_ms": float(np.mean(window)) * ms if window else 0.0,
        "num_gaps_window": len(window),
        "median_itl_before_ms": float(np.median(before)) * ms if before else 0.0,
        "median_itl_after_ms": float(np.median(after)) * ms if after else 0.0,
        "p99_itl_all_ms": float(np.percentile([b - a for a, b in gaps], 99)) * ms if gaps else 0.0,
        "max_itl_all_ms": max((b - a for a, b in gaps), default=0.0) * ms,
        "long_ttft_min_ms": min(ttfts) * ms if ttfts else 0.0,
        "long_ttft_max_ms": max(ttfts) * ms if ttfts else 0.0,
        "window_s": t_out - t_in,
        "prefill_steps_in_window": prefill_steps,
    }


def chunked_itl_table(rows: list[dict], args) -> str:
    lines = [f"decode request: {args.decode_prompt_len}-token prompt, {args.decode_output_len} output tokens; "
             f"{args.num_long} prompts of {args.long_prompt_len} tokens arrive after {args.insert_after} decode tokens",
             "",
             "| config | max_num_batched_tokens | max ITL in window (ms) | p99 ITL in window (ms) | median ITL before (ms) "
             "| long prompts' TTFT (ms) | prefill steps in window |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['max_num_batched_tokens']} | {r['max_itl_window_ms']:.1f} | "
                     f"{r['p99_itl_window_ms']:.1f} | {r['median_itl_before_ms']:.1f} | "
                     f"{r['long_ttft_min_ms']:.0f}-{r['long_ttft_max_ms']:.0f} | {r['prefill_steps_in_window']} |")
    return "\n".join(lines)


def plot_chunked_itl(traces: dict[str, driver.TraceResult], rows: list[dict], path: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for label, res in traces.items():
        reqs = {r.request_id: r for r in res.requests}
        dec = reqs["decode"]
        t_in = min(r.arrival for rid, r in reqs.items() if rid.startswith("long-"))
        t = np.array(dec.token_times)
        ax.plot((t[1:] - t_in) * 1000, np.diff(t) * 1000, lw=1, label=label)
    ax.axvline(0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("time since the long prompts arrived (ms)")
    ax.set_ylabel("decode ITL (ms)")
    ax.set_yscale("log")
    ax.set_title("ITL of the running decode while long prompts are prefilled")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
