"""What the HTTP server costs: `pagedserve serve` + `pagedserve bench serve` vs the engine stepped in-process, on the
same workload, rounds alternating, with a per-step account of where the server's time goes (issue 50, item 1).

    python benchmarks/server_overhead.py --model /work/scratch/models/smollm2 --precisions fp32,bf16 \\
        --concurrency 16,32 --dataset random --random-input-len 128 --random-output-len 64 --num-prompts 32 \\
        --rounds 2 --threads 2 --output-dir bench_results/server_overhead

Takes benchmarks/cpu_peers.py's flags (the same workloads, engine flags and client) and runs its two pagedserve
engines: "pagedserve" (the server, loaded by `bench serve`) and "pagedserve-engine" (peers/pagedserve_engine_driver.py,
LLMEngine.step() in a closed loop, no HTTP, no detokenization). Round k runs them in the order A B, then B A.

The server's side of the account is its GET /metrics `pagedserve:server_profile_*` totals (pagedserve/metrics/
server_profile.py), scraped before and after every run; the driver fills the same totals in-process. Per engine
step, both sides: wall time (run duration / steps), the step, its forward, its output processing, the engine
thread's time off CPU inside the step (OpenMP barriers, GIL waits, a core taken away), the time between steps;
server only: the event-loop thread's CPU, of which delivering outputs, building SSE chunks (JSON) and handing
them to uvicorn, the event loop's lag behind a finished step, and the benchmark client's CPU (it shares the cores).

--variant LABEL=PYTHONPATH (repeatable) runs several servers side by side in every round, each importing pagedserve
(and whatever else) from that PYTHONPATH, e.g. an older commit (`git archive COMMIT | tar -x -C DIR`, plus the
prebuilt kernels) against this checkout, or this checkout with uvloop and httptools on the path (uvicorn takes them
when it finds them): an A/B of the server alone, in one run, as ratios paired within a round. Default: one server,
this checkout.

--peers openvino[,vllm] runs those peers (cpu_peers.py's runners: OpenVINO GenAI's in-process driver, vLLM's CPU server
with the same client) in every round too, in the alternating order, and adds a table of the server and the engine
against the best peer per cell (tokens/s, p99 TTFT and ITL, paired within a round): the issue's end-to-end targets
from one run on one machine.

Output: OUTPUT_DIR/server_overhead.md (the tables) and .json; each run's bench result and logs as cpu_peers.py.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cpu_peers as cp  # noqa: E402
import side_by_side as sbs  # noqa: E402

SIDES = ("pagedserve", "pagedserve-engine")


def scrape(base_url: str) -> dict[str, float]:
    from pagedserve.metrics.server_profile import profile_from_metrics

    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        return profile_from_metrics(r.read().decode())


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def warm_up(base_url: str, name: str) -> None:
    """One streamed request, so that the profile knows the engine and event-loop threads before the first scrape (and
    in place of `bench serve`'s initial test request, which is turned off)."""
    body = json.dumps({"model": name, "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def run_server(args, precision: str, workloads: dict, out_dir: str, rows: list, skipped: dict, variant: str,
               pythonpath: str) -> None:
    """cpu_peers.run_pagedserve, with a /metrics scrape and the client's CPU time around every run."""
    out_dir = os.path.join(out_dir, variant)
    os.makedirs(out_dir, exist_ok=True)
    flags, note = cp.engine_flags("pagedserve", precision, args)
    blocks = cp.kv_blocks_for(workloads)
    port = sbs.free_port()
    name = f"pagedserve-{precision}"
    cmd = sbs.pagedserve_cmd("serve", args.model, "--host", "127.0.0.1", "--port", str(port),
                             *cp.pagedserve_engine_flags(args, blocks), "--served-model-name", name,
                             "--disable-log-stats", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
                             *flags, *args.serve_args.split())
    srv = sbs.Server(f"pagedserve {precision}", cmd, port, os.path.join(out_dir, f"pagedserve-{precision}-server.log"),
                     env=dict(os.environ, PYTHONPATH=pythonpath))
    try:
        srv.start(args.startup_timeout)
        warm_up(srv.base_url, name)
        for c in args.concurrencies:
            before, cpu0 = scrape(srv.base_url), children_cpu()
            # no initial test request: its steps (one token each) would fall into the scrapes' window; warm_up() ran
            res = cp.run_bench_serve("pagedserve", precision, srv.base_url, name, c, args, out_dir,
                                     extra=("--ready-check-timeout-sec", "0"))
            client_cpu = children_cpu() - cpu0
            after = scrape(srv.base_url)
            if res is None:
                skipped[f"pagedserve {precision} C={c}"] = "bench serve failed"
                continue
            row = cp.make_row("pagedserve", precision, c, res, workloads[c], notes=note)
            # client_run_cpu: the client's CPU while the load ran (bench serve's own count, start-up excluded)
            row["profile"] = dict({k: after[k] - before[k] for k in after}, client_cpu=client_cpu,
                                  client_run_cpu=res.get("client_cpu_s", float("nan")))
            row["variant"] = variant
            rows.append(row)
    except RuntimeError as e:
        cp.log(str(e))
        skipped[f"pagedserve {precision}"] = str(e).splitlines()[0]
    finally:
        srv.stop()


def run_engine(args, precision: str, workloads: dict, out_dir: str, rows: list, skipped: dict) -> None:
    """The engine in-process, from this checkout."""
    n = len(rows)
    cp.run_pagedserve_engine(args, precision, workloads, out_dir, rows, skipped)
    with open(os.path.join(out_dir, f"pagedserve-engine-{precision}-raw.json")) as f:
        runs = json.load(f)["runs"]
    for row in rows[n:]:
        row["profile"] = runs[str(row["concurrency"])].get("profile")
        row["variant"] = ENGINE


ENGINE = "engine"


# ------------------------------------------------------------------------------------------------ report
def per_step(row: dict) -> dict[str, float]:
    """The run's profile as milliseconds per engine step (and per chunk / delivery where that is the unit)."""
    p = row["profile"]
    steps = max(p["steps"], 1)

    def ms(x: float) -> float:
        return 1e3 * x / steps

    out = {"steps": p["steps"], "tokens_per_step": row["total_output_tokens"] / steps,
           "busy": ms(p["step"] + p["between_steps"]),
           "step": ms(p["step"]), "forward": ms(p["forward"]), "output": ms(p["output"]),
           "step_other": ms(p["step"] - p["forward"] - p["output"]), "step_off_cpu": ms(p["step"] - p["step_cpu"]),
           "between_steps": ms(p["between_steps"])}
    if row["engine"] == "pagedserve":
        out.update(loop_cpu=ms(p["loop_thread_cpu"]), deliver=ms(p["deliver"]), encode=ms(p["encode"]),
                   send=ms(p["send"]),
                   other_cpu=ms(p["process_cpu"] - p["loop_thread_cpu"] - p["engine_thread_cpu"]),
                   engine_cpu=ms(p["engine_thread_cpu"]), loop_cpu_us_per_chunk=1e6 * p["loop_thread_cpu"] / max(p["chunks"], 1),
                   lag_per_delivery=1e3 * p["deliver_lag"] / max(p["deliveries"], 1),
                   encode_us_per_chunk=1e6 * p["encode"] / max(p["chunks"], 1),
                   send_us_per_chunk=1e6 * p["send"] / max(p["chunks"], 1), chunks_per_step=p["chunks"] / steps,
                   client_cpu_s=p["client_cpu"], client_run_cpu=ms(p.get("client_run_cpu", float("nan"))))
    else:
        out.update(engine_cpu=ms(p["engine_thread_cpu"]), other_cpu=ms(p["process_cpu"] - p["engine_thread_cpu"]))
    return out


BREAKDOWN = (("busy", "busy (step + between steps)"), ("step", "engine step"), ("forward", "  forward"),
             ("output", "  output processing"), ("step_other", "  schedule + rest"),
             ("step_off_cpu", "  engine thread off CPU in the step"), ("between_steps", "between steps"),
             ("engine_cpu", "engine thread CPU"), ("loop_cpu", "event-loop thread CPU"), ("deliver", "  deliver outputs"), ("encode", "  SSE/JSON encode"),
             ("send", "  HTTP send"), ("lag_per_delivery", "event-loop lag per delivery"),
             ("other_cpu", "other threads' CPU (OpenMP workers)"))


def peer_table(rows: list[dict], meta: dict) -> list[str]:
    """Every server variant and the engine against the best peer of each (cell, round): tokens/s over the best peer's
    (the peer with the most tokens/s), and that peer's p99 TTFT and ITL over ours (> 1 = ours better)."""
    peers = meta.get("peers") or []
    if not peers:
        return []
    ours = (*meta["variants"], ENGINE)
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["precision"], r["concurrency"]), {}).setdefault(r["round"], {})[r["variant"]] = r
    L = ["", "Against the peers (best peer per round = most tokens/s; p99 ratios are the peer's over ours, > 1 = ours "
         "better; medians [min-max] over the rounds):", "",
         "| precision | C | rounds | " + " | ".join(f"{p} tok/s" for p in peers) + " | "
         + " | ".join(f"{o} tok/s | {o} / best peer | TTFT p99 ratio | ITL p99 ratio" for o in ours) + " |",
         "| --- | ---: | ---: | " + " | ".join("---:" for _ in peers) + " | "
         + " | ".join("---: | ---: | ---: | ---:" for _ in ours) + " |"]

    def agg(v: list[float], fmt: str = "{:.2f}") -> str:
        if not v:
            return "-"
        s = fmt.format(statistics.median(v))
        return s if len(v) == 1 else f"{s} [{fmt.format(min(v))}-{fmt.format(max(v))}]"

    for key in sorted(cells, key=lambda k: (cp.precision_order(k[0]), k[1])):
        by_round = [by for by in cells[key].values() if any(p in by for p in peers)]
        cols = [agg([by[p]["output_tok_s"] for by in by_round if p in by], "{:.1f}") for p in peers]
        for o in ours:
            tok, q, ttft, itl = [], [], [], []
            for by in by_round:
                if o not in by:
                    continue
                best = max((by[p] for p in peers if p in by), key=lambda r: r["output_tok_s"])
                tok.append(by[o]["output_tok_s"])
                q.append(by[o]["output_tok_s"] / best["output_tok_s"])
                ttft.append(best["ttft_p99_ms"] / by[o]["ttft_p99_ms"])
                itl.append(best["itl_p99_ms"] / by[o]["itl_p99_ms"])
            cols += [agg(tok, "{:.1f}"), agg(q), agg(ttft), agg(itl)]
        L.append(f"| {key[0]} | {key[1]} | {len(by_round)} | " + " | ".join(cols) + " |")
    return L


