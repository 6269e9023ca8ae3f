"""Random PEFT LoRA adapters for a tiny checkpoint, built and saved by the `peft` package itself, and the HF reference
model with an adapter merged (PEFT's merge_and_unload), saved as a plain checkpoint for hf_reference.hf_greedy.

A and B are both random (init_lora_weights=False; PEFT's default starts B at zero, which would test nothing), scaled
so that the adapter moves the logits visibly without swamping the base model.
"""
from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: Path, out_dir: Path, *, rank: int = 8, alpha: int = 16, seed: int = 0,
                      target_modules: list[str] | None = None, use_rslora: bool = False,
                      std: float = 0.1) -> tuple[Path, Path]:
    """-> (adapter directory, merged checkpoint directory)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    adapter_dir, merged_dir = out_dir / "adapter", out_dir / "merged"
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or ALL_TARGETS, lora_dropout=0.0,
                        bias="none", init_lora_weights=False, use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(adapter_dir))
    merged = model.merge_and_unload()
    merged.save_pretrained(str(merged_dir), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(merged_dir))
    return adapter_dir, merged_dir
