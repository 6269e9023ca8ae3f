"""pagedserve vs vLLM's CPU backend vs OpenVINO GenAI vs llama.cpp, side by side, in three precision groups (issue 12, part 1).

    python benchmarks/cpu_peers.py --model /work/peers/models/smollm2-135m \\
        --vllm-venv /work/peers/vllm --openvino-venv /work/peers/openvino \\
        --precisions fp32,bf16,int8 --concurrency 1,16,32 --num-prompts 32 --c1-num-prompts 8 --threads 2 \\
        --output-dir bench_results/cpu_peers-smollm2

Peer setup (each in its own virtualenv outside the repo, so none of their pins touch ours): see BENCHMARKS.md,
section "Side by side with vLLM CPU and OpenVINO GenAI (issue 12)".

One workload for every engine: seeded random token-id prompts (`--dataset mixed`, the generator of
pagedserve/benchmarks/datasets.py: prompts 32..1024, outputs 16..512 tokens, log-uniform; or `--dataset random`),
exact output lengths (ignore_eos), greedy, closed loop at concurrency C.  Every engine gets the same scheduler
budget (2048 batched tokens, chunked prefill, prefix caching on; the prompts are random, so nothing is shared), the
same thread count and a KV pool big enough for the C longest requests of the workload (nothing is preempted).
Each server serves every C in turn, so the runs at the smaller C use seed + C (fresh prompts: reusing one prompt
set would turn every later run's prefills into prefix-cache hits); the largest C uses --seed.

  pagedserve  `pagedserve serve MODEL` (one server per precision group, for every C), loaded by `pagedserve bench
              serve --max-concurrency C --request-rate inf --ignore-eos` (the client of side_by_side.py).
  vLLM CPU    vLLM's own OpenAI server (`vllm serve`, started through benchmarks/peers/vllm_cpu_cli.py with the
              python of --vllm-venv), loaded by the same `pagedserve bench serve` command.  Env:
              VLLM_CPU_KVCACHE_SPACE (GiB, from the KV need), VLLM_CPU_OMP_THREADS_BIND=0-(T-1).
  OpenVINO    OpenVINO GenAI's ContinuousBatchingPipeline has no HTTP server: benchmarks/peers/openvino_cb_driver.py
  GenAI       runs in --openvino-venv and drives it in-process, closed loop at C (step(), read each request's
              handle, add the next request when one finishes); it writes per-request TTFT/ITL/latency, and this
              script turns them into the `bench serve` result JSON with the same code (pagedserve/benchmarks/
              metrics.py).  The IR is exported once per weight format with `optimum-cli export openvino`
              (cached in --ov-cache-dir).
  llama.cpp   `llama-server -m GGUF -np C -c C*max_model_len -t T -tb T -b BUDGET` (one server per C; the GGUF of the
              same checkpoint per precision group from --gguf PRECISION=FILE, e.g. BF16 for bf16 and Q8_0 for int8;
              KV bf16 in the bf16 group, f32 otherwise), loaded by the same `bench serve` command.  Skipped, with a
              message, when llama-server or the group's GGUF is missing.
  pagedserve  (engine "pagedserve-engine", like for like with OpenVINO's driver) benchmarks/peers/
  engine      pagedserve_engine_driver.py: pagedserve's LLMEngine in-process, the same closed loop and output
              format as the OpenVINO driver, with the `pagedserve serve` engine flags of the group. No HTTP, SSE or
              benchmark client on the 2 cores: the engine alone, as OpenVINO is measured.

Precision groups (pagedserve flag / vLLM flag / OpenVINO setting):

  fp32  --dtype float32        / --dtype float32   / fp32 IR, INFERENCE_PRECISION_HINT=f32, KV cache f32
  bf16  --dtype bfloat16       / --dtype bfloat16  / fp32 IR, INFERENCE_PRECISION_HINT=bf16, KV cache bf16
  int8  --quantization int8    / (skipped: vLLM CPU has no weight-only int8 for an unquantized checkpoint)
        (int8 weights, fp32      / int8 IR (`--weight-format int8`), INFERENCE_PRECISION_HINT=--ov-int8-hint
         activations, fp32 KV)     (f32), KV cache f32 (bf16 with the bf16 hint: OpenVINO's paged attention
                                   demands it); OpenVINO also quantizes activations dynamically here

GGUF groups (issue 52): `--gguf LABEL=FILE` (repeated) adds a group LABEL in which every engine runs the weights of
one GGUF file (llama-quantize's Q4_0 / Q4_K_M / Q8_0 ... of --model):

  pagedserve  `pagedserve serve FILE --dtype float32` (the block-quantized kernel; the file's own tokenizer)
  llama.cpp   llama-server on the same FILE (engine "llamacpp", --llama-server), one server per C with `-np C -cb -c
              C*--max-model-len -t T -tb T`, KV --llama-kv-type (f32 = pagedserve's), loaded by `bench serve`
  OpenVINO    --model exported by optimum-cli with NNCF weight compression of the same width: `--weight-format int4`
              for a 4-bit LABEL (Q4_*), int8 for Q8_0; other labels skip OpenVINO
  vLLM CPU    skipped (not one of issue 52's peers)

A peer whose venv (or llama-server binary) is missing (or does not import) is skipped with a message, so CI never
needs the peers.

--rounds N repeats every precision group N times, the engines' order alternating (A B, B A, ...): on these VMs two
runs of the same command an hour apart differ by 10-15%, so one run per cell cannot tell a 1.15x target from noise.
Ratios are then paired within a round and reported as median [min-max]; round k's files go to OUTPUT_DIR/round<k>.

Outputs in --output-dir: cpu_peers.md (tables: output tok/s, TTFT p50/p99, ITL p50/p99, TPOT p50 per engine,
precision and C; ratios pagedserve vs each peer), cpu_peers.json, every result JSON (`<engine>-<precision>-c<C>.json`,
the `bench serve --save-result` shape), server / driver logs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (REPO, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import side_by_side as sbs  # (Server, free_port, pagedserve_cmd, subprocess_env, dataset_flags, ...)

ENGINES = ("pagedserve", "pagedserve-engine", "vllm", "openvino", "llamacpp")
OURS = ("pagedserve", "pagedserve-engine")
SERVED = ("pagedserve", "vllm", "llamacpp")  # behind an HTTP server, loaded by `bench serve`
LABELS = {"pagedserve": "pagedserve", "pagedserve-engine": "pagedserve engine (in-process)", "vllm": "vLLM CPU",
          "openvino": "OpenVINO GenAI CB", "llamacpp": "llama.cpp llama-server"}
PRECISIONS = ("fp32", "bf16", "int8")
KV_BYTES = {"fp32": 4, "bf16": 2, "int8": 4}  # KV element size per group (int8 = int8 weights, fp32 KV)
VLLM_WRAPPER = os.path.join(HERE, "peers", "vllm_cpu_cli.py")
OV_DRIVER = os.path.join(HERE, "peers", "openvino_cb_driver.py")
ENGINE_DRIVER = os.path.join(HERE, "peers", "pagedserve_engine_driver.py")
DEFAULT_VLLM_VENV = "/work/peers/vllm"
DEFAULT_OV_VENV = "/work/peers/openvino"
LLAMA_KV = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}  # llama-server --cache-type-k/v per group, as ours


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint dir (e.g. from `pagedserve bench make-model`)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ",".join(ENGINES))
    p.add_argument("--gguf", action="append", default=[], metavar="KEY=FILE",
                   help="repeated. KEY a precision (fp32, bf16, int8): llama.cpp's model in that group, the same "
                        "checkpoint converted to GGUF (e.g. bf16=M-bf16.gguf, int8=M-q8_0.gguf; a group without one "
                        "skips llama.cpp). Any other KEY: a GGUF group of that LABEL, every engine on the file's "
                        "weights (see the GGUF groups above)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: side_by_side.py's lookup)")
    p.add_argument("--llama-kv-type", default="f32", choices=["f32", "f16"],
                   help="llama-server's KV cache type in the GGUF groups (the precision groups use theirs: "
                        + ", ".join(f"{k} {v}" for k, v in LLAMA_KV.items()) + ")")
    p.add_argument("--through-server", action="store_true",
                   help="only the engines behind their own HTTP server (" + ",".join(SERVED) + "), loaded by the same "
                        "`bench serve` client: the end-to-end numbers a user sees (issue 50); a peer whose venv is "
                        "missing is skipped. benchmarks/server_overhead.py puts our server beside our engine in-process")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of " + ",".join(PRECISIONS))
    p.add_argument("--concurrency", default="1,16,32", help="comma list of closed-loop concurrencies C")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--c1-num-prompts", type=int, default=None,
                   help="requests in the concurrency-1 runs (default --num-prompts; same generator and seed, so the "
                        "same workload for every engine, a different one from the C>1 runs when it differs)")
    p.add_argument("--dataset", default="mixed", choices=["mixed", "random"],
                   help="mixed: prompts 32..1024, outputs 16..512 (log-uniform); random: the --random-* lengths")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed of the largest C; every other C uses seed + C (see --same-prompts-every-c)")
    p.add_argument("--same-prompts-every-c", action="store_true",
                   help="one seed for every C.  Off by default: a server serves every C in turn with prefix caching "
                        "on, so the second run of the same prompts would find them all in the prefix cache")
    p.add_argument("--threads", type=int, default=2, help="threads per engine")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step, every engine")
    p.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV, help="virtualenv with vllm-cpu (its bin/python)")
    p.add_argument("--openvino-venv", default=DEFAULT_OV_VENV,
                   help="virtualenv with openvino-genai + optimum-intel (its bin/python, bin/optimum-cli)")
    p.add_argument("--ov-cache-dir", default=None,
                   help="where the exported OpenVINO IRs live (default: next to --model, MODEL-ov-<format>)")
    p.add_argument("--ov-int8-hint", default="f32", choices=["f32", "bf16"],
                   help="OpenVINO INFERENCE_PRECISION_HINT in the int8 group (f32 = pagedserve's int8 activations)")
    p.add_argument("--structured-output", default=None, choices=["json_schema", "regex", "choice"],
                   help="also run every workload constrained (bench serve --structured-output), right after the free "
                        "run on the same server, with fresh prompts (seed + 1000; give --random-range-ratio 0 for the "
                        "same lengths): rows PRECISION+KIND, to compare what a constraint costs each engine")
    p.add_argument("--serve-args", default="", help="extra flags for `pagedserve serve` (one string)")
    p.add_argument("--vllm-args", default="", help="extra flags for `vllm serve` (one string)")
    p.add_argument("--vllm-preload", default="none",
                   help="LD_PRELOAD for the vLLM server: none (default), auto (tcmalloc + the venv's libiomp5, what "
                        "vLLM's CPU docs recommend and its worker warns about), or a ':'-separated list of libraries")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for a server's /health")
    p.add_argument("--http-client", choices=("httpx", "aiohttp"), default="httpx",
                   help="`bench serve --http-client` for every server run (aiohttp: less client CPU on shared cores)")
    p.add_argument("--output-dir", default=None, help="default: bench_results/cpu_peers-<date>")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every precision group this many times, alternating the engines' order (A B, B A, ...); "
                        "ratios are paired within a round and reported as median [min-max] (round k's files go to "
                        "OUTPUT_DIR/round<k>)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild cpu_peers.md/.json from the result JSONs already in --output-dir "
                        "(same flags as the run; e.g. after an interrupted run)")
    args = p.parse_args(argv)
    sbs.parse_engine_lists(p, args, ENGINES)
    if args.through_server:
        args.engine_list = [e for e in args.engine_list if e in SERVED]
        if not args.engine_list:
            p.error(f"--through-server: none of --engines is served over HTTP ({','.join(SERVED)})")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.precision_list = [x.strip() for x in args.precisions.split(",") if x.strip()]
    bad = [x for x in args.precision_list if x not in PRECISIONS]
    if bad:
        p.error(f"--precisions: unknown {bad}; choose from {','.join(PRECISIONS)}")
    args.gguf_files, args.gguf_by_precision = {}, {}
    for item in args.gguf:
        label, sep, path = item.partition("=")
        if not sep or not label or not path or "+" in label or label in args.gguf_files | args.gguf_by_precision:
            p.error(f"--gguf {item!r}: want KEY=FILE with a new KEY (a precision or a group LABEL, no '+')")
        (args.gguf_by_precision if label in PRECISIONS else args.gguf_files)[label] = path
    if args.gguf_files and not any(a.startswith("--precisions") for a in (argv if argv is not None else sys.argv)):
        args.precision_list = []  # --gguf alone: only the GGUF groups
    args.precision_list += list(args.gguf_files)
    return args


# ------------------------------------------------------------------------------------------ workload


def build_samples(args):
    """The exact samples `pagedserve bench serve <side_by_side.dataset_flags(args)>` builds."""
    return sbs.build_samples(args)


def workload_args(args, conc: int, fresh: bool = False) -> argparse.Namespace:
    """args with the workload of the runs at concurrency `conc`: --c1-num-prompts at C=1, and seed + C for every C
    but the largest (fresh prompts per C: no run may find the previous run's prompts in the prefix cache).
    fresh: other prompts again (a constrained rerun of the same C); the same lengths when --random-range-ratio is 0."""
    n = args.c1_num_prompts if conc == 1 and args.c1_num_prompts else args.num_prompts
    seed = args.seed
    if not args.same_prompts_every_c and conc != max(args.concurrencies):
        seed = args.seed + conc
    if fresh:
        seed += 1000
    return argparse.Namespace(**dict(vars(args), num_prompts=n, seed=seed))


def build_workloads(args) -> tuple[dict, dict]:
    """{C: samples} and {C: description}; every engine gets exactly these."""
    cache: dict[tuple, tuple] = {}
    workloads, described = {}, {}
    for c in args.concurrencies:
        wa = workload_args(args, c)
        key = (wa.num_prompts, wa.seed)
        if key not in cache:
            samples, describe = build_samples(wa)
            cache[key] = (samples, describe(samples))
        workloads[c], described[c] = cache[key]
    return workloads, described


def samples_for_driver(samples) -> list[dict]:
    """The workload as the OpenVINO driver reads it (token ids + exact output length, in order)."""
    return [{"prompt": list(s.prompt), "output_len": int(s.expected_output_len)} for s in samples]


def kv_blocks_needed(samples, conc: int, block: int = 16) -> int:
    """KV blocks for the `conc` longest requests (prompt + output) at once: nothing is ever preempted."""
    need = sorted((math.ceil((s.prompt_len + s.expected_output_len) / block) for s in samples), reverse=True)
    return max(1, sum(need[:conc]))


def kv_bytes_per_token(model_dir: str, elem_bytes: int) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * elem_bytes


# --------------------------------------------------------------------------------------- peers


def venv_python(venv: str | None) -> str | None:
    if not venv:
        return None
    py = os.path.join(venv, "bin", "python")
    return py if os.path.isfile(py) and os.access(py, os.X_OK) else None


def probe_peer(engine: str, venv: str | None) -> tuple[dict | None, str | None]:
    """(versions, None) if the peer's venv is there and its packages import; else (None, why)."""
    py = venv_python(venv)
    if py is None:
        return None, f"no virtualenv at {venv!r} (want {venv}/bin/python); see BENCHMARKS.md section on issue 12"
    if engine == "vllm":
        dists, mods = ("vllm-cpu", "torch", "transformers"), "vllm"
    else:
        dists, mods = ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "optimum", "torch",
                       "transformers", "nncf"), "openvino_genai"
    code = ("import importlib.metadata as m, importlib.util as u, json, sys\n"
            f"ok = u.find_spec({mods!r}) is not None\n"
            "v = {}\n"
            f"for d in {dists!r}:\n"
            "    try: v[d] = m.version(d)\n"
            "    except Exception: pass\n"
            "print(json.dumps({'ok': ok, 'versions': v}))\n")
    try:
        r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
        info = json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:  # broken venv
        return None, f"{py} does not run: {type(e).__name__}: {e}"
    if not info["ok"]:
        return None, f"{py} cannot import {mods}"
    return info["versions"], None


