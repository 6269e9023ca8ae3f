"""Train the small demo model that ships in ``pagedserve/demo_model``.

    python -m tools.train_demo_model --out pagedserve/demo_model

A small Llama-architecture model (GQA, tied embeddings) with its own byte-level BPE tokenizer,
trained from scratch on the Python standard library sources of the running interpreter (PSF
license). A deterministic ~3% of the files (by a hash of the relative path, see
``eval_demo_model.is_held_out``) is held out for evaluation.

Deterministic: fixed seeds, sorted file order, a seeded permutation of the packed windows per
epoch, a fixed number of steps, seeded initial weights. Float sums are not bit-exact across runs
because of thread scheduling in the CPU kernels, so losses agree only to within float noise.

Outputs in ``--out``: config.json, generation_config.json, model.safetensors (bfloat16),
tokenizer.json, tokenizer_config.json, special_tokens_map.json, eval.json, loss_log.json,
loss_curve.png, MODEL_CARD.md.

``--rewrite-card`` redoes the samples, loss curve and card of a trained ``--out`` without training.
``--probe-steps N`` only times N optimizer steps on random tokens for the chosen size (no
tokenizer, nothing written) to size a run that fits a time budget.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from tools import eval_demo_model as ev

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS, EOS, PAD = SPECIAL_TOKENS[:3]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main(argv):", "class Stack:\n    def __init__(self):"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    # tokenizer("text") prepends <|bos|> like Llama tokenizers; add_special_tokens=False does not.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok, out: Path, max_len: int):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=max_len,
        padding_side="left",
    )
    hf.save_pretrained(str(out))
    # Keep tokenizer_config.json loadable by transformers 4.x too: a class name both know, the chat
    # template inline (4.x before ~4.50 does not read chat_template.jinja), and the list form of the
    # extra special tokens.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = CHAT_TEMPLATE
    tc.pop("extra_special_tokens", None)
    tc["additional_special_tokens"] = SPECIAL_TOKENS[3:]
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    smap = out / "special_tokens_map.json"
    if not smap.exists():  # transformers 5 no longer writes it; older loaders like it
        smap.write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                                    "additional_special_tokens": SPECIAL_TOKENS[3:]}, indent=2) + "\n")
    return hf


# ----------------------------------------------------------------------------------------------
# model


def make_config(args, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // args.head_dim,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def build_model(config, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.float()
    return model


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embedding counted once


def lr_at(step: int, args) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * lr (step is 0-based)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )


def train_step(model, opt, batch, args, step):
    for g in opt.param_groups:
        g["lr"] = lr_at(step, args)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def batches(windows, batch_size: int, seed: int):
    """Endless deterministic stream: a seeded permutation of the windows per epoch."""
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        perm = torch.randperm(windows.shape[0], generator=g)
        for i in range(0, len(perm) - batch_size + 1, batch_size):
            yield epoch, windows[perm[i : i + batch_size]]
        epoch += 1


# ----------------------------------------------------------------------------------------------
# main


def seed_everything(seed: int, threads: int):
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def probe(args):
    seed_everything(args.seed, args.threads)
    cfg = make_config(args, args.vocab_size, 0, 1, 2)
    model = build_model(cfg, args.seed)
    model.train()
    opt = make_optimizer(model, args)
    n = count_params(model)
    log(f"probe: params={n:,} ({n * 2 / 1e6:.1f} MB bf16) batch={args.batch_size} seq={args.seq_len} amp={args.amp}")
    g = torch.Generator().manual_seed(0)
    times = []
    for step in range(args.probe_steps):
        x = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=g)
        t0 = time.perf_counter()
        train_step(model, opt, x, args, step)
        times.append(time.perf_counter() - t0)
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    tps = args.batch_size * args.seq_len / steady
    log(f"probe: median step {steady:.3f}s  -> {tps:,.0f} tokens/s; "
        f"{args.steps} steps ~ {args.steps * steady / 60:.1f} min, {args.steps * args.batch_size * args.seq_len:,} tokens")


def make_samples(model, hf_tok) -> dict[str, str]:
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        samples[prompt] = greedy(model, hf_tok, prompt)
        log(f"sample {prompt!r} -> {samples[prompt]!r}")
    return samples


def write_reports(out: Path, loss_log: dict) -> None:
    (out / "loss_log.json").write_text(json.dumps(loss_log, indent=1) + "\n")
    plot_losses(loss_log, out / "loss_curve.png")
    write_card(out, loss_log["summary"])


def rewrite_card(out: Path) -> int:
    """Redo the samples, loss curve and MODEL_CARD.md of an already trained ``out`` (no training)."""
    from transformers import AutoTokenizer

    loss_log = json.loads((out / "loss_log.json").read_text())
    torch.set_num_threads(loss_log["args"].get("threads", 1))
    hf_tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    loss_log["summary"]["samples"] = make_samples(ev.load_model_float32(out), hf_tok)
    loss_log["summary"]["weights_bytes"] = (out / "model.safetensors").stat().st_size
    write_reports(out, loss_log)
    log(f"rewrote the card, samples and loss curve in {out}")
    return 0


def greedy(model, hf_tok, prompt: str, max_new_tokens: int = 48) -> str:
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=hf_tok.pad_token_id, eos_token_id=hf_tok.eos_token_id)
    return hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def plot_losses(loss_log: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    tr = loss_log["train"]
    ax.plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr], label="train (mean over log interval)", lw=1.2)
    evs = loss_log["eval"]
    ax.plot([r["tokens"] / 1e6 for r in evs], [r["held_out_loss_subset"] for r in evs], "o-",
            label="held-out (first 20k tokens)", lw=1.2, ms=3)
    summ = loss_log.get("summary")
    if summ:
        ax.plot([summ["tokens_seen"] / 1e6], [summ["held_out_loss"]], "*", ms=10, color="C3",
                label=f"held-out, all tokens, shipped bf16 weights ({summ['held_out_loss']:.3f})")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("pagedserve demo model: Python stdlib")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_card(out: Path, info: dict):
    a = info["arch"]
    samples = "\n\n".join(
        f"Prompt `{json.dumps(p)}` →\n\n```python\n{p}{c}\n```" for p, c in info["samples"].items()
    )
    card = f"""# pagedserve demo model

