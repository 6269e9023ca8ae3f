"""The GPU checks of issue 18 that are not a pagedserve CLI command (benchmarks/device_check.sh runs them all).

    python benchmarks/device_check.py correctness --out DIR   # every tiny architecture on CUDA vs HF float32
    python benchmarks/device_check.py summarize --out DIR     # DIR/*.json -> DIR/summary.md + summary.json

correctness: for each tiny random-weight architecture (tests/tiny_models.py), 8 mixed-length prompts, 16 greedy
tokens, through the engine on CUDA in float32 with CUDA graphs and with --enforce-eager, compared with Hugging Face
transformers' float32 greedy tokens on the CPU (the CPU float32 path's own reference) by the tests' rule
(tests/hf_reference.py: identical, or diverging only at a near-tie). bfloat16 on CUDA is reported as the fraction
of tokens equal to the float32 reference (bfloat16 rounding changes greedy paths; no pass/fail).

summarize: reads what device_check.sh wrote (correctness.json, the roofline, the decode sweeps with and without
CUDA graphs, the prefill throughput run, side_by_side.json) and writes one markdown report. It computes nothing
it was not given: every number in it comes from those files.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

MAX_TOKENS = 16
CONFIGS = {  # name -> LLM kwargs (CUDA graphs are used on a GPU unless enforce_eager)
    "float32": {"dtype": "float32"},
    "float32 --enforce-eager": {"dtype": "float32", "enforce_eager": True},
    "bfloat16": {"dtype": "bfloat16"},
}


def run_correctness(out_dir: str, device: str) -> int:
    import torch
    from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
    from tiny_models import ARCHS, build_tiny_tokenizer, make_tiny_checkpoint

    from pagedserve import LLM, SamplingParams
    from pagedserve.benchmarks.driver import release

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    tokenizer = build_tiny_tokenizer()
    prompts = mixed_prompts(tokenizer, n=8)
    results, failures = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            model_dir = make_tiny_checkpoint(arch, os.path.join(tmp, arch), tokenizer=tokenizer)
            reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
            for name, kwargs in CONFIGS.items():
                row = {"arch": arch, "config": name}
                t0 = time.perf_counter()
                try:
                    llm = LLM(str(model_dir), device=device, num_kv_blocks=512, **kwargs)
                    outs = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                              use_tqdm=False)]
                    graphs = llm.llm_engine.runner.decode_graphs
                    row["graphs_captured"] = sorted(graphs.graphs) if graphs is not None else []
                    same = sum(a == b for o, r in zip(outs, reference) for a, b in zip(o.token_ids, r.token_ids))
                    row["tokens_equal_to_reference"] = same / (len(prompts) * MAX_TOKENS)
                    if "float32" in name:
                        assert_greedy_match(outs, reference)
                        row["status"] = "pass"
                    else:
                        row["status"] = "reported"
                except Exception as e:  # recorded, and the other configurations still run
                    row["status"] = "FAIL"
                    row["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[:4000]
                    failures += 1
                finally:
                    llm = None
                    release()
                row["seconds"] = time.perf_counter() - t0
                results.append(row)
                print(f"{arch:12s} {name:32s} {row['status']}", flush=True)
    with open(os.path.join(out_dir, "correctness.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0) if device == "cuda" else device, "max_tokens": MAX_TOKENS, "num_prompts": len(prompts),
                   "rows": results}, f, indent=2)
    return 1 if failures else 0


def _load(out_dir: str, name: str) -> dict | None:
    path = os.path.join(out_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def summarize(out_dir: str) -> int:
    lines = ["# Device check (issue 18)", ""]
    env = _load(out_dir, "env.json") or {}
    lines += [f"Device: {env.get('device', '?')}; torch {env.get('torch', '?')}, triton {env.get('triton', '?')}; "
              f"date {env.get('date', '?')}.", ""]
    steps_path = os.path.join(out_dir, "steps.txt")
    if os.path.isfile(steps_path):
        lines += ["## Steps (exit status; 124 = hit its time limit)", "", "```", open(steps_path).read().strip(),
                  "```", ""]
    corr = _load(out_dir, "correctness.json")
    if corr:
        lines += [f"## Greedy outputs on {corr['device']} vs HF float32 (CPU)", "",
                  "| arch | config | status | tokens equal | graphs captured |", "| --- | --- | --- | --- | --- |"]
        for r in corr["rows"]:
            eq = r.get("tokens_equal_to_reference")
            lines.append(f"| {r['arch']} | {r['config']} | {r['status']} | "
                         f"{'' if eq is None else f'{100 * eq:.1f}%'} | {len(r.get('graphs_captured', []))} |")
        lines += [""] + [f"* {r['arch']} / {r['config']}: {r['error'].splitlines()[-1]}"
                         for r in corr["rows"] if r.get("error")] + [""]
    roof = _load(out_dir, "roofline.json")
    summary: dict = {"env": env}
    if roof:
        m = roof["machine"]
        lines += ["## Roofline (measured on this device)", "",
                  f"matmul peak {m['matmul_flops'] / 1e12:.1f} TFLOP/s (nominal H200 bf16 dense ~790); copy "
                  f"bandwidth {m['copy_bandwidth'] / 1e12:.2f} TB/s, best of copy/sum/GEMV "
                  f"{max(m['copy_bandwidth'], m['sum_bandwidth'], m['gemv_bandwidth']) / 1e12:.2f} TB/s "
                  "(nominal ~4.3 measured copy).", ""]
        summary["roofline"] = roof
    graphs, eager = _load(out_dir, "decode_graphs.json"), _load(out_dir, "decode_eager.json")
    if graphs or eager:
        lines += ["## Decode step time vs batch size", "",
                  "| B | graphs ms | eager ms | eager / graphs | graphs tok/s | achieved GB/s (graphs) | "
                  "% of roofline (graphs) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        by_b = {}
        for label, res in (("graphs", graphs), ("eager", eager)):
            for r in (res or {}).get("rows", []):
                by_b.setdefault(r["batch_size"], {})[label] = r
        rf = (graphs or eager)["roofline"]
        for b in sorted(by_b):
            g, e = by_b[b].get("graphs"), by_b[b].get("eager")
            ms_g = g["step_ms_median"] if g else None
            ms_e = e["step_ms_median"] if e else None
            ctx = (g or e)["context_mid"]
            moved = rf["weight_bytes"] + b * ctx * rf["kv_bytes_per_token"]  # bytes one decode step must read
            lines.append(f"| {b} | {_f(ms_g)} | {_f(ms_e)} | {_f(ms_e / ms_g if ms_g and ms_e else None)} | "
                         f"{_f(b / ms_g * 1e3 if ms_g else None, 0)} | "
                         f"{_f(moved / (ms_g / 1e3) / 1e9 if ms_g else None, 0)} | "
                         f"{_f(100 * g['fraction_of_roofline'] if g else None, 0)} |")
        lines.append("")
        summary["decode"] = by_b
    prefill = _load(out_dir, "prefill_throughput.json")
    if prefill:
        flops = prefill.get("roofline", {}).get("matmul_params", 0) * 2 * prefill["tokens_per_second"]
        lines += ["## Prefill throughput", "",
                  f"{prefill['num_requests']} prompts, {prefill['total_input_tokens']} prompt tokens: "
                  f"{prefill['tokens_per_second']:.0f} tok/s, matmul {flops / 1e12:.1f} TFLOP/s "
                  f"({100 * prefill.get('fraction_of_compute_bound', 0):.1f}% of the measured matmul peak).", ""]
        summary["prefill"] = prefill
    sbs = _load(out_dir, "side_by_side/side_by_side.json")
    if sbs:
        lines += ["## bench serve and HF continuous batching (benchmarks/side_by_side.py)", "",
                  "| engine | C | output tok/s | TTFT p50 ms | ITL p50 ms | % of matmul peak |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in sbs.get("rows", []):
            lines.append(f"| {r['label']} | {r['concurrency']} | {r['output_tok_s']:.0f} | {_f(r['ttft_p50_ms'])} | "
                         f"{_f(r['itl_p50_ms'])} | {100 * r['fraction_of_matmul_peak']:.2f} |")
        if sbs.get("ratios"):
            lines += ["", "Ratios as side_by_side.py computed them:", "", "```", json.dumps(sbs["ratios"], indent=1),
                      "```"]
        lines.append("")
        summary["side_by_side"] = sbs.get("rows")
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print("\n".join(lines))
    return 0


def _f(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["correctness", "summarize"])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="correctness: the engine's device (cpu: a smoke run of this script)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return run_correctness(args.out, args.device) if args.command == "correctness" else summarize(args.out)


if __name__ == "__main__":
    sys.exit(main())