def pagedserve_version() -> str:
    try:
        sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"git {sha}{' + uncommitted changes' if dirty else ''}" if sha else "?"
    except Exception:
        return "?"


# ------------------------------------------------------------------------------------------ engines


def ov_weight_format_for_gguf(label: str) -> str | None:
    """The NNCF weight width of OpenVINO's counterpart to a GGUF type: int4 for the 4-bit types, int8 for Q8_0."""
    name = label.upper()
    return "int4" if name.startswith("Q4") else "int8" if name.startswith("Q8") else None


def engine_flags(engine: str, precision: str, args) -> tuple[list[str] | dict | None, str]:
    """(flags for the engine in this precision group, or None if the engine has no such group; a note)."""
    if precision in args.gguf_files:
        return gguf_engine_flags(engine, precision, args)
    if engine in OURS:
        return {"fp32": (["--dtype", "float32"], "--dtype float32"),
                "bf16": (["--dtype", "bfloat16"], "--dtype bfloat16 (KV bf16)"),
                "int8": (["--dtype", "float32", "--quantization", "int8"],
                         "--quantization int8 (weight-only int8, fp32 activations and KV)")}[precision]
    if engine == "llamacpp":
        gguf = args.gguf_by_precision.get(precision)
        if gguf is None:
            return None, f"no --gguf {precision}=FILE given"
        return llama_gguf_flags(gguf, LLAMA_KV[precision]), f"{os.path.basename(gguf)}, KV {LLAMA_KV[precision]}"
    if engine == "vllm":
        if precision == "int8":
            return None, "vLLM CPU has no weight-only int8 for an unquantized checkpoint (it needs a pre-quantized one)"
        dt = {"fp32": "float32", "bf16": "bfloat16"}[precision]
        return ["--dtype", dt], f"--dtype {dt} (KV {dt})"
    # openvino: IR weight format + properties
    hint = {"fp32": "f32", "bf16": "bf16", "int8": args.ov_int8_hint}[precision]
    # OpenVINO's paged attention takes a bf16 KV cache only with the bf16 hint (and demands it then)
    kv = {"fp32": "f32", "bf16": "bf16", "int8": "bf16" if hint == "bf16" else "f32"}[precision]
    fmt = "int8" if precision == "int8" else "fp32"
    props = {"INFERENCE_PRECISION_HINT": hint, "KV_CACHE_PRECISION": kv, "KEY_CACHE_PRECISION": kv,
             "VALUE_CACHE_PRECISION": kv, "INFERENCE_NUM_THREADS": args.threads}
    note = f"{fmt} IR, INFERENCE_PRECISION_HINT={hint}, KV {kv}"
    if precision == "int8":
        note += " (dynamic activation quantization: OpenVINO's default)"
    return {"weight_format": fmt, "properties": props}, note