A tiny Llama-architecture language model trained from scratch on the Python standard library
sources. It ships inside the package so that `pagedserve serve` and `LLM()` with no model work on a
machine with no network and produce recognisable (Python-flavoured) text. It is a demo and test
fixture: it knows roughly what Python code looks like and nothing else; it is not an assistant.

## Data

- Python {info['python_version']} standard library `*.py` sources (`sysconfig.get_paths()["stdlib"]`),
  skipping the directories {", ".join(sorted(ev.SKIP_DIR_NAMES))} and files over {ev.MAX_FILE_BYTES:,} bytes.
- {info['n_train_files']} training files ({info['train_tokens']:,} tokens), {info['n_held_out_files']} held-out files
  ({info['held_out_tokens']:,} tokens). Held out: `int(sha1(relative_path), 16) % 100 < {ev.HELD_OUT_PERCENT}`.
  Held-out data fingerprint (sha256 of paths + contents): `{info['held_out_fingerprint']}`.
- Each document is `<|bos|>` + file text + `<|eos|>`; documents are concatenated in sorted path order
  and cut into non-overlapping windows of {a['seq_len']} tokens (windows may span documents).
- License: the training data is the Python standard library, © Python Software Foundation, under the
  PSF License Agreement. The weights and tokenizer are trained by the pagedserve project and ship under
  the project's license.

## Architecture

`LlamaForCausalLM`: {a['layers']} layers, hidden {a['hidden']}, {a['heads']} attention heads × head_dim {a['head_dim']},
{a['kv_heads']} KV heads (GQA), MLP (SwiGLU) intermediate {a['intermediate']}, vocab {a['vocab_size']},
tied input/output embeddings, RMSNorm eps 1e-5, RoPE theta 10000, max_position_embeddings
{a['max_position_embeddings']} (trained on {a['seq_len']}-token windows only, so expect quality to fall off
past ~{a['seq_len']} tokens). **{info['params']:,} parameters** ({info['embedding_params']:,} in the embedding).
Stored in bfloat16 (`model.safetensors`, {info['weights_bytes'] / 1e6:.1f} MB).

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training files only: vocab {a['vocab_size']}, ByteLevel
pre-tokenizer/decoder (lossless round trip), no normalization. Special tokens: {", ".join(f"`{t}`" for t in SPECIAL_TOKENS)}.
`tokenizer(text)` prepends `<|bos|>` (`add_special_tokens=False` does not). The chat template renders
`<|bos|>` then `<|role|>\\ncontent<|end|>\\n` per message and `<|assistant|>\\n` for
`add_generation_prompt` (the model never saw chat data, so chat output is code-like babble).

## Training

- {info['steps']} steps of AdamW (betas 0.9/0.95, weight decay {info['weight_decay']} on matrices, grad clip
  {info['grad_clip']}), peak lr {info['lr']} with {info['warmup']} warmup steps then cosine decay to
  {info['min_lr_ratio']:g}× peak; batch {info['batch_size']} × {a['seq_len']} tokens; bf16 autocast on CPU, fp32 master weights.
