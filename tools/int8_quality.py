"""Quality of weight-only int8 (`--quantization int8`) on the demo model: greedy agreement and perplexity.

    python -m tools.int8_quality [--model-dir DIR] [--max-tokens 20000] [--prompts 32]

* Perplexity: the held-out stdlib windows of the demo model's card, scored by the transformers model with
  every nn.Linear swapped for pagedserve's int8 Linear (the same per-channel weights the engine runs) vs the
  float32 original, once per kernel: the engine's (the native kernel at every row count, activations quantized
  per row, where the CPU's build has it; else fbgemm) and, where that is the native one, fbgemm's (activations
  quantized per tensor: the kernel of the builds without a native int8 path).
* Greedy agreement: the engine itself, float32 vs int8, on prompts cut from held-out windows: the share of
  prompts whose continuations are identical and the mean length of the common prefix.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from pagedserve.demo_model_path import default_model_path
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.quantization.int8 import Int8Config
from tools.eval_demo_model import held_out_windows, load_model_float32, mean_loss


def quantize_hf_linears(model: torch.nn.Module, allow_native: bool = True, config=None) -> torch.nn.Module:
    """Every nn.Linear of `model` replaced by pagedserve's int8 Linear (allow_native=False: fbgemm's kernel), or by
    the Linear of another QuantizationConfig `config` (the int4 row of docs' quality table)."""
    config = config or Int8Config(allow_native=allow_native)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                q = Linear(child.in_features, child.out_features, bias=child.bias is not None, quant_config=config)
                q.weight.data.copy_(child.weight.data)
                if child.bias is not None:
                    q.bias.data.copy_(child.bias.data)
                q.process_weights_after_loading()
                setattr(module, child_name, q)
    return model


def greedy_agreement(model_dir: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from pagedserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for quant in (None, "int8"):
        llm = LLM(model_dir, quantization=quant, num_kv_blocks=1024)
        outs[quant] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                     use_tqdm=False)]
    prefix = []
    for a, b in zip(outs[None], outs["int8"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(n / len(a))
    return {"identical": sum(p == 1.0 for p in prefix) / len(prefix), "mean_common_prefix": sum(prefix) / len(prefix)}


def evaluate(model_dir: str, max_tokens: int, num_prompts: int, prompt_len: int = 64, new_tokens: int = 32) -> dict:
    windows = held_out_windows(model_dir, max_tokens=max_tokens)
    fp32 = mean_loss(load_model_float32(model_dir), windows)
    int8_model = quantize_hf_linears(load_model_float32(model_dir))
    int8 = mean_loss(int8_model, windows)
    prompts = [w[:prompt_len].tolist() for w in held_out_windows(model_dir)[:num_prompts]]
    result = {"eval_tokens": int(windows[:, 1:].numel()), "loss_fp32": fp32, "loss_int8": int8,
              "ppl_fp32": math.exp(fp32), "ppl_int8": math.exp(int8),
              "ppl_delta_pct": 100 * (math.exp(int8) / math.exp(fp32) - 1)}
    if any(m.native_decode_tensors() is not None for m in int8_model.modules() if isinstance(m, Linear)):
        fbgemm = mean_loss(quantize_hf_linears(load_model_float32(model_dir), allow_native=False), windows)
        result.update(loss_int8_fbgemm=fbgemm, ppl_int8_fbgemm=math.exp(fbgemm),
                      ppl_delta_fbgemm_pct=100 * (math.exp(fbgemm) / math.exp(fp32) - 1))
    result.update(greedy_agreement(model_dir, prompts, new_tokens))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=default_model_path())
    p.add_argument("--max-tokens", type=int, default=20_000)
    p.add_argument("--prompts", type=int, default=32)
    args = p.parse_args(argv)
    print(json.dumps(evaluate(args.model_dir, args.max_tokens, args.prompts), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