def llama_gguf_flags(gguf: str, kv_type: str) -> list[str]:
    return ["-m", gguf, "--cache-type-k", kv_type, "--cache-type-v", kv_type]


def gguf_engine_flags(engine: str, label: str, args) -> tuple[list[str] | dict | None, str]:
    """engine_flags for a GGUF group: the file for pagedserve and llama.cpp, the same-width NNCF IR for OpenVINO."""
    path = args.gguf_files[label]
    if engine in OURS:
        return ["--dtype", "float32"], f"GGUF {label} file {os.path.basename(path)}, float32 activations, KV f32"
    if engine == "llamacpp":
        return (llama_gguf_flags(path, args.llama_kv_type),
                f"GGUF {label} file {os.path.basename(path)}, KV {args.llama_kv_type}")
    if engine == "vllm":
        return None, "vLLM CPU is not run on the GGUF groups"
    fmt = ov_weight_format_for_gguf(label)
    if fmt is None:
        return None, f"no OpenVINO weight format of the width of {label}"
    props = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "KEY_CACHE_PRECISION": "f32",
             "VALUE_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": args.threads}
    return ({"weight_format": fmt, "properties": props},
            f"NNCF {fmt} IR (optimum-cli --weight-format {fmt}, its defaults), INFERENCE_PRECISION_HINT=f32, KV f32")