- Tokens seen: {info['tokens_seen']:,} ({info['epochs']:.2f} epochs of the training tokens).
- Wall time: {info['wall_time_s'] / 60:.1f} min total, tokenizer and evaluation included ({info['train_time_s'] / 60:.1f} min in
  the training loop), with {info['threads']} torch thread{"s" if info['threads'] != 1 else ""} ({info['cpu']}) on 2 CPU cores shared with other
  work; torch {info['torch_version']}, transformers {info['transformers_version']}. One thread because on busy
  shared cores two OpenMP threads spin-wait on each other and measured 3-8x slower.
- Deterministic: seed {info['seed']} fixes the initial weights and the data order (sorted files, a seeded
  permutation of the windows per epoch) and the step count is fixed. Float sums in the CPU kernels are
  not bit-exact across runs (thread scheduling and kernel choice depend on the thread count and CPU), so a
  rerun reproduces the losses only to within float noise.
- Reproduce, from a source checkout: `python -m tools.train_demo_model --out pagedserve/demo_model`
  (same Python version for the same data).

## Results

Losses are mean next-token cross-entropy in nats/token. Held-out losses are computed on the shipped
bfloat16 weights, upcast to float32, by `tools.eval_demo_model`.

| | nats/token |
| --- | --- |
| final train loss (mean of the last {info['log_every']} steps) | {info['final_train_loss']:.4f} |
| held-out loss, all {info['eval_tokens']:,} predicted held-out tokens | {info['held_out_loss']:.4f} |
| held-out loss, first {ev.TEST_SUBSET_TOKENS:,}-token subset (what the test re-checks) | {info['held_out_loss_subset']:.4f} |

The subset is the first held-out windows in sorted path order, not a random sample; its files happen to
be easier than the rest, hence the lower number. The plotted held-out curve is that subset, measured
on the float32 training weights.

held_out_loss: {info['held_out_loss']:.4f}

![loss curve](loss_curve.png)

Greedy completions of the shipped weights (transformers, float32 compute, `<|bos|>` + prompt, 48 new tokens):

{samples}