def format_report(rows: list[dict], meta: dict) -> str:
    variants = meta["variants"]
    L = ["# pagedserve server vs engine in-process (issue 50)", "",
         f"model `{meta['model']}`; {meta['threads']} threads; workload: {meta['workload']}; {meta['date']}; "
         f"{meta['version']}; servers: " + ", ".join(f"`{v}` (PYTHONPATH {pp})" for v, pp in variants.items()), "",
         "| precision | C | round | engine tok/s | " + " | ".join(f"{v} tok/s | {v} / engine" for v in variants) + " |",
         "| --- | ---: | ---: | ---: | " + " | ".join("---: | ---:" for _ in variants) + " |"]
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["precision"], r["concurrency"]), {}).setdefault(r["round"], {})[r["variant"]] = r
    order = sorted(cells, key=lambda key: (cp.precision_order(key[0]), key[1]))
    ratios: dict[tuple, list[float]] = {}
    for key in order:
        for k, by in sorted(cells[key].items()):
            e = by.get(ENGINE)
            if e is None:
                continue
            cols = []
            for v in variants:
                r = by.get(v)
                q = r["output_tok_s"] / e["output_tok_s"] if r else float("nan")
                ratios.setdefault((*key, v), []).append(q)
                base = by.get(next(iter(variants)))
                if r and base and v != next(iter(variants)):
                    ratios.setdefault((*key, v, "vs-first"), []).append(r["output_tok_s"] / base["output_tok_s"])
                cols.append(f"{r['output_tok_s']:.1f} | {q:.3f}" if r else "- | -")
            L.append(f"| {key[0]} | {key[1]} | {k} | {e['output_tok_s']:.1f} | " + " | ".join(cols) + " |")
    L += ["", "Medians [min-max] over the rounds: " + "; ".join(
        f"{q[0]} C={q[1]} {q[2]} {'/ ' + next(iter(variants)) if len(q) > 3 else '/ engine'} "
        f"**{statistics.median(v):.3f}** [{min(v):.3f}-{max(v):.3f}]" for q, v in ratios.items())]
    med: dict[tuple, dict[str, dict[str, float]]] = {}
    for key in order:
        for side in (*variants, ENGINE):
            steps = [per_step(by[side]) for by in cells[key].values() if side in by and by[side].get("profile")]
            med.setdefault(key, {})[side] = {m: statistics.median(x[m] for x in steps) for m in steps[0]} \
                if steps else {}
    sides = (*variants, ENGINE)
    L += ["", "Per engine step, ms (medians over the rounds; columns: " + ", ".join(sides) + "):", "",
          "| part | " + " | ".join(f"{p} C={c}" for p, c in order) + " |",
          "| --- | " + " | ".join("---:" for _ in order) + " |"]
    extra = (("tokens_per_step", "tokens / step"), ("chunks_per_step", "SSE chunks / step"),
             ("loop_cpu_us_per_chunk", "event-loop CPU us / chunk"), ("encode_us_per_chunk", "encode us / chunk"),
             ("send_us_per_chunk", "send us / chunk"), ("client_run_cpu", "bench client CPU while loading, ms / step"),
             ("client_cpu_s", "bench client CPU s (whole run, start-up too)"))
    for metric, label in (*BREAKDOWN, *extra):
        cols = []
        for key in order:
            vals = [med[key][side].get(metric) for side in sides]
            cols.append(" / ".join("-" if v is None else f"{v:.2f}" for v in vals))
        L.append(f"| {label} | " + " | ".join(cols) + " |")
    L += peer_table(rows, meta)
    return "\n".join(L) + "\n"