def model_source(precision: str, args) -> str:
    """What pagedserve loads in this group: the GGUF file of a GGUF group, else --model."""
    return args.gguf_files.get(precision, args.model)


def result_name(engine: str, precision: str, conc: int) -> str:
    return f"{engine}-{precision}-c{conc}.json"


def precision_order(label: str) -> tuple[int, str]:
    """Sort key of a row's precision label ("bf16", or "bf16+json_schema" for a constrained rerun)."""
    base, _, structured = label.partition("+")
    return (PRECISIONS.index(base) if base in PRECISIONS else len(PRECISIONS)), structured


def serve_each_concurrency(engine: str, label: str, precision: str, base_url: str, name: str, args, out_dir: str,
                           workloads, rows: list, skipped: dict, notes: str) -> None:
    """`bench serve` against one running server at every --concurrency; a row each, or a skip note. With
    --structured-output the same requests run twice back to back, free and constrained (a row "PRECISION+KIND")."""
    for c in args.concurrencies:
        for structured in (None, args.structured_output) if args.structured_output else (None,):
            row_precision = precision if structured is None else f"{precision}+{structured}"
            res = run_bench_serve(engine, row_precision, base_url, name, c, args, out_dir, structured)
            if res is None:
                skipped[f"{label} {row_precision} C={c}"] = "bench serve failed"
                continue
            rows.append(make_row(engine, row_precision, c, res, workloads[c], notes=notes))


def run_bench_serve(engine: str, precision: str, base_url: str, served_name: str, conc: int, args,
                    out_dir: str, structured: str | None = None, extra: tuple[str, ...] = ()) -> dict | None:
    fname = result_name(engine, precision, conc)
    cmd = sbs.pagedserve_cmd("bench", "serve", "--base-url", base_url, "--model", served_name,
                             *sbs.dataset_flags(workload_args(args, conc, fresh=structured is not None)), "--ignore-eos", "--request-rate", "inf",
                             "--max-concurrency", str(conc), "--percentile-metrics", "ttft,tpot,itl,e2el",
                             "--metric-percentiles", "50,99", "--label", f"{engine}-{precision}", "--save-result",
                             "--result-dir", out_dir, "--result-filename", fname, "--disable-tqdm",
                             "--ready-check-timeout-sec", "300", "--http-client", args.http_client,
                             *(("--structured-output", structured) if structured else ()), *extra)
    log(f"[{LABELS[engine]} {precision}] C={conc}: {' '.join(cmd)}")
    r = subprocess.run(cmd, env=sbs.subprocess_env())
    path = os.path.join(out_dir, fname)
    if r.returncode != 0 or not os.path.isfile(path):
        log(f"[{LABELS[engine]} {precision}] C={conc}: bench serve failed (exit {r.returncode})")
        return None
    with open(path) as f:
        return json.load(f)


def make_row(engine: str, precision: str, conc: int, res: dict, samples, notes: str = "") -> dict:
    expected = [s.expected_output_len for s in samples]
    ok = [not e for e in res.get("errors", [])]
    exact = (res["output_lens"] == expected and all(ok) and res["input_lens"] == [s.prompt_len for s in samples])
    d = res["duration"]
    return {"engine": engine, "label": LABELS[engine], "precision": precision, "concurrency": conc,
            "completed": res["completed"], "failed": res["failed"], "duration_s": d,
            "total_input_tokens": res["total_input_tokens"], "total_output_tokens": res["total_output_tokens"],
            "output_tok_s": res["total_output_tokens"] / d if d > 0 else 0.0,
            "total_tok_s": (res["total_input_tokens"] + res["total_output_tokens"]) / d if d > 0 else 0.0,
            "ttft_p50_ms": res["median_ttft_ms"], "ttft_p99_ms": res["p99_ttft_ms"],
            "itl_p50_ms": res["median_itl_ms"], "itl_p99_ms": res["p99_itl_ms"],
            "tpot_p50_ms": res.get("median_tpot_ms"), "exact_lengths": exact, "notes": notes,
            "result_file": result_name(engine, precision, conc)}


def kv_blocks_for(workloads: dict) -> int:
    return max(kv_blocks_needed(samples, c) for c, samples in workloads.items())


def pagedserve_engine_flags(args, blocks: int) -> list[str]:
    """The engine flags every pagedserve run gets, through the server or in-process (the group's come after)."""
    return ["--device", "cpu", "--num-threads", str(args.threads), "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(max(args.concurrencies)), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--enable-chunked-prefill", "--enable-prefix-caching", "--num-kv-blocks", str(blocks)]