`eval.json` holds the held-out numbers; `loss_log.json` holds the full train/eval log.
"""
    (out / "MODEL_CARD.md").write_text(card)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train the packaged pagedserve demo model.")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "pagedserve" / "demo_model"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 by default: on busy shared cores 2 OpenMP threads spin-wait and run 3-8x slower")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument("--no-amp", dest="amp", action="store_false", help="train in pure fp32")
    p.add_argument("--probe-steps", type=int, default=0, help="only time N steps on random data")
    p.add_argument("--rewrite-card", action="store_true",
                   help="no training: redo samples, loss curve and MODEL_CARD.md from --out's loss_log.json")
    args = p.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    if args.probe_steps:
        probe(args)
        return 0
    if args.rewrite_card:
        return rewrite_card(Path(args.out))

    t_start = time.time()
    seed_everything(args.seed, args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "eval.json"):
        (out / stale).unlink(missing_ok=True)

    # data + tokenizer
    train_docs, held_docs = ev.load_split()
    log(f"data: {len(train_docs)} train files, {len(held_docs)} held-out files from {ev.stdlib_root()}")
    tok = train_tokenizer([t for _, t in train_docs], args.vocab_size)
    hf_tok = save_tokenizer(tok, out, args.max_position_embeddings)
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    vocab = tok.get_vocab_size()
    log(f"tokenizer: vocab {vocab} trained in {time.time() - t_start:.0f}s")
    train_stream = ev.encode_documents(out / "tokenizer.json", [t for _, t in train_docs], bos_id, eos_id)
    held_stream = ev.encode_documents(out / "tokenizer.json", [t for _, t in held_docs], bos_id, eos_id)
    train_windows = ev.pack(train_stream, args.seq_len)
    held_windows = ev.pack(held_stream, args.seq_len)
    eval_subset = held_windows[: ev.TEST_SUBSET_TOKENS // args.seq_len]
    log(f"tokens: train {len(train_stream):,} ({train_windows.shape[0]} windows), held-out {len(held_stream):,} "
        f"({held_windows.shape[0]} windows); {time.time() - t_start:.0f}s")

    # model
    config = make_config(args, vocab, bos_id, eos_id, pad_id)
    model = build_model(config, args.seed)
    n_params = count_params(model)
    log(f"model: {n_params:,} params")
    opt = make_optimizer(model, args)

    loss_log = {"train": [], "eval": []}
    tokens_per_step = args.batch_size * args.seq_len

    def do_eval(step):
        model.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            loss = ev.mean_loss(model, eval_subset)
        model.train()
        loss_log["eval"].append({"step": step, "tokens": step * tokens_per_step, "held_out_loss_subset": loss,
                                 "elapsed_s": time.time() - t_start})
        log(f"step {step:5d} | held-out(subset) {loss:.4f}")

    model.train()
    t_train = time.time()
    do_eval(0)
    window_losses = []
    data = batches(train_windows, args.batch_size, args.seed)
    epoch = 0
    for step in range(args.steps):
        epoch, batch = next(data)
        window_losses.append(train_step(model, opt, batch, args, step))
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            mean = sum(window_losses) / len(window_losses)
            el = time.time() - t_train
            loss_log["train"].append({"step": done, "tokens": done * tokens_per_step, "loss": mean,
                                      "lr": lr_at(step, args), "epoch": epoch, "elapsed_s": time.time() - t_start})
            eta = el / done * (args.steps - done)
            log(f"step {done:5d} | loss {mean:.4f} | lr {lr_at(step, args):.2e} | epoch {epoch} | "
                f"{done * tokens_per_step / el:,.0f} tok/s | eta {eta / 60:.1f} min")
            window_losses = []
        if done % args.eval_every == 0 and done != args.steps:
            do_eval(done)
    do_eval(args.steps)
    train_time = time.time() - t_train
    fp32_subset = loss_log["eval"][-1]["held_out_loss_subset"]

    # save the shipped checkpoint (bfloat16)
    model.eval()
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)  # written 0600; a package data file must be world-readable
    cfg_path = out / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json.setdefault("rope_theta", 10000.0)  # also top level, for loaders that predate rope_parameters
    cfg_json["torch_dtype"] = "bfloat16"
    cfg_json["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    log(f"saved checkpoint to {out}")

    # evaluate exactly what ships
    shipped = ev.load_model_float32(out)
    full_loss = ev.mean_loss(shipped, held_windows)
    subset_loss = ev.mean_loss(shipped, eval_subset)
    log(f"shipped weights: held-out {full_loss:.4f} (subset {subset_loss:.4f}; fp32 training weights subset {fp32_subset:.4f})")
    eval_rec = {
        "held_out_loss": full_loss,
        "eval_tokens": held_windows[:, 1:].numel(),
        "seq_len": args.seq_len,
        "held_out_loss_subset": subset_loss,
        "subset_max_tokens": ev.TEST_SUBSET_TOKENS,
        "subset_eval_tokens": eval_subset[:, 1:].numel(),
        "held_out_files": len(held_docs),
        "held_out_fingerprint": ev.held_out_fingerprint(held_docs),
        "python_version": platform.python_version(),
        "fp32_weights_held_out_loss_subset": fp32_subset,
        "units": "nats/token",
    }
    (out / "eval.json").write_text(json.dumps(eval_rec, indent=2) + "\n")

    samples = make_samples(shipped, hf_tok)

    wall = time.time() - t_start
    final_train = loss_log["train"][-1]["loss"]
    import transformers

    arch = {"layers": args.layers, "hidden": args.hidden, "heads": args.hidden // args.head_dim,
            "head_dim": args.head_dim, "kv_heads": args.kv_heads, "intermediate": args.intermediate,
            "vocab_size": vocab, "max_position_embeddings": args.max_position_embeddings, "seq_len": args.seq_len}
    summary = {
        "arch": arch, "params": n_params, "embedding_params": vocab * args.hidden,
        "steps": args.steps, "batch_size": args.batch_size, "tokens_seen": args.steps * tokens_per_step,
        "epochs": args.steps * args.batch_size / train_windows.shape[0],
        "wall_time_s": wall, "train_time_s": train_time, "final_train_loss": final_train,
        "held_out_loss": full_loss, "held_out_loss_subset": subset_loss, "eval_tokens": eval_rec["eval_tokens"],
        "n_train_files": len(train_docs), "n_held_out_files": len(held_docs),
        "train_tokens": len(train_stream), "held_out_tokens": len(held_stream),
        "held_out_fingerprint": eval_rec["held_out_fingerprint"],
        "python_version": platform.python_version(), "torch_version": torch.__version__,
        "transformers_version": transformers.__version__, "cpu": platform.processor() or platform.machine(),
        "threads": args.threads, "seed": args.seed, "lr": args.lr, "warmup": args.warmup,
        "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
        "log_every": args.log_every, "weights_bytes": (out / "model.safetensors").stat().st_size,
        "samples": samples,
    }
    loss_log["summary"] = summary
    loss_log["args"] = vars(args)
    write_reports(out, loss_log)
    log(f"done in {wall / 60:.1f} min: train {final_train:.4f}, held-out {full_loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
