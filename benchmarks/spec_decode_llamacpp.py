"""Speculative decoding side by side with llama.cpp's llama-server (issue 14): batch 1, the code-edit workload of
benchmarks/spec_decode.py, the embedded demo model in float32 in both engines (llama.cpp reads it as a GGUF F32
converted by its own converter), speculation off vs n-gram in each, rounds alternating between the four arms.

    python benchmarks/spec_decode_llamacpp.py --llama-server /tmp/llamacpp/build/bin/llama-server \\
        --convert-with /tmp/llamacpp/vendor/llama.cpp --num-prompts 6 --rounds 3

pagedserve runs in this process (one engine per arm, 1 thread, closed loop at concurrency 1); llama-server runs
as one server per arm (`-np 1 -t 1 -tb 1`, f32 KV cache), one /completion at a time. Both arms of an engine
produce every token of max_tokens (ignore_eos) and prefill every prompt (llama.cpp: cache_prompt false), so
output tok/s = output tokens / wall time of the requests. llama.cpp's n-gram arm: `--spec-type ngram-simple`
(lookup of the last N tokens in the context, drafting the M tokens that followed); pagedserve's: its `ngram`
proposer (--ngram, vLLM's speculative_config). See benchmarks/README.md for building llama-server from the
llama-cpp-python sdist (PyPI only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side import Server, convert_to_gguf, find_llama_server, free_port, http_json  # noqa: E402
from spec_decode import code_edit_prompts, run_closed_loop  # noqa: E402

from pagedserve import EngineArgs  # noqa: E402
from pagedserve.demo_model_path import default_model_path  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402


def llamacpp_generate(base_url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], dict]:
    body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False,
            "temperature": 0.0, "top_k": 1, "stream": False, "return_tokens": True}
    code, resp = http_json(base_url + "/completion", body)
    if code != 200 or resp is None:
        raise RuntimeError(f"llama-server /completion: HTTP {code}")
    return list(resp.get("tokens") or []), resp.get("timings") or {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: as side_by_side.py finds it)")
    p.add_argument("--convert-with", default=None, metavar="LLAMA_CPP_SRC",
                   help="llama.cpp source dir, to convert the demo model to --gguf if it does not exist")
    p.add_argument("--gguf", default=os.path.join(tempfile.gettempdir(), "pagedserve_demo_f32.gguf"))
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ngram", default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                      '"prompt_lookup_max": 4}', help="pagedserve's speculative_config (JSON)")
    p.add_argument("--llama-spec-args", default="--spec-type ngram-simple --spec-ngram-simple-size-n 2 "
                                                "--spec-ngram-simple-size-m 4",
                   help="llama-server flags of its n-gram arm")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    server_bin, tried = find_llama_server(args.llama_server)
    if server_bin is None:
        raise SystemExit(f"llama-server not found (looked at: {', '.join(tried)})")
    model_dir = default_model_path()
    if not os.path.isfile(args.gguf):
        if not args.convert_with:
            raise SystemExit(f"{args.gguf} does not exist: give --convert-with LLAMA_CPP_SRC")
        convert_to_gguf(args.convert_with, model_dir, args.gguf)
    torch.set_num_threads(1)
    engines = {"off": LLMEngine.from_engine_args(EngineArgs(model=model_dir, num_threads=1, dtype="float32")),
               "ngram": LLMEngine.from_engine_args(EngineArgs(model=model_dir, num_threads=1, dtype="float32",
                                                              speculative_config=json.loads(args.ngram)))}
    prompts = code_edit_prompts(engines["off"].tokenizer, args.num_prompts, args.seed)
    out_tokens = args.num_prompts * args.max_tokens
    log_dir = tempfile.mkdtemp(prefix="spec_llamacpp_")
    servers = {}
    for arm, extra in (("off", []), ("ngram", args.llama_spec_args.split())):
        port = free_port()
        servers[arm] = Server(f"llama.cpp {arm}", [
            server_bin, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "2048",
            "-t", "1", "-tb", "1", "--cache-type-k", "f32", "--cache-type-v", "f32", "--no-webui", *extra],
            port, os.path.join(log_dir, f"llamacpp_{arm}.log"))
    results: dict[str, list[float]] = {f"{e} {a}": [] for e in ("pagedserve", "llama.cpp") for a in ("off", "ngram")}
    outputs: dict[str, dict] = {}
    draft_stats = {"draft_n": 0, "draft_n_accepted": 0}
    try:
        for srv in servers.values():
            srv.start(120)
        for arm, engine in engines.items():  # warm-up, not measured
            run_closed_loop(engine, prompts[:1], 1, 16, f"warm-{arm}")
            llamacpp_generate(servers[arm].base_url, prompts[0], 16)
        for rnd in range(args.rounds):
            order = ["off", "ngram"] if rnd % 2 == 0 else ["ngram", "off"]
            for arm in order:
                wall, _, outs = run_closed_loop(engines[arm], prompts, 1, args.max_tokens, f"r{rnd}-{arm}")
                results[f"pagedserve {arm}"].append(out_tokens / wall)
                outputs[f"pagedserve {arm}"] = outs
                t0 = time.perf_counter()
                llama_outs = {}
                for i, prompt in enumerate(prompts):
                    tokens, timings = llamacpp_generate(servers[arm].base_url, prompt, args.max_tokens)
                    llama_outs[str(i)] = tokens
                    if arm == "ngram" and rnd == 0:
                        for key in draft_stats:
                            draft_stats[key] += int(timings.get(key) or 0)
                results[f"llama.cpp {arm}"].append(out_tokens / (time.perf_counter() - t0))
                outputs[f"llama.cpp {arm}"] = llama_outs
    finally:
        for srv in servers.values():
            srv.stop()

    spec = engines["ngram"].scheduler.spec_stats
    medians = {k: statistics.median(v) for k, v in results.items()}
    identical = {e: outputs[f"{e} off"] == outputs[f"{e} ngram"] for e in ("pagedserve", "llama.cpp")}
    same_as_llamacpp = sum(outputs["pagedserve off"][k] == outputs["llama.cpp off"][k] for k in outputs["pagedserve off"])
    report = {
        "model": model_dir, "dtype": "float32 (both)", "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "pagedserve_ngram": json.loads(args.ngram), "llama_spec_args": args.llama_spec_args,
        "output_tok_s": medians, "all_rounds": results, "identical_with_and_without_speculation": identical,
        "pagedserve_acceptance_rate": spec.num_accepted_tokens / max(spec.num_draft_tokens, 1),
        "llamacpp_acceptance_rate": draft_stats["draft_n_accepted"] / max(draft_stats["draft_n"], 1),
        "llamacpp_draft_stats_round0": draft_stats,
        "prompts_where_both_engines_agree_without_speculation": f"{same_as_llamacpp}/{len(prompts)}",
    }
    print(json.dumps(report, indent=2))
    print("| engine | off tok/s | n-gram tok/s | n-gram vs off | acceptance rate | identical |")
    print("| --- | ---: | ---: | ---: | ---: | :---: |")
    for e, rate in (("pagedserve", report["pagedserve_acceptance_rate"]),
                    ("llama.cpp", report["llamacpp_acceptance_rate"])):
        off, ng = medians[f"{e} off"], medians[f"{e} ngram"]
        print(f"| {e} | {off:.1f} | {ng:.1f} | {ng / off:.2f}x | {rate:.3f} | {'yes' if identical[e] else 'no'} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