def run_pagedserve(args, precision: str, workloads: dict, out_dir: str, rows: list, skipped: dict) -> None:
    flags, note = engine_flags("pagedserve", precision, args)
    blocks = kv_blocks_for(workloads)
    port = sbs.free_port()
    name = f"pagedserve-{os.path.basename(os.path.normpath(args.model))}-{precision}"
    cmd = sbs.pagedserve_cmd("serve", model_source(precision, args), "--host", "127.0.0.1", "--port", str(port),
                             *pagedserve_engine_flags(args, blocks),
                             "--served-model-name", name, "--disable-log-stats", "--disable-uvicorn-access-log",
                             "--uvicorn-log-level", "warning", *flags, *args.serve_args.split())
    srv = sbs.Server(f"pagedserve {precision}", cmd, port, os.path.join(out_dir, f"pagedserve-{precision}-server.log"),
                     env=sbs.subprocess_env())
    try:
        srv.start(args.startup_timeout)
        serve_each_concurrency("pagedserve", "pagedserve", precision, srv.base_url, name, args, out_dir, workloads,
                               rows, skipped, f"{note}; --num-kv-blocks {blocks} (block 16)")
    except RuntimeError as e:
        log(str(e))
        skipped[f"pagedserve {precision}"] = str(e).splitlines()[0]
    finally:
        srv.stop()


TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def vllm_preload(spec: str, venv: str) -> str:
    """The LD_PRELOAD value for --vllm-preload ('' for none)."""
    if spec in ("", "none"):
        return ""
    if spec != "auto":
        return spec
    libs = [next((p for p in TCMALLOC_PATHS if os.path.isfile(p)), None), os.path.join(venv, "lib", "libiomp5.so")]
    return ":".join(p for p in libs if p and os.path.isfile(p))


def run_vllm(args, precision: str, workloads: dict, out_dir: str, rows: list, skipped: dict) -> None:
    flags, note = engine_flags("vllm", precision, args)
    if flags is None:
        log(f"SKIP vLLM CPU {precision}: {note}")
        skipped[f"vLLM CPU {precision}"] = note
        return
    cmax = max(args.concurrencies)
    blocks = kv_blocks_for(workloads)
    kv_gib = max(1, math.ceil(blocks * 16 * kv_bytes_per_token(args.model, KV_BYTES[precision]) / 2**30))
    port = sbs.free_port()
    name = f"vllm-{os.path.basename(os.path.normpath(args.model))}-{precision}"
    cmd = [venv_python(args.vllm_venv), VLLM_WRAPPER, "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", name, "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(cmax),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--enable-chunked-prefill",
           "--enable-prefix-caching", "--seed", str(args.seed), *flags, *args.vllm_args.split()]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing of ours in the peer's interpreter
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                "CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": str(args.threads)})
    preload = vllm_preload(args.vllm_preload, args.vllm_venv)
    if preload:
        env["LD_PRELOAD"] = preload
        note += f"; LD_PRELOAD={preload}"
    srv = sbs.Server(f"vLLM CPU {precision}", cmd, port, os.path.join(out_dir, f"vllm-{precision}-server.log"), env=env)
    try:
        t0 = time.perf_counter()
        srv.start(args.startup_timeout)
        log(f"[vLLM CPU {precision}] start-up took {time.perf_counter() - t0:.0f} s")
        serve_each_concurrency("vllm", "vLLM CPU", precision, srv.base_url, name, args, out_dir, workloads, rows,
                               skipped, f"{note}; VLLM_CPU_KVCACHE_SPACE={kv_gib} GiB, "
                                        f"VLLM_CPU_OMP_THREADS_BIND=0-{args.threads - 1}")
    except RuntimeError as e:
        log(str(e))
        skipped[f"vLLM CPU {precision}"] = str(e).splitlines()[0]
    finally:
        srv.stop()


def ov_ir_dir(args, weight_format: str) -> str:
    base = os.path.basename(os.path.normpath(args.model))
    root = args.ov_cache_dir or os.path.dirname(os.path.abspath(os.path.normpath(args.model)))
    return os.path.join(root, f"{base}-ov-{weight_format}")


def ensure_ov_ir(args, weight_format: str, out_dir: str) -> str:
    """Export --model to an OpenVINO IR with optimum-cli (once; reused when it is there)."""
    ir = ov_ir_dir(args, weight_format)
    if os.path.isfile(os.path.join(ir, "openvino_model.xml")):
        return ir
    cli = os.path.join(args.openvino_venv, "bin", "optimum-cli")
    cmd = [cli, "export", "openvino", "--model", args.model, "--task", "text-generation-with-past",
           "--weight-format", weight_format, ir]
    log(f"[OpenVINO] exporting: {' '.join(cmd)}")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    with open(os.path.join(out_dir, f"openvino-export-{weight_format}.log"), "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0 or not os.path.isfile(os.path.join(ir, "openvino_model.xml")):
        raise RuntimeError(f"optimum-cli export failed (exit {r.returncode}); see openvino-export-{weight_format}.log")
    return ir


def outcomes_from_driver(recs: list[dict]):
    from pagedserve.benchmarks.metrics import RequestOutcome

    return [RequestOutcome(success=bool(r["success"]), prompt_len=int(r["prompt_len"]),
                           output_tokens=int(r["output_tokens"]), ttft=float(r["ttft"]), itl=list(r["itl"]),
                           latency=float(r["latency"]), start_time=float(r["start_time"]), error=r.get("error", ""))
            for r in recs]


BACKENDS = {"openvino": "openvino-genai-cb (in-process)", "pagedserve-engine": "pagedserve LLMEngine (in-process)"}


def result_from_driver(run: dict, conc: int, label: str, backend: str = BACKENDS["openvino"]) -> dict:
    """The driver's per-request timings -> the `bench serve --save-result` JSON (same metrics code)."""
    from pagedserve.benchmarks.metrics import calculate_metrics, result_dict

    outcomes = outcomes_from_driver(run["requests"])
    m = calculate_metrics(outcomes, run["duration"], (50, 99))
    res = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend,
           "label": label, "num_prompts": len(outcomes), "request_rate": "inf", "max_concurrency": conc,
           "ignore_eos": True}
    res.update(result_dict(m, outcomes))
    return res


def run_openvino(args, precision: str, workloads: dict, out_dir: str, rows: list, skipped: dict) -> None:
    cfg, note = engine_flags("openvino", precision, args)
    if cfg is None:
        log(f"SKIP OpenVINO {precision}: {note}")
        skipped[f"OpenVINO {precision}"] = note
        return
    try:
        ir = ensure_ov_ir(args, cfg["weight_format"], out_dir)
    except RuntimeError as e:
        log(f"SKIP OpenVINO {precision}: {e}")
        skipped[f"OpenVINO {precision}"] = str(e)
        return
    blocks = kv_blocks_for(workloads)
    spec = {"model_dir": ir, "device": "CPU", "properties": cfg["properties"],
            "scheduler": {"max_num_batched_tokens": args.max_num_batched_tokens, "num_kv_blocks": blocks,
                          "dynamic_split_fuse": True, "enable_prefix_caching": True,
                          "max_num_seqs": max(args.concurrencies)}}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    run_driver("openvino", precision, [venv_python(args.openvino_venv), OV_DRIVER], spec, env, args, out_dir,
               workloads, rows, skipped, f"{note}; num_kv_blocks {blocks}", {"openvino_properties": cfg["properties"]})