def parse_peers(argv: list[str]) -> tuple[list[str], list[str]]:
    """--peers openvino,vllm out of argv (cpu_peers.py's own --engines stays pagedserve + pagedserve-engine)."""
    rest, peers = [], []
    it = iter(argv)
    for a in it:
        if a == "--peers" or a.startswith("--peers="):
            peers += [p for p in (a.partition("=")[2] if "=" in a else next(it)).split(",") if p]
        else:
            rest.append(a)
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise SystemExit(f"--peers {','.join(bad)}: want a comma list of {','.join(PEERS)}")
    return rest, peers


PEERS = ("openvino", "vllm")


def parse_variants(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """--variant LABEL=PYTHONPATH (repeatable) out of argv; default: this checkout, as "server"."""
    rest, variants = [], {}
    it = iter(argv)
    for a in it:
        if a == "--variant" or a.startswith("--variant="):
            spec = a.partition("=")[2] if "=" in a and a.startswith("--variant=") else next(it)
            label, _, path = spec.partition("=")
            if not label or not path or label == ENGINE:
                raise SystemExit(f"--variant {spec!r}: want LABEL=PYTHONPATH (LABEL not {ENGINE!r})")
            variants[label] = path
        else:
            rest.append(a)
    return rest, variants or {"server": sbs.REPO}


def write_report(out_dir: str, rows: list[dict], skipped: dict, meta: dict) -> str:
    report = format_report(rows, meta)
    if skipped:
        report += "\nSkipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + "\n"
    with open(os.path.join(out_dir, "server_overhead.md"), "w") as f:
        f.write(report)
    with open(os.path.join(out_dir, "server_overhead.json"), "w") as f:
        json.dump(dict(meta, rows=rows, skipped=skipped), f, indent=2)
    return report


def main(argv=None) -> int:
    argv, peers = parse_peers(list(sys.argv[1:] if argv is None else argv))
    argv, variants = parse_variants(argv)
    args = cp.parse_args([*argv, "--engines", ",".join(SIDES)])
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    out_dir = args.output_dir or os.path.join("bench_results", "server_overhead-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    workloads, described = cp.build_workloads(args)
    meta = {"model": args.model, "threads": args.threads, "workload": "; ".join(sorted(set(described.values()))),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "version": cp.pagedserve_version(),
            "variants": variants, "peers": peers}
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    sides = [ENGINE, *variants, *peers]
    try:
        for prec in args.precision_list:
            for k in range(args.rounds):
                d = cp.round_dir(out_dir, k, args.rounds)
                os.makedirs(d, exist_ok=True)
                for side in cp.engine_order(sides, k):
                    n = len(rows)
                    if side == ENGINE:
                        run_engine(args, prec, workloads, d, rows, skipped)
                    elif side in peers:
                        cp.RUNNERS[side](args, prec, workloads, d, rows, skipped)
                        for r in rows[n:]:
                            r["variant"] = side
                    else:
                        run_server(args, prec, workloads, d, rows, skipped, side, variants[side])
                    for r in rows[n:]:
                        r["round"] = k
                    write_report(out_dir, rows, skipped, meta)  # after every run: a stopped run keeps its rows
    finally:
        sbs.stop_all_servers()
    cp.log("\n" + write_report(out_dir, rows, skipped, meta))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
