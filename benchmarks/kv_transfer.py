"""The second KV tier vs recompute, and what moving a KV block costs (issue 16).

    python benchmarks/kv_transfer.py [--shape smollm2-135m] [--prompt-len 1024] [--num-prompts 6]

A working set of `num_prompts` distinct prompts, revisited round-robin (multi-turn chat's shape: every turn
re-sends the whole conversation), in a KV pool that holds a third of it, so that every revisit finds its prefix
evicted. Engines in one process, the same pool: `recompute` (no connector), `tier` (--kv-offloading-size) and
`disk tier` (a 1 MiB memory tier spilling to a directory under the temp directory); requests alternate between
them, one at a time, max_tokens=1, so a request's wall time is its TTFT. Medians.
Then the per-block costs: payload bytes, the runner's read (save) and write (load) per block, zlib on real KV,
the directory store's file write/read (under /dev/shm and the temp directory), and Redis MSET/MGET on loopback
when redis-server is installed. `--costs-only` skips the TTFT comparison and adds the prefill time per block.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.benchmarks.shapes import get_shape, make_model  # noqa: E402
from pagedserve.kv_transfer.block_io import read_kv_blocks, write_kv_blocks  # noqa: E402


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t0


def per_block(fn, n: int, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--costs-only", action="store_true",
                    help="skip the TTFT comparison: only the per-block costs (and the prefill time per block)")
    args = ap.parse_args()
    model_dir = Path(tempfile.gettempdir()) / f"pagedserve-bench-{args.shape}"
    if not (model_dir / "config.json").exists():
        make_model(get_shape(args.shape), model_dir, dtype="bfloat16")
    block = 16
    pool_blocks = args.num_prompts * (args.prompt_len // block + 1) // 3
    common = dict(num_kv_blocks=pool_blocks, block_size=block, dtype=args.dtype, num_threads=1,
                  max_model_len=args.prompt_len + 16, max_num_batched_tokens=args.prompt_len + 16)
    engines = {"tier": LLM(str(model_dir), kv_offloading_size=4.0, **common)}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    if args.costs_only:
        prefill = statistics.median(ttft(engines["tier"], p) for p in prompts[:3])
        print(f"# load average {os.getloadavg()[0]:.2f}; prefill of {args.prompt_len} tokens {prefill * 1e3:.0f} ms: "
              f"{prefill / (args.prompt_len / block) * 1e3:.1f} ms per block of {block} tokens computed")
        block_costs(engines["tier"].llm_engine.runner, pool_blocks, block)
        return
    # the disk tier: a 1 MiB memory tier (about one block) spilling to a directory on the temp file system
    spill = tempfile.mkdtemp(prefix="pagedserve-kv-spill-")
    disk = {"kv_connector": "cpu", "kv_buffer_size": 1 << 20, "path": spill, "disk_size": 4 << 30}
    engines = {"recompute": LLM(str(model_dir), **common), **engines,
               "disk tier": LLM(str(model_dir), kv_transfer_config=disk, **common)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, llm in engines.items():  # first visits fill the tier; not measured
        for p in prompts:
            ttft(llm, p)
    for _ in range(args.rounds):
        for p in prompts:
            for name, llm in engines.items():
                times[name].append(ttft(llm, p))
    print(f"# {args.shape} {args.dtype}, prompt {args.prompt_len} tokens, {args.num_prompts} prompts, pool "
          f"{pool_blocks} blocks of {block} (a third of the working set), load average {os.getloadavg()[0]:.2f}")
    print("| engine | TTFT p50 (ms) | TTFT p90 (ms) | tier hits (blocks) |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        engine = engines[name].llm_engine
        hits = engine.get_stats().scheduler.external_prefix_cache_hits // block if engine.kv_connector else "-"
        q = statistics.quantiles(ts, n=10)
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {q[-1] * 1e3:.1f} | {hits} |")
    for name in ("tier", "disk tier"):
        print(f"TTFT p50 recompute / {name}: {statistics.median(times['recompute']) / statistics.median(times[name]):.2f}x")
    shutil.rmtree(spill, ignore_errors=True)

    block_costs(engines["tier"].llm_engine.runner, pool_blocks, block)


def block_costs(runner, pool_blocks: int, block: int) -> None:
    ids = list(range(min(64, pool_blocks)))
    payloads = read_kv_blocks(runner.kv_caches, ids)
    nbytes = len(payloads[0])
    print(f"\nper block ({nbytes / 1024:.0f} KiB: {runner.model_config.num_layers} layers x K,V x {block} tokens x "
          f"{runner.model_config.num_kv_heads} heads x {runner.model_config.head_dim} x {runner.kv_dtype}):")
    print(f"  read (save path)  {per_block(lambda: read_kv_blocks(runner.kv_caches, ids), len(ids)) * 1e6:.0f} us")
    print(f"  write (load path) {per_block(lambda: write_kv_blocks(runner.kv_caches, ids, payloads), len(ids)) * 1e6:.0f} us")
    t = per_block(lambda: [zlib.compress(p, 1) for p in payloads], len(ids))
    ratio = sum(len(zlib.compress(p, 1)) for p in payloads) / (nbytes * len(ids))
    print(f"  zlib level 1: {ratio:.3f} of the size, {t * 1e6:.0f} us per block")
    directory_costs(payloads)
    if shutil.which("redis-server"):
        redis_costs(payloads)


def directory_costs(payloads: list[bytes]) -> None:
    from pagedserve.kv_transfer.stores import DirectoryStore

    for where in ("/dev/shm", tempfile.gettempdir()):
        if not os.path.isdir(where):
            continue
        root = tempfile.mkdtemp(dir=where, prefix="pagedserve-kv-cost-")
        try:
            store, items = DirectoryStore(root), [(f"k{i}", p) for i, p in enumerate(payloads)]
            put = per_block(lambda s=store, i=items: s.put(i), len(items))
            get = per_block(lambda s=store, i=items: s.get_prefix([k for k, _ in i]), len(items))
            print(f"  directory store under {where}: write {put * 1e6:.0f} us, read {get * 1e6:.0f} us per block")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def redis_costs(payloads: list[bytes]) -> None:
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        keys = [f"k{i}" for i in range(len(payloads))]
        put = per_block(lambda: client.mset(dict(zip(keys, payloads))), len(keys))
        get = per_block(lambda: client.mget(keys), len(keys))
        print(f"  redis on loopback: MSET {put * 1e6:.0f} us, MGET {get * 1e6:.0f} us per block")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