def run_driver(engine: str, precision: str, cmd: list[str], spec: dict, env: dict, args, out_dir: str,
               workloads: dict, rows: list, skipped: dict, note: str, extra: dict) -> None:
    """Runs an in-process driver (`cmd SPEC.json OUT.json`, peers/*_driver.py) on the workload of every C, closed
    loop, one warm-up request first; its OUT.json -> rows."""
    cmax = max(args.concurrencies)
    spec = dict(spec, concurrencies=args.concurrencies, warmup=True, requests=samples_for_driver(workloads[cmax]),
                requests_by_concurrency={str(c): samples_for_driver(w) for c, w in workloads.items() if c != cmax})
    spec_path = os.path.join(out_dir, f"{engine}-{precision}-spec.json")
    raw_path = os.path.join(out_dir, f"{engine}-{precision}-raw.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [*cmd, spec_path, raw_path]
    log(f"[{LABELS[engine]} {precision}] {' '.join(cmd)}  ({note})")
    with open(os.path.join(out_dir, f"{engine}-{precision}-driver.log"), "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if not os.path.isfile(raw_path):
        msg = f"driver failed (exit {r.returncode}); last lines:\n" + sbs.tail(f.name)
        log(f"SKIP {LABELS[engine]} {precision}: {msg}")
        skipped[f"{LABELS[engine]} {precision}"] = msg.splitlines()[0]
        return
    rows_from_driver(engine, precision, raw_path, r.returncode, args, out_dir, workloads, rows, skipped, note, extra)


def rows_from_driver(engine: str, precision: str, raw_path: str, returncode: int, args, out_dir: str,
                     workloads: dict, rows: list, skipped: dict, note: str, extra: dict) -> None:
    """An in-process driver's OUT.json (peers/*_driver.py) -> result JSONs and rows, one per C."""
    with open(raw_path) as f:
        raw = json.load(f)
    if returncode != 0:
        skipped[f"{LABELS[engine]} {precision} (partial)"] = f"driver exit {returncode}"
    for c in args.concurrencies:
        run = raw["runs"].get(str(c))
        if run is None:
            skipped[f"{LABELS[engine]} {precision} C={c}"] = "no result (driver stopped)"
            continue
        res = result_from_driver(run, c, f"{engine}-{precision}", BACKENDS[engine])
        res.update(extra, driver_versions=raw.get("versions"))
        with open(os.path.join(out_dir, result_name(engine, precision, c)), "w") as f:
            json.dump(res, f)
        rows.append(make_row(engine, precision, c, res, workloads[c], notes=note))


def run_pagedserve_engine(args, precision: str, workloads: dict, out_dir: str, rows: list, skipped: dict) -> None:
    """pagedserve's engine alone, in-process (peers/pagedserve_engine_driver.py), with the server's engine flags."""
    flags, note = engine_flags("pagedserve-engine", precision, args)
    blocks = kv_blocks_for(workloads)
    spec = {"model": model_source(precision, args),
            "engine_flags": pagedserve_engine_flags(args, blocks) + flags + args.serve_args.split()}
    run_driver("pagedserve-engine", precision, [sys.executable, ENGINE_DRIVER], spec, sbs.subprocess_env(), args,
               out_dir, workloads, rows, skipped, f"{note}; --num-kv-blocks {blocks} (block 16); in-process, no HTTP",
               {})


def llama_server_cmd(server_bin: str, flags: list[str], port: int, conc: int, name: str, args) -> list[str]:
    """llama-server on one GGUF file (flags: -m and the KV type) with C slots of --max-model-len each (continuous
    batching), T threads, the shared token budget."""
    return [server_bin, *flags, "--host", "127.0.0.1", "--port", str(port), "-np", str(conc), "-cb",
            "-c", str(conc * args.max_model_len), "-t", str(args.threads), "-tb", str(args.threads),
            "-b", str(args.max_num_batched_tokens), "--alias", name, "--no-webui"]


def run_llamacpp(args, precision: str, workloads: dict, out_dir: str, rows: list, skipped: dict) -> None:
    """llama-server on the group's GGUF file, a fresh server per C (its slot count is fixed at start-up)."""
    flags, note = engine_flags("llamacpp", precision, args)
    server_bin, tried = sbs.find_llama_server(args.llama_server)
    if flags is None or server_bin is None or not os.path.isfile(flags[1]):
        why = (note if flags is None else "no llama-server binary (tried " + ", ".join(tried) + ")"
               if server_bin is None else f"GGUF {flags[1]} not found")
        log(f"SKIP llama.cpp {precision}: {why}")
        skipped[f"llama.cpp {precision}"] = why
        return
    name = f"llamacpp-{os.path.basename(flags[1])}"
    for c in args.concurrencies:
        port = sbs.free_port()
        srv = sbs.Server(f"llama.cpp {precision} C={c}", llama_server_cmd(server_bin, flags, port, c, name, args),
                         port, os.path.join(out_dir, f"llamacpp-{precision}-c{c}-server.log"))
        try:
            srv.start(args.startup_timeout)
            res = run_bench_serve("llamacpp", precision, srv.base_url, name, c, args, out_dir)
            if res is None:
                skipped[f"llama.cpp {precision} C={c}"] = "bench serve failed"
            else:
                rows.append(make_row("llamacpp", precision, c, res, workloads[c],
                                     notes=f"{note}; -np {c} -cb -c {c * args.max_model_len}, -t/-tb {args.threads}, "
                                           f"-b {args.max_num_batched_tokens}"))
        except RuntimeError as e:
            log(str(e))
            skipped[f"llama.cpp {precision} C={c}"] = str(e).splitlines()[0]
        finally:
            srv.stop()


RUNNERS = {"pagedserve": run_pagedserve, "pagedserve-engine": run_pagedserve_engine, "vllm": run_vllm,
           "openvino": run_openvino, "llamacpp": run_llamacpp}


def round_dir(out_dir: str, k: int, rounds: int) -> str:
    """Where round k's files go (results, specs, logs): OUTPUT_DIR itself when there is one round."""
    return out_dir if rounds == 1 else os.path.join(out_dir, f"round{k}")


def engine_order(engines: list[str], k: int) -> list[str]:
    """Round k runs the engines in the given order when k is even and reversed when odd (A B, B A, A B, ...), so a
    drift of the machine's speed within the run (10-15% within the hour on these VMs) falls on every engine alike."""
    return list(engines) if k % 2 == 0 else list(reversed(engines))


def collect_results(args, workloads: dict, out_dir: str, rows: list, skipped: dict) -> None:
    """--report-only: the rows of the result JSONs already in out_dir (notes are not kept in them)."""
    labels = [p for base in args.precision_list
              for p in (base, f"{base}+{args.structured_output}" if args.structured_output else None) if p]
    for k in range(args.rounds):
        d, where = round_dir(out_dir, k, args.rounds), f" round {k}" if args.rounds > 1 else ""
        for prec in labels:
            for engine in ENGINES:
                for c in args.concurrencies:
                    path = os.path.join(d, result_name(engine, prec, c))
                    if os.path.isfile(path):
                        with open(path) as f:
                            row = make_row(engine, prec, c, json.load(f), workloads[c], notes="(from --report-only)")
                        rows.append(dict(row, round=k))
                    elif engine in args.engine_list:
                        skipped.setdefault(f"{LABELS[engine]} {prec} C={c}{where}", "no result file")


# ---------------------------------------------------------------------------------------------- report


THROUGHPUT_METRICS = ("output_tok_s",)
LATENCY_METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def ratios(rows: list[dict]) -> list[dict]:
    """pagedserve (through its server; and its engine alone, when run) vs every peer in the same precision group, C
    and round; > 1 = pagedserve better."""
    def div(a, b):
        return a / b if a is not None and b else float("nan")

    out = []
    ours = sorted((r for r in rows if r["engine"] in OURS), key=sort_key)
    for p in ours:
        prec, c, k = p["precision"], p["concurrency"], p.get("round", 0)
        for o in rows:
            if o["engine"] in OURS or o["precision"] != prec or o["concurrency"] != c or o.get("round", 0) != k:
                continue
            out.append({"precision": prec, "concurrency": c, "round": k, "ours": p["label"],
                        "ours_engine": p["engine"], "vs": o["label"], "vs_engine": o["engine"],
                        **{m: div(p[m], o[m]) for m in THROUGHPUT_METRICS},
                        **{m.removesuffix("_ms"): div(o[m], p[m]) for m in LATENCY_METRICS}})
    return out


def spread(values: list[float]) -> dict:
    """median, min and max of one metric over the rounds (NaNs, from a missing run, left out)."""
    v = [x for x in values if x is not None and not math.isnan(x)]
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def summarize_rows(rows: list[dict]) -> list[dict]:
    """One entry per engine, precision and C: every metric's spread over the rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in sort_rows(rows):
        groups.setdefault((r["precision"], r["concurrency"], r["engine"]), []).append(r)
    metrics = (*THROUGHPUT_METRICS, *LATENCY_METRICS, "tpot_p50_ms")
    return [{"precision": prec, "concurrency": c, "engine": e, "label": rs[0]["label"], "runs": len(rs),
             "all_exact": all(r["exact_lengths"] and not r["failed"] for r in rs),
             **{m: spread([r[m] for r in rs]) for m in metrics}} for (prec, c, e), rs in groups.items()]


def summarize_ratios(rats: list[dict]) -> list[dict]:
    """One entry per (ours, peer, precision, C): the spread of the ratios paired within each round."""
    groups: dict[tuple, list[dict]] = {}
    for q in rats:
        groups.setdefault((q["precision"], q["concurrency"], q["ours_engine"], q["vs_engine"]), []).append(q)
    metrics = (*THROUGHPUT_METRICS, *(m.removesuffix("_ms") for m in LATENCY_METRICS))
    return [{"precision": prec, "concurrency": c, "ours": qs[0]["ours"], "vs": qs[0]["vs"],
             "per_round": [q["output_tok_s"] for q in sorted(qs, key=lambda q: q["round"])],
             **{m: spread([q[m] for q in qs]) for m in metrics}} for (prec, c, _, _), qs in groups.items()]


def sort_key(r: dict) -> tuple:
    return precision_order(r["precision"]), r["concurrency"], r.get("round", 0), ENGINES.index(r["engine"])


def sort_rows(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=sort_key)


def format_report(meta: dict, rows: list[dict], rats: list[dict], skipped: dict) -> str:
    rounds = meta.get("rounds", 1)
    L = ["# pagedserve vs vLLM CPU vs OpenVINO GenAI (issue 12)", "",
         f"model `{meta['model']}`; {meta['threads']} threads per engine; workload {meta['dataset']}: "
         f"{meta['workload']}; closed loop at concurrency C, exact output lengths (ignore_eos), greedy; seed "
         f"{meta['seed']}; {meta['date']}", "",
         "versions: " + "; ".join(f"{k}: {v}" for k, v in meta["versions"].items()), ""]
    if rounds > 1:
        L += multi_round_tables(rounds, rows, rats) + ["", "Every run:", ""]
    every_run = rounds > 1
    L += ["| precision | C | " + ("round | " if every_run else "") + "engine | done/failed | exact lens | "
          "output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | TPOT p50 (ms) |",
          "| --- | ---: | " + ("---: | " if every_run else "") + "--- | ---: | :---: | ---: | ---: | ---: | ---: | ---: | "
          "---: |"]
    for r in sort_rows(rows):
        L.append(f"| {r['precision']} | {r['concurrency']} | " + (f"{r.get('round', 0)} | " if every_run else "") +
                 f"{r['label']} | {r['completed']}/{r['failed']} | "
                 f"{'yes' if r['exact_lengths'] else 'NO'} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
                 f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
                 f"{r['tpot_p50_ms'] or 0:.1f} |")
    if rats and not every_run:
        L += ["", "Ratios, pagedserve vs the peer in the same precision group and C (> 1 = pagedserve better: its "
                  "throughput / theirs, their latency / its latency):", "",
              "| precision | C | pagedserve | vs | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
              "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for q in rats:
            L.append(f"| {q['precision']} | {q['concurrency']} | {q['ours']} | {q['vs']} | {q['output_tok_s']:.2f}x | "
                     f"{q['ttft_p50']:.2f}x | {q['ttft_p99']:.2f}x | {q['itl_p50']:.2f}x | {q['itl_p99']:.2f}x |")
    notes = {}
    for r in sort_rows(rows):
        load = r.get("loadavg_1min")
        notes.setdefault((r["label"], r["precision"]), r["notes"] + (
            f"; machine load average (1 min) {load[0]:.1f} before, {load[1]:.1f} after" if load else ""))
    if notes:
        L += ["", "How each engine ran:", ""] + [f"* {lab} {prec}: {n}" for (lab, prec), n in notes.items()]
    if skipped:
        L += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())]
    return "\n".join(L) + "\n"


def multi_round_tables(rounds: int, rows: list[dict], rats: list[dict]) -> list[str]:
    """--rounds > 1: each engine's medians over the rounds, and the ratios paired within a round as median
    [min-max]."""
    def rng(s: dict, fmt: str, unit: str = "") -> str:
        return f"{s['median']:{fmt}}{unit} [{s['min']:{fmt}}-{s['max']:{fmt}}]"

    L = [f"Medians over {rounds} rounds (the engines' order alternates from round to round), [min-max] where it "
         "matters:", "",
         "| precision | C | engine | runs | exact lens | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | "
         "ITL p99 (ms) | TPOT p50 (ms) |",
         "| --- | ---: | --- | ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for g in summarize_rows(rows):
        L.append(f"| {g['precision']} | {g['concurrency']} | {g['label']} | {g['runs']} | "
                 f"{'yes' if g['all_exact'] else 'NO'} | {rng(g['output_tok_s'], '.1f')} | "
                 f"{g['ttft_p50_ms']['median']:.0f} | {rng(g['ttft_p99_ms'], '.0f')} | {g['itl_p50_ms']['median']:.1f} | "
                 f"{rng(g['itl_p99_ms'], '.1f')} | {g['tpot_p50_ms']['median']:.1f} |")
    if rats:
        L += ["", "Ratios, pagedserve vs the peer in the same precision group and C, paired within each round (> 1 = "
                  "pagedserve better: its throughput / theirs, their latency / its latency); median [min-max] over "
                  "the rounds, and output tok/s round by round:", "",
              "| precision | C | pagedserve | vs | output tok/s | per round | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
              "| --- | ---: | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
        for q in summarize_ratios(rats):
            L.append(f"| {q['precision']} | {q['concurrency']} | {q['ours']} | {q['vs']} | "
                     f"{rng(q['output_tok_s'], '.2f', 'x')} | {', '.join(f'{x:.2f}' for x in q['per_round'])} | "
                     f"{q['ttft_p50']['median']:.2f}x | {rng(q['ttft_p99'], '.2f', 'x')} | {q['itl_p50']['median']:.2f}x | "
                     f"{rng(q['itl_p99'], '.2f', 'x')} |")
    return L


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark: keep every engine off any GPU
    out_dir = args.output_dir or os.path.join("bench_results", "cpu_peers-" + datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *a: (sbs.stop_all_servers(), sys.exit(143)))

    skipped: dict[str, str] = {}
    versions: dict[str, str] = {"pagedserve": pagedserve_version()}
    try:
        import torch
        versions["torch (pagedserve)"] = torch.__version__
    except Exception:
        pass
    for engine, venv in (("vllm", args.vllm_venv), ("openvino", args.openvino_venv)):
        if engine not in args.engine_list:
            continue
        v, why = probe_peer(engine, venv)
        if v is None:
            log(f"SKIP {LABELS[engine]}: {why}")
            skipped[LABELS[engine]] = why
            args.engine_list.remove(engine)
        else:
            versions[LABELS[engine]] = ", ".join(f"{k} {x}" for k, x in v.items())

    workloads, described = build_workloads(args)
    if len(set(described.values())) == 1:
        workload = next(iter(described.values()))
    else:
        workload = "; ".join(f"C={c}: {d}" for c, d in described.items())
    log(f"workload: {args.dataset}: {workload}")
    too_long = [s for w in workloads.values() for s in w if s.prompt_len + s.expected_output_len > args.max_model_len]
    if too_long:
        raise SystemExit(f"{len(too_long)} requests exceed --max-model-len {args.max_model_len}")

    rows: list[dict] = []
    if args.report_only:
        collect_results(args, workloads, out_dir, rows, skipped)
    try:
        for prec in ([] if args.report_only else args.precision_list):  # every engine back to back within a group
            for k in range(args.rounds):
                d = round_dir(out_dir, k, args.rounds)
                os.makedirs(d, exist_ok=True)
                for engine in engine_order(args.engine_list, k):
                    # the 1-minute load average before/after: this benchmark shares the machine with whatever runs
                    n, before, round_skips = len(rows), os.getloadavg()[0], {}
                    RUNNERS[engine](args, prec, workloads, d, rows, round_skips)
                    after = os.getloadavg()[0]
                    for r in rows[n:]:
                        r.update(loadavg_1min=[round(before, 2), round(after, 2)], round=k)
                    skipped.update({f"{key} (round {k})" if args.rounds > 1 else key: why
                                    for key, why in round_skips.items()})
    finally:
        sbs.stop_all_servers()

    meta = {"model": args.model, "threads": args.threads, "dataset": args.dataset, "workload": workload,
            "seed": args.seed, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": versions, "rounds": args.rounds}
    rats = ratios(rows)
    report = format_report(meta, rows, rats, skipped)
    log("")
    log(report)
    with open(os.path.join(out_dir, "cpu_peers.md"), "w") as f:
        f.write(report)
    payload = dict(meta, concurrency=args.concurrencies, precisions=args.precision_list, num_prompts=args.num_prompts,
                   c1_num_prompts=args.c1_num_prompts,
                   max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                   rows=sort_rows(rows), ratios=rats, skipped=skipped,
                   summary={"rows": summarize_rows(rows), "ratios": summarize_ratios(rats)})
    with open(os.path.join(out_dir, "cpu_peers.json"), "w") as f:
        json.dump(payload, f, indent=2)
    log(f"saved {out_dir}/cpu_peers.md and cpu_peers.json")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
