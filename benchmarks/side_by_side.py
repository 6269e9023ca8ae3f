"""pagedserve vs llama.cpp vs transformers (`generate`, continuous batching), side by side, on one workload
(issue 7, parts 1 + 2).

    python benchmarks/side_by_side.py --model /tmp/smollm2 --gguf /tmp/smollm2-f32.gguf \\
        --concurrency 16,32 --num-prompts 200 --threads 2 --output-dir bench_results/side_by_side

The same workload goes to every engine: seeded random token-id prompts (`--dataset mixed`: prompt lengths
32..1024 and output lengths 16..512, log-uniform; or `--dataset random`), forced output lengths (`ignore_eos`),
greedy, closed loop at concurrency C (`--max-concurrency C --request-rate inf`):

  pagedserve   `pagedserve serve MODEL --num-threads T`, loaded by `pagedserve bench serve` (a subprocess,
               `--save-result`); one server for every C (`--max-num-seqs max(C)`, KV pool sized for
               max(C) full-length requests, so nothing is preempted).
  llama.cpp    `llama-server -m GGUF -np C -cb -c C*max_model_len -t T -tb T` (every slot holds one
               full-length request; KV cache f32 like pagedserve's unless `--llama-kv-type f16`), one server
               per C, loaded by the same `pagedserve bench serve` command.  Skipped, with a message, when
               llama-server or the GGUF is not found (CI never needs llama.cpp).
  HF naive     transformers `generate`, one request at a time (pagedserve/benchmarks/hf_baseline.py).
  HF static    transformers `generate`, left-padded static batches of C, each decoding to its longest output.
  HF CB        transformers' own continuous batching (`model.init_continuous_batching()`: a background
               generation thread, paged KV cache, FIFO scheduler with chunked prefill), closed loop at C: C
               requests submitted with `add_request(streaming=True)`, the next one as soon as one finishes
               (`run_hf_continuous` in hf_baseline.py).  Attention as transformers keeps it on CPU ("sdpa": a
               block-diagonal mask over the batch's keys/values gathered from the paged cache); KV blocks for C
               of the workload's longest requests, `--hf-cb-max-batch-tokens` tokens per forward (default 2048,
               pagedserve's default token budget).  A failure (e.g. no CB in this transformers) is a skip message.
               The HF rows run in this process with torch threads = T; for naive / static their TTFT is measured
               from the start of the `generate` call that served the request (what a closed-loop client would
               see), for CB from the request's `add_request`; ITL is the gap between consecutive generated tokens.
               `--skip-hf` skips all three.

One table (output tok/s, TTFT p50/p99, ITL p50/p99, ratios pagedserve vs each other engine), plus roofline
accounting from the same run (pagedserve/benchmarks/roofline.py): the machine's matmul FLOP/s and memory
bandwidth, measured first with nothing else running; for every engine run the achieved FLOP/s =
2 x matmul params (incl. the LM head) x (input + output tokens) / duration as a fraction of the matmul peak;
batch-1 decode time against the weight-bytes / bandwidth bound, for pagedserve from `pagedserve bench latency
--batch-sizes 1` (median engine step with one decoding request), for llama.cpp from llama-server's own
`timings.predicted_per_token_ms` of one request alone, for HF from the median ITL of the naive run.
Outputs: side_by_side.md, side_by_side.json, every `bench serve` result JSON, server logs, in --output-dir.

GGUF conversion (`--convert-with LLAMA_CPP_SRC`, done only when --gguf does not exist; `--convert-only` stops
after it).  llama.cpp's own `convert_hf_to_gguf.py --outtype f32` is run, with gguf-py from the same source
tree on PYTHONPATH.  Two things stop it on `bench make-model` checkpoints, and both are patched *in memory*
(a wrapper that monkeypatches the converter's classes and then runs the unmodified script; no copy, no edit):

  * its Llama path first tries a SentencePiece vocab and imports `sentencepiece` before looking for
    `tokenizer.model`; without the package installed that is a ModuleNotFoundError instead of the
    FileNotFoundError it expects.  The wrapper raises FileNotFoundError when there is no tokenizer.model
    (what the converter does itself when sentencepiece is installed).
  * the tokenizer (byte-level BPE trained here, dummy vocab entries) is not in llama.cpp's table of
    pre-tokenizer hashes (`get_vocab_base_pre`: "BPE pre-tokenizer was not recognized", chkhsh
    dbc9278b...).  Its pre-tokenizer is a plain `ByteLevel(use_regex=True)`, i.e. exactly GPT-2's regex, so
    the wrapper answers "gpt-2" when the hash is unknown (known hashes keep their own answer).  The real
    SmolLM2 tokenizer maps to "smollm" (digits split first); ours does not split digits, so "gpt-2" is the
    right llama.cpp pre-tokenizer.  The benchmark sends token ids, so tokenization never runs during the
    measurement anyway; it only matters for text prompts.

By hand, the same thing:  python benchmarks/side_by_side.py --model /tmp/smollm2 --gguf /tmp/smollm2-f32.gguf \\
    --convert-with /tmp/llamacpp/vendor/llama.cpp --convert-only

See benchmarks/README.md for building llama-server from the llama-cpp-python sdist.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from datetime import datetime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DEFAULT_LLAMA_SERVER_PATHS = ("/tmp/llamacpp/build/bin/llama-server",)
ENGINES = ("pagedserve", "llamacpp", "hf-naive", "hf-static", "hf-cb")
LABELS = {"pagedserve": "pagedserve", "llamacpp": "llama.cpp", "hf-naive": "HF generate (1 at a time)",
          "hf-static": "HF generate (static padded)", "hf-cb": "HF continuous batching"}

# Runs llama.cpp's convert_hf_to_gguf.py unmodified, after two in-memory patches (see the module docstring).
# argv: SRC_DIR convert-args...
CONVERT_WRAPPER = r'''
import os, runpy, sys
src = sys.argv[1]
sys.path[:0] = [os.path.join(src, "gguf-py"), src]
import conversion.base as base
_pre = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        print("side_by_side: pre-tokenizer hash unknown to llama.cpp; the tokenizer is plain ByteLevel with "
              "GPT-2's regex, registering it as 'gpt-2'", flush=True)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
_sp = base.TextModel._set_vocab_sentencepiece
def _set_vocab_sentencepiece(self, *a, **k):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")  # what the converter raises when sentencepiece is installed
    return _sp(self, *a, **k)
base.TextModel._set_vocab_sentencepiece = _set_vocab_sentencepiece
sys.argv = [os.path.join(src, "convert_hf_to_gguf.py")] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------- CLI


def parse_engine_lists(p: argparse.ArgumentParser, args: argparse.Namespace, engines) -> None:
    """--concurrency and --engines (comma lists) -> args.concurrencies, args.engine_list; p.error on bad values."""
    args.concurrencies = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    if not args.concurrencies or min(args.concurrencies) < 1:
        p.error("--concurrency needs positive integers")
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in args.engine_list if e not in engines]
    if bad:
        p.error(f"--engines: unknown {bad}; choose from {','.join(engines)}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint dir (e.g. from `pagedserve bench make-model`)")
    p.add_argument("--gguf", default=None, help="the same model as GGUF F32 (default: MODEL-f32.gguf next to MODEL)")
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (default: $LLAMA_SERVER, else `llama-server` on PATH, else "
                        + ", ".join(DEFAULT_LLAMA_SERVER_PATHS) + ")")
    p.add_argument("--convert-with", default=None, metavar="LLAMA_CPP_SRC",
                   help="llama.cpp source dir: convert --model to --gguf (F32) first if --gguf does not exist")
    p.add_argument("--convert-only", action="store_true", help="stop after the conversion")
    p.add_argument("--concurrency", default="16,32", help="comma list of closed-loop concurrencies C")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset", default="mixed", choices=["mixed", "random"],
                   help="mixed: prompts 32..1024, outputs 16..512 (log-uniform); random: the --random-* lengths")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2,
                   help="threads per engine (pagedserve --num-threads, llama-server -t/-tb, torch for HF, roofline)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="per-request context: pagedserve --max-model-len, llama.cpp context per slot")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ",".join(ENGINES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="pagedserve's device and the roofline's (HF runs on the GPU whenever there is one)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model dtype of pagedserve and HF, and the roofline's GEMM dtype")
    p.add_argument("--skip-hf", action="store_true",
                   help="skip the transformers baselines (HF naive, HF static, HF continuous batching)")
    p.add_argument("--hf-cb-max-batch-tokens", type=int, default=2048,
                   help="HF continuous batching: max tokens per forward (prefill chunk budget; default 2048 = "
                        "pagedserve's default --max-num-batched-tokens)")
    p.add_argument("--hf-cb-page-size", type=int, default=None,
                   help="HF continuous batching: tokens per KV block (default: transformers' default)")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--llama-kv-type", default="f32", choices=["f32", "f16"],
                   help="llama-server --cache-type-k/-v (f32 = pagedserve's KV precision on CPU; f16 = llama.cpp's default)")
    p.add_argument("--serve-args", default="", help="extra flags for `pagedserve serve` (one string)")
    p.add_argument("--llama-server-args", default="", help="extra flags for llama-server (one string)")
    p.add_argument("--roofline-json", default=None,
                   help="reuse the machine peaks of `pagedserve bench roofline --output-json` instead of measuring")
    p.add_argument("--roofline-sizes", default="1024,2048,3072", help="GEMM sizes for the matmul peak")
    p.add_argument("--roofline-bw-mib", type=int, default=512, help="tensor size for the bandwidth tests")
    p.add_argument("--roofline-repeats", type=int, default=3)
    p.add_argument("--skip-batch1", action="store_true", help="skip the batch-1 decode measurements")
    p.add_argument("--batch1-input-len", type=int, default=32)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for a server's /health")
    p.add_argument("--output-dir", default=None, help="default: bench_results/side_by_side-<date>")
    args = p.parse_args(argv)
    parse_engine_lists(p, args, ENGINES)
    if args.skip_hf:
        args.engine_list = [e for e in args.engine_list if not e.startswith("hf-")]
    if args.skip_llamacpp:
        args.engine_list = [e for e in args.engine_list if e != "llamacpp"]
    if args.gguf is None:
        args.gguf = os.path.normpath(args.model) + "-f32.gguf"
    return args


# ------------------------------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def pagedserve_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "pagedserve.entrypoints.cli", *argv]


def http_json(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw.strip() else None)
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
        return 0, None


def find_llama_server(explicit: str | None) -> tuple[str | None, list[str]]:
    """(path or None, the places looked at)."""
    if explicit:
        return (explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None), [explicit]
    tried = []
    env = os.environ.get("LLAMA_SERVER")
    if env:
        tried.append(f"$LLAMA_SERVER={env}")
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env, tried
    tried.append("llama-server on PATH")
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path, tried
    for p in DEFAULT_LLAMA_SERVER_PATHS:
        tried.append(p)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p, tried
    return None, tried


def convert_to_gguf(src: str, model_dir: str, out: str) -> None:
    if not os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        raise SystemExit(f"--convert-with {src}: no convert_hf_to_gguf.py there (want the llama.cpp source root)")
    cmd = [sys.executable, "-c", CONVERT_WRAPPER, src, model_dir, "--outtype", "f32", "--outfile", out]
    log(f"converting {model_dir} -> {out} with {src}/convert_hf_to_gguf.py --outtype f32")
    subprocess.run(cmd, check=True)


class Server:
    """A server subprocess (its own process group), output to a log file, up when GET /health says 200."""

    live: list["Server"] = []

    def __init__(self, name: str, cmd: list[str], port: int, log_path: str, env: dict | None = None):
        self.name, self.cmd, self.port, self.log_path, self.env = name, cmd, port, log_path, env
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{port}"

    def start(self, timeout: float) -> None:
        log(f"[{self.name}] starting: {' '.join(self.cmd)}  (log: {self.log_path})")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        Server.live.append(self)
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"[{self.name}] exited with code {self.proc.returncode} before it was ready; "
                                   f"last lines of {self.log_path}:\n{tail(self.log_path)}")
            code, _ = http_json(self.base_url + "/health", timeout=5)
            if code == 200:
                log(f"[{self.name}] ready on port {self.port} after {time.perf_counter() - t0:.1f} s")
                return
            if time.perf_counter() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"[{self.name}] not healthy after {timeout:.0f} s; see {self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self in Server.live:
            Server.live.remove(self)
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None


def stop_all_servers(*_):
    for s in list(Server.live):
        s.stop()


def tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------- workload


def dataset_flags(args) -> list[str]:
    flags = ["--dataset-name", args.dataset, "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
             "--tokenizer", args.model]
    if args.dataset == "random":
        flags += ["--random-input-len", str(args.random_input_len), "--random-output-len",
                  str(args.random_output_len), "--random-range-ratio", str(args.random_range_ratio)]
    return flags


def build_samples(args):
    """The exact samples `pagedserve bench serve <dataset_flags(args)>` builds (same parser, same tokenizer)."""
    from pagedserve.benchmarks import datasets as ds

    p = argparse.ArgumentParser()
    ds.add_dataset_args(p)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(dataset_flags(args))
    return ds.get_samples(ns, ds.load_tokenizer(ns.tokenizer), None), ds.describe


# --------------------------------------------------------------------------------------- roofline


def measure_roofline(args, out_dir: str):
    from pagedserve.benchmarks.roofline import (MachinePeaks, format_report, measure_peaks, roofline_for,
                                                shape_from_config)

    if args.roofline_json:
        with open(args.roofline_json) as f:
            peaks = MachinePeaks(**json.load(f)["machine"])
        log(f"machine peaks from {args.roofline_json}")
    else:
        log(f"measuring the machine's matmul FLOP/s and memory bandwidth ({args.threads} threads) ...")
        peaks = measure_peaks(tuple(int(s) for s in args.roofline_sizes.split(",")), args.roofline_repeats,
                              args.roofline_bw_mib, args.threads, device=args.device, dtype=args.dtype)
    roof = roofline_for(shape_from_config(args.model), peaks, args.dtype)
    log(format_report(roof, peaks))
    path = os.path.join(out_dir, "roofline.json")
    with open(path, "w") as f:  # the format of `bench roofline --output-json` (so `bench latency` can reuse it)
        json.dump({"machine": asdict(peaks), "roofline": roof.to_dict()}, f, indent=2)
    return peaks, roof, path


def batch1_pagedserve(args, roofline_json: str, out_dir: str) -> dict | None:
    """`pagedserve bench latency --batch-sizes 1` (run in this process: no second torch import): the median engine
    step time while one request decodes."""
    from pagedserve.benchmarks.cli import add_bench_parser

    out = os.path.join(out_dir, "pagedserve_batch1.json")
    blocks = math.ceil((args.batch1_input_len + args.batch1_output_len + 16) / 16) + 4
    argv = ["bench", "latency", "--model", args.model, "--batch-sizes", "1",
            "--input-len", str(args.batch1_input_len), "--output-len", str(args.batch1_output_len),
            "--num-threads", str(args.threads), "--max-model-len", str(args.max_model_len),
            "--num-kv-blocks", str(blocks), "--device", args.device, "--dtype", args.dtype, "--roofline-json", roofline_json, "--output-json", out,
            "--disable-tqdm"]
    log(f"[pagedserve] batch-1 decode: pagedserve {' '.join(argv)}")
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    try:
        rc = ns.func(ns)
    except Exception as e:  # report, keep going with the rest of the benchmark
        log(f"[pagedserve] batch-1 decode measurement failed: {type(e).__name__}: {e}")
        return None
    if rc != 0 or not os.path.isfile(out):
        log(f"[pagedserve] batch-1 decode measurement failed (exit {rc})")
        return None
    with open(out) as f:
        row = json.load(f)["rows"][0]
    return {"ms_per_token": row["step_ms_median"], "how": "bench latency --batch-sizes 1: median engine step, "
            f"1 request decoding, context {args.batch1_input_len}..{args.batch1_input_len + args.batch1_output_len}"}


def llamacpp_ms_per_token(base_url: str, prompt: list[int], n_predict: int) -> float | None:
    """One greedy /completion alone on llama-server: its own timings.predicted_per_token_ms (None if absent)."""
    body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False, "temperature": 0.0,
            "stream": False}
    code, resp = http_json(base_url + "/completion", body)
    t = (resp or {}).get("timings") or {}
    if code != 200 or not t.get("predicted_per_token_ms"):
        log(f"[llama.cpp] batch-1 decode: no timings in the /completion answer (HTTP {code})")
        return None
    return float(t["predicted_per_token_ms"])


def batch1_llamacpp(base_url: str, args, vocab: int, repeats: int = 3) -> dict | None:
    """One request alone on llama-server; its own timings.predicted_per_token_ms (median of `repeats`)."""
    import numpy as np

    rng = np.random.default_rng(args.seed + 7)
    per_tok = []
    for _ in range(repeats):
        ms = llamacpp_ms_per_token(base_url, rng.integers(3, vocab, args.batch1_input_len).tolist(),
                                   args.batch1_output_len)
        if ms is None:
            return None
        per_tok.append(ms)
    return {"ms_per_token": statistics.median(per_tok), "how": "llama-server /completion alone, "
            f"timings.predicted_per_token_ms (median of {repeats}), context {args.batch1_input_len}.."
            f"{args.batch1_input_len + args.batch1_output_len}"}


# ------------------------------------------------------------------------------------------- engines


def run_bench_serve(engine: str, base_url: str, served_name: str, conc: int, args, out_dir: str) -> dict | None:
    fname = f"{engine}-c{conc}.json"
    cmd = pagedserve_cmd("bench", "serve", "--base-url", base_url, "--model", served_name, *dataset_flags(args),
                         "--ignore-eos", "--request-rate", "inf", "--max-concurrency", str(conc),
                         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                         "--label", engine, "--save-result", "--result-dir", out_dir, "--result-filename", fname,
                         "--disable-tqdm", "--ready-check-timeout-sec", "120")
    log(f"[{LABELS[engine]}] C={conc}: {' '.join(cmd)}")
    r = subprocess.run(cmd, env=subprocess_env())
    path = os.path.join(out_dir, fname)
    if r.returncode != 0 or not os.path.isfile(path):
        log(f"[{LABELS[engine]}] C={conc}: bench serve failed (exit {r.returncode})")
        return None
    with open(path) as f:
        return json.load(f)


def row_from_serve(engine: str, conc: int, res: dict, samples, roof, notes: str = "") -> dict:
    expected = [s.expected_output_len for s in samples]
    ok = [e is None or e == "" for e in res.get("errors", [])]
    exact = res["output_lens"] == expected and all(ok) and res["input_lens"] == [s.prompt_len for s in samples]
    return make_row(engine, conc, completed=res["completed"], failed=res["failed"],
                    duration=res["duration"], in_tok=res["total_input_tokens"], out_tok=res["total_output_tokens"],
                    ttft=(res["median_ttft_ms"], res["p99_ttft_ms"]), itl=(res["median_itl_ms"], res["p99_itl_ms"]),
                    tpot=res.get("median_tpot_ms"), exact=exact, roof=roof, notes=notes,
                    result_file=f"{engine}-c{conc}.json")


def make_row(engine, conc, *, completed, failed, duration, in_tok, out_tok, ttft, itl, tpot, exact, roof, notes="",
             result_file=None) -> dict:
    flops = 2.0 * roof.matmul_params * (in_tok + out_tok) / duration if duration > 0 else 0.0
    return {"engine": engine, "label": LABELS[engine], "concurrency": conc, "completed": completed, "failed": failed,
            "duration_s": duration, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
            "output_tok_s": out_tok / duration if duration > 0 else 0.0,
            "total_tok_s": (in_tok + out_tok) / duration if duration > 0 else 0.0,
            "ttft_p50_ms": ttft[0], "ttft_p99_ms": ttft[1], "itl_p50_ms": itl[0], "itl_p99_ms": itl[1],
            "tpot_p50_ms": tpot, "exact_lengths": exact, "achieved_flops": flops,
            "fraction_of_matmul_peak": flops / roof.peak_flops if roof.peak_flops else 0.0,
            "notes": notes, "result_file": result_file}


def run_pagedserve(args, samples, roof, out_dir: str, rows: list, skipped: dict) -> None:
    cmax = max(args.concurrencies)
    port = free_port()
    blocks = math.ceil(cmax * args.max_model_len / 16)
    name = "pagedserve-" + os.path.basename(os.path.normpath(args.model))
    cmd = pagedserve_cmd("serve", args.model, "--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--dtype", args.dtype,
                         "--num-threads", str(args.threads), "--max-model-len", str(args.max_model_len),
                         "--max-num-seqs", str(cmax), "--num-kv-blocks", str(blocks), "--served-model-name", name,
                         "--disable-log-stats", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
                         *args.serve_args.split())
    srv = Server("pagedserve", cmd, port, os.path.join(out_dir, "pagedserve_server.log"), env=subprocess_env())
    try:
        srv.start(args.startup_timeout)
        for c in args.concurrencies:
            res = run_bench_serve("pagedserve", srv.base_url, name, c, args, out_dir)
            if res is None:
                skipped[f"pagedserve C={c}"] = "bench serve failed"
                continue
            rows.append(row_from_serve("pagedserve", c, res, samples, roof,
                                       notes=f"--max-num-seqs {cmax} --num-kv-blocks {blocks} (block 16)"))
    except RuntimeError as e:
        log(str(e))
        skipped["pagedserve"] = str(e).splitlines()[0]
    finally:
        srv.stop()


def run_llamacpp(args, server_bin: str, samples, roof, out_dir: str, rows: list, skipped: dict,
                 batch1: dict) -> None:
    from pagedserve.benchmarks.datasets import load_tokenizer

    tok = load_tokenizer(args.model)
    vocab = len(tok) if tok is not None else 1000
    name = "llamacpp-" + os.path.basename(args.gguf)
    for c in args.concurrencies:
        port = free_port()
        ctx = c * args.max_model_len
        cmd = [server_bin, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(c), "-cb",
               "-c", str(ctx), "-t", str(args.threads), "-tb", str(args.threads), "--alias", name,
               "--cache-type-k", args.llama_kv_type, "--cache-type-v", args.llama_kv_type, "--no-webui",
               *args.llama_server_args.split()]
        srv = Server(f"llama.cpp C={c}", cmd, port, os.path.join(out_dir, f"llamacpp_server_c{c}.log"))
        try:
            srv.start(args.startup_timeout)
            res = run_bench_serve("llamacpp", srv.base_url, name, c, args, out_dir)
            if res is None:
                skipped[f"llamacpp C={c}"] = "bench serve failed"
            else:
                rows.append(row_from_serve("llamacpp", c, res, samples, roof,
                                           notes=f"-np {c} -cb -c {ctx} (slot ctx {args.max_model_len}), "
                                                 f"KV {args.llama_kv_type}"))
            if not args.skip_batch1 and "llamacpp" not in batch1:
                b1 = batch1_llamacpp(srv.base_url, args, vocab)
                if b1:
                    batch1["llamacpp"] = b1
        except RuntimeError as e:
            log(str(e))
            skipped[f"llamacpp C={c}"] = str(e).splitlines()[0]
        finally:
            srv.stop()


def hf_rows(args, samples, roof, rows: list, batch1: dict, skipped: dict | None = None) -> None:
    import numpy as np
    import torch

    from pagedserve.benchmarks.hf_baseline import load_hf_model, run_hf

    torch.set_num_threads(args.threads)
    log(f"[HF] loading {args.model} (torch threads {args.threads})")
    model = load_hf_model(args.model, args.dtype)
    runs = []
    if "hf-naive" in args.engine_list:
        runs.append(("hf-naive", 1, None))
    if "hf-static" in args.engine_list:
        runs += [("hf-static", c, c) for c in args.concurrencies]
    for engine, bs, conc in runs:
        log(f"[{LABELS[engine]}] batch size {bs}: {len(samples)} requests ...")
        res = run_hf(model, samples, engine, bs, max_model_len=args.max_model_len)
        rebase_to_batch_start(res)
        s = res.summary(percentiles=(50, 99))
        row = make_row(engine, conc if conc is not None else 1, completed=s["completed"],
                       failed=len(samples) - s["completed"], duration=s["duration"],
                       in_tok=s["total_input_tokens"], out_tok=s["total_output_tokens"],
                       ttft=(s["median_ttft_ms"], s["p99_ttft_ms"]), itl=(s["median_itl_ms"], s["p99_itl_ms"]),
                       tpot=s["median_tpot_ms"],
                       exact=[r.output_len for r in res.requests] == [x.expected_output_len for x in samples],
                       roof=roof, notes=("sequential, batch 1" if bs == 1 else
                                         f"left-padded batches of {bs}, each decodes to its longest output"))
        rows.append(row)
        if engine == "hf-naive" and not args.skip_batch1:
            itls = [x for r in res.requests for x in r.itls]
            if itls:
                batch1["hf"] = {"ms_per_token": float(np.median(itls)) * 1000,
                                "how": "median ITL of the HF naive run (batch 1, the workload's contexts)"}
    if "hf-cb" in args.engine_list:
        for c in args.concurrencies:
            row = hf_cb_row(args, model, samples, roof, c, skipped if skipped is not None else {})
            if row is not None:
                rows.append(row)
    del model


def hf_cb_row(args, model, samples, roof, conc: int, skipped: dict) -> dict | None:
    """transformers continuous batching, closed loop at `conc`; None (and a skip message) if it fails."""
    from pagedserve.benchmarks.hf_baseline import run_hf_continuous

    label = LABELS["hf-cb"]
    log(f"[{label}] C={conc}: {len(samples)} requests, closed loop ...")
    try:
        res = run_hf_continuous(model, samples, concurrency=conc, max_batch_tokens=args.hf_cb_max_batch_tokens,
                                page_size=args.hf_cb_page_size, max_model_len=args.max_model_len)
    except Exception as e:  # no CB in this transformers, out of memory, a crash in its generation thread, ...
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        log(f"SKIP {label} C={conc}: {msg}")
        skipped[f"{label} C={conc}"] = msg
        return None
    s = res.summary(percentiles=(50, 99))
    return make_row("hf-cb", conc, completed=s["completed"], failed=len(samples) - s["completed"],
                    duration=s["duration"], in_tok=s["total_input_tokens"], out_tok=s["total_output_tokens"],
                    ttft=(s["median_ttft_ms"], s["p99_ttft_ms"]), itl=(s["median_itl_ms"], s["p99_itl_ms"]),
                    tpot=s["median_tpot_ms"],
                    exact=[r.output_len for r in res.requests] == [x.expected_output_len for x in samples],
                    roof=roof, notes=res.notes)


def rebase_to_batch_start(res) -> None:
    """run_hf stamps every request as arriving at t=0; make TTFT count from the start of the `generate` call that
    served it (a closed-loop client's view).  The first step of each batch (prompt_tokens > 0) starts the batch;
    requests are recorded batch after batch in that order."""
    starts = [(st.t_start, st.num_reqs) for st in res.steps if st.prompt_tokens > 0]
    i = 0
    for t_start, n in starts:
        for r in res.requests[i:i + n]:
            r.arrival = t_start
        i += n


# ---------------------------------------------------------------------------------------------- report


def ratios(rows: list[dict]) -> list[dict]:
    """pagedserve at C vs every other engine at the same C (HF naive: the one sequential run).
    Every ratio is oriented so that > 1 means pagedserve is better."""
    out = []
    ps = {r["concurrency"]: r for r in rows if r["engine"] == "pagedserve"}
    naive = next((r for r in rows if r["engine"] == "hf-naive"), None)
    for c, p in sorted(ps.items()):
        others = [r for r in rows if r["engine"] in ("llamacpp", "hf-static", "hf-cb") and r["concurrency"] == c]
        if naive:
            others.append(naive)
        for o in others:
            def div(a, b):
                return a / b if b else float("nan")
            out.append({"concurrency": c, "vs": o["label"], "vs_engine": o["engine"], "vs_concurrency": o["concurrency"],
                        "output_tok_s": div(p["output_tok_s"], o["output_tok_s"]),
                        "ttft_p50": div(o["ttft_p50_ms"], p["ttft_p50_ms"]),
                        "ttft_p99": div(o["ttft_p99_ms"], p["ttft_p99_ms"]),
                        "itl_p50": div(o["itl_p50_ms"], p["itl_p50_ms"]),
                        "itl_p99": div(o["itl_p99_ms"], p["itl_p99_ms"])})
    return out


def format_report(args, workload: str, peaks, roof, rows, rats, batch1, skipped) -> str:
    g = 1e9
    order = {e: i for i, e in enumerate(ENGINES)}
    rows = sorted(rows, key=lambda r: (r["concurrency"], order[r["engine"]]))
    L = [f"# side by side: pagedserve vs llama.cpp vs transformers (generate, continuous batching)",
         "",
         f"model `{args.model}` ({roof.params / 1e6:.1f}M params, {args.dtype}); "
         + (f"GGUF `{args.gguf}` (F32); " if "llamacpp" in args.engine_list else "")
         + (f"{args.threads} threads per engine" if args.device == "cpu" else f"on {args.device}")
         + f"; workload {args.dataset}: {workload}; closed loop at concurrency C "
         f"(`--max-concurrency C --request-rate inf`), `ignore_eos`, greedy; seed {args.seed}; "
         f"{datetime.now().strftime('%Y-%m-%d %H:%M')}",
         "",
         "| engine | C | done/failed | exact lens | output tok/s | total tok/s | TTFT p50 (ms) | TTFT p99 (ms) | "
         "ITL p50 (ms) | ITL p99 (ms) | TPOT p50 (ms) | achieved GFLOP/s | % of matmul peak |",
         "| --- | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        L.append(f"| {r['label']} | {r['concurrency']} | {r['completed']}/{r['failed']} | "
                 f"{'yes' if r['exact_lengths'] else 'NO'} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
                 f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
                 f"{r['tpot_p50_ms'] or 0:.1f} | "
                 f"{r['achieved_flops'] / g:.1f} | {100 * r['fraction_of_matmul_peak']:.1f}% |")
    if rats:
        L += ["", "Ratios, pagedserve at C vs the other engine (> 1 = pagedserve better: its throughput / theirs, "
                  "their latency / its latency):", "",
              "| C | vs | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
              "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for q in rats:
            vs = q["vs"] + (f" (C={q['vs_concurrency']})" if q["vs_engine"] == "hf-naive" else "")
            L.append(f"| {q['concurrency']} | {vs} | {q['output_tok_s']:.2f}x | {q['ttft_p50']:.2f}x | "
                     f"{q['ttft_p99']:.2f}x | {q['itl_p50']:.2f}x | {q['itl_p99']:.2f}x |")
    bound_ms = roof.weight_bytes / roof.bandwidth * 1000
    machine = f"{peaks.threads} threads" if args.device == "cpu" else args.device
    L += ["", "## Roofline (same run)", "",
          f"* machine, {machine}: matmul peak {peaks.matmul_flops / g:.1f} GFLOP/s ({args.dtype} GEMM n="
          f"{peaks.matmul_size}); memory bandwidth {peaks.bandwidth / g:.1f} GB/s (best of copy "
          f"{peaks.copy_bandwidth / g:.1f}, sum {peaks.sum_bandwidth / g:.1f}, GEMV {peaks.gemv_bandwidth / g:.1f})",
          f"* model: {roof.matmul_params / 1e6:.1f}M matmul params incl. LM head -> {2 * roof.matmul_params / 1e6:.4g} "
          f"MFLOP per token; compute bound {roof.compute_bound_tok_s:.0f} tok/s; weights {roof.weight_bytes / 1e6:.0f} MB "
          f"({args.dtype}) -> batch-1 decode bound {bound_ms:.2f} ms/token ({roof.decode_bound_tok_s:.1f} tok/s); "
          f"B_sat {roof.b_sat:.1f}",
          "* ITL = gap between consecutive streamed chunks, as `vllm bench serve` counts it (a server that bundles "
          "tokens into one chunk shows fewer, longer gaps; llama-server's last chunk carries no token); TPOT = "
          "(E2E - TTFT) / (output tokens - 1) per request, immune to both",
          "* achieved FLOP/s in the table = 2 x matmul params x (input + output tokens) / duration (useful tokens "
          "only: HF static's padding compute is not credited)"]
    if batch1:
        L += ["", "| batch-1 decode | ms/token | weight-read bound (ms) | bound / measured | how |",
              "| --- | ---: | ---: | ---: | --- |"]
        for k in ("pagedserve", "llamacpp", "hf"):
            if k in batch1:
                b = batch1[k]
                L.append(f"| {LABELS.get(k, 'HF generate')} | {b['ms_per_token']:.2f} | {bound_ms:.2f} | "
                         f"{100 * bound_ms / b['ms_per_token']:.0f}% | {b['how']} |")
    if skipped:
        L += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())]
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # llama.cpp is built for the CPU and threads are pinned: keep pagedserve and
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # transformers off any GPU, here and in the servers it starts
    if args.convert_with and not os.path.isfile(args.gguf):
        convert_to_gguf(args.convert_with, args.model, args.gguf)
    if args.convert_only:
        return 0 if os.path.isfile(args.gguf) else 1
    out_dir = args.output_dir or os.path.join("bench_results", "side_by_side-" + datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *a: (stop_all_servers(), sys.exit(143)))

    skipped: dict[str, str] = {}
    server_bin = None
    if "llamacpp" in args.engine_list:
        server_bin, tried = find_llama_server(args.llama_server)
        if server_bin is None:
            msg = (f"llama-server not found (looked at: {', '.join(tried)}); build it as in benchmarks/README.md "
                   "and pass --llama-server PATH or set $LLAMA_SERVER")
        elif not os.path.isfile(args.gguf):
            msg = (f"GGUF not found at {args.gguf}; make it with --convert-with LLAMA_CPP_SRC (see the docstring)")
        else:
            msg = None
        if msg:
            log(f"SKIP llama.cpp: {msg}")
            skipped["llama.cpp"] = msg
            args.engine_list.remove("llamacpp")

    samples, describe = build_samples(args)
    workload = describe(samples)
    log(f"workload: {args.dataset}: {workload}")
    too_long = [s for s in samples if s.prompt_len + s.expected_output_len > args.max_model_len]
    if too_long:
        raise SystemExit(f"{len(too_long)} requests exceed --max-model-len {args.max_model_len}")

    peaks, roof, roof_json = measure_roofline(args, out_dir)
    rows: list[dict] = []
    batch1: dict = {}
    try:
        if "pagedserve" in args.engine_list:
            if not args.skip_batch1:
                b1 = batch1_pagedserve(args, roof_json, out_dir)
                if b1:
                    batch1["pagedserve"] = b1
            run_pagedserve(args, samples, roof, out_dir, rows, skipped)
        if "llamacpp" in args.engine_list:
            run_llamacpp(args, server_bin, samples, roof, out_dir, rows, skipped, batch1)
        if any(e.startswith("hf-") for e in args.engine_list):
            try:
                hf_rows(args, samples, roof, rows, batch1, skipped)
            except Exception as e:  # e.g. out of memory on the padded batches: keep the other engines' results
                log(f"[HF] failed: {type(e).__name__}: {e}")
                skipped["HF"] = f"{type(e).__name__}: {e}"
    finally:
        stop_all_servers()

    rats = ratios(rows)
    report = format_report(args, workload, peaks, roof, rows, rats, batch1, skipped)
    log("")
    log(report)
    with open(os.path.join(out_dir, "side_by_side.md"), "w") as f:
        f.write(report)
    payload = {"model": args.model, "gguf": args.gguf, "llama_server": server_bin, "threads": args.threads,
               "concurrency": args.concurrencies, "dataset": args.dataset, "num_prompts": args.num_prompts,
               "seed": args.seed, "max_model_len": args.max_model_len, "workload": workload,
               "machine": asdict(peaks), "roofline": roof.to_dict(), "rows": rows, "ratios": rats,
               "batch1_decode": batch1, "batch1_bound_ms": roof.weight_bytes / roof.bandwidth * 1000,
               "skipped": skipped}
    with open(os.path.join(out_dir, "side_by_side.json"), "w") as f:
        json.dump(payload, f, indent=2)
    log(f"saved {out_dir}/side_by_side.md and side_by_side.json")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
