"""Multi-LoRA's cost: the same closed-loop workload on the base model and with four rank-16 adapters mixed evenly
(every projection of every layer adapted: q/k/v/o, gate/up/down), in one engine, rounds alternating between the arms
(the shared machine's speed drifts). Greedy, random token prompts, exact output lengths (ignore_eos).

    python benchmarks/lora_overhead.py --shape smollm2-135m --concurrency 16 --rounds 2 --num-threads 1

The base arm runs in the same --enable-lora engine: a step without adapter rows is exactly the base model's (the
LoRA layers add nothing and the native whole-stack decode runs), so it is the number without LoRA. Adapters are
written in PEFT's format (adapter_config.json + adapter_model.safetensors) with random A and B. Reported: output
tok/s per arm (median of rounds) and the ratio lora / base, by the wall clock and by the process's CPU time (output
tokens per CPU second: on a machine shared with other jobs the wall clock also counts the time the process waited
for a core; with --num-threads 1 the CPU time is the work done).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedserve import LLM, SamplingParams
from pagedserve.benchmarks.shapes import get_shape, make_model
from pagedserve.lora import LoRARequest

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    h, inter, d = config["hidden_size"], config["intermediate_size"], config.get("head_dim") or \
        config["hidden_size"] // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(TARGETS), "bias": "none"}))
    return out


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras) -> tuple[float, float]:
    """(output tok/s, output tokens per CPU second)."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lora-bench-"))
    model_dir = work / args.shape
    if not (model_dir / "config.json").exists():
        make_model(get_shape(args.shape), str(model_dir))
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(write_adapter(model_dir, work / f"adapter{i}", args.rank, i)))
                for i in range(args.num_adapters)]
    llm = LLM(str(model_dir), dtype=args.dtype, enable_lora=True, max_loras=args.num_adapters,
              max_lora_rank=args.rank, max_num_seqs=args.concurrency, num_threads=args.num_threads,
              enable_prefix_caching=False, num_kv_blocks=args.concurrency * (args.prompt_len + args.output_len) // 16 + 64)
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
    run(llm, prompts[:4], params, mixed[:4])  # adapters into their slots once
    results: dict[str, list[tuple[float, float]]] = {"base": [], "lora": []}
    for r in range(args.rounds):
        for arm in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
            results[arm].append(run(llm, prompts, params, None if arm == "base" else mixed))
            print(f"round {r} {arm}: {results[arm][-1][0]:.1f} output tok/s, {results[arm][-1][1]:.1f} per CPU s",
                  flush=True)
    (base, base_cpu), (lora, lora_cpu) = ([statistics.median(v[i] for v in results[arm]) for i in (0, 1)]
                                          for arm in ("base", "lora"))
    print(f"{args.shape} dtype={llm.llm_engine.model_config.dtype} C={args.concurrency} threads={args.num_threads} "
          f"{args.num_adapters} adapters rank {args.rank}: base {base:.1f} tok/s, lora {lora:.1f} tok/s, "
          f"ratio {lora / base:.3f}; per CPU second: base {base_cpu:.1f}, lora {lora_cpu:.1f}, "
          f"ratio {lora_cpu / base_cpu:.3f}")


if __name__ == "__main__":
    main()
