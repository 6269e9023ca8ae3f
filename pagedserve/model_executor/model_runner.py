"""Owns the model and the KV cache tensors; turns a SchedulerOutput into one flat forward and samples.

The only place that knows tensor layouts: token ids, positions and slot mapping of the flattened batch,
block tables and context lengths for attention, and which rows produce logits.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pagedserve.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.model_executor.attention import AttentionMetadata, PrefillSpan
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.llama import LlamaForCausalLM
from pagedserve.model_executor.rejection_sampler import DraftBatch, rejection_sample
from pagedserve.model_executor.sampler import LogprobsTensors, Sampler, SamplingMetadata
from pagedserve.outputs import Logprob

logger = logging.getLogger("pagedserve")

# Measured in BENCHMARKS.md ("GEMM path"): pre-packed oneDNN beats F.linear (MKL) at every decode batch size
# >= 4 and in prefill on these machines (MKL's small-M kernels reach half the weight bandwidth).
AUTO_CPU_LINEAR_BACKEND = "onednn"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The model dtype for `--dtype` ("auto" or a name). "auto" is bfloat16 on GPUs and on CPUs with AMX-BF16 or
    AVX512-BF16 (as vLLM's CPU backend picks: bfloat16 GEMMs and the native bfloat16 ops run there at ~2x the
    float32 speed), float32 on other CPUs (bfloat16 arithmetic is emulated there). Logs which and why."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        logger.info("dtype auto: bfloat16 (CUDA device).")
        return torch.bfloat16
    if device.type == "cpu":
        from pagedserve.model_executor.kernels import cpu_flags, has_bf16_compute

        if has_bf16_compute():
            units = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
                     if flag in cpu_flags()]
            logger.info("dtype auto: bfloat16 (this CPU has %s; pass --dtype float32 for float32).",
                        " and ".join(units))
            return torch.bfloat16
        logger.info("dtype auto: float32 (this CPU has neither AMX-BF16 nor AVX512-BF16, so bfloat16 would be "
                    "emulated; pass --dtype bfloat16 to force it).")
    return torch.float32


class TokenMaskSource(Protocol):
    """Structured output's side of a step (engine/structured_output.py)."""

    matchers: dict  # sequence id -> its grammar's matcher

    def start_masks(self, sequence_ids: list[str]) -> "Future[torch.Tensor] | None": ...


@dataclass
class ModelRunnerOutput:
    # request id -> its new tokens: the drafts the target accepted, then one token sampled by the target
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)  # one per new token, if asked
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts proposed for the next step
    forward_time: float = 0.0  # the model forward alone (no input prep, no sampling)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype, block_size: int,
                 seed: int = 0, linear_backend: str = "auto", quantization: str | None = None,
                 kv_dtype: torch.dtype | None = None, drafter: "Drafter | None" = None) -> None:
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # a bfloat16 cache halves what decode attention streams
        self.block_size = block_size
        t0 = time.perf_counter()
        with torch.device(device):
            model = LlamaForCausalLM(model_config)
        model.load_weights(model_config.model_dir)
        self.model = model.to(dtype).eval()
        self.model.requires_grad_(False)
        self.linear_backend = self._pick_linear_backend(linear_backend, quantization)
        self.model.set_linear_backend(self.linear_backend)
        logger.info("Loaded %s (%s, %.1fM params, %s on %s) in %.1f s", model_config.model_dir,
                    model_config.architecture, model_config.num_params / 1e6, str(dtype).removeprefix("torch."),
                    device, time.perf_counter() - t0)
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.drafter = drafter  # speculative decoding: proposes each sampling request's next drafts

    def _pick_linear_backend(self, requested: str, quantization: str | None) -> str:
        if quantization == "int8":
            if self.device.type != "cpu":
                raise ValueError("quantization='int8' is implemented for the CPU only.")
            return "int8"
        if self.device.type != "cpu":
            return "torch"
        if requested == "auto":
            return AUTO_CPU_LINEAR_BACKEND if torch.backends.mkldnn.is_available() else "torch"
        return requested

    # ------------------------------------------------------------------ KV cache
    @property
    def kv_bytes_per_block(self) -> int:
        c = self.config
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * self.kv_dtype.itemsize

    def available_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024

    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=self.device)) for _ in range(c.num_layers)]

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> ModelRunnerOutput:
        """token_masks (structured output): asked for the sampling rows' allowed-token bitmask before the
        forward, so that it is computed while the forward runs."""
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(out.finished_request_ids, out.preempted_request_ids)
        # decodes first: attention batches them together
        items = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta, logits_indices, sampling_items = self._prepare_inputs(items)
        masks = token_masks.start_masks([i.request.request_id for i in sampling_items]) \
            if token_masks is not None and sampling_items else None
        t0 = time.perf_counter()
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        result = ModelRunnerOutput(forward_time=time.perf_counter() - t0)
        if sampling_items:
            self._sample(logits, sampling_items, result, masks.result() if masks is not None else None)
            if self.drafter is not None:
                constrained = token_masks.matchers if token_masks is not None else {}
                result.spec_token_ids = self.drafter.propose(sampling_items, result.sampled, len(out.scheduled),
                                                             constrained)
        return result

    def _prepare_inputs(self, items: list[ScheduledRequest]):
        bs = self.block_size
        tokens: list[int] = []
        positions, slots = [], []
        decode_tables, decode_lens = [], []
        prefills: list[PrefillSpan] = []
        logits_indices, sampling_items = [], []
        start = 0
        for item in items:
            r, n = item.request, item.num_new_tokens
            first = r.num_computed_tokens
            context_len = first + n
            tokens.extend(r.all_token_ids[first:context_len])
            tokens.extend(item.spec_token_ids)  # they follow the known tokens: context_len counts them
            pos = np.arange(first, context_len)
            table = np.asarray(item.block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            used_blocks = item.block_ids[:-(-context_len // bs)]
            if n == 1:
                decode_tables.append(used_blocks)
                decode_lens.append(context_len)
            else:
                mask = None
                if first > 0:  # a later chunk: causal over the whole context, offset by what came before
                    mask = torch.arange(context_len, device=self.device)[None, :] <= \
                        torch.arange(first, context_len, device=self.device)[:, None]
                prefills.append(PrefillSpan(start, n, context_len,
                                            torch.tensor(used_blocks, dtype=torch.long, device=self.device), mask))
            start += n
            if item.samples:  # the last known token's position and every draft's
                logits_indices.extend(range(start - 1 - len(item.spec_token_ids), start))
                sampling_items.append(item)
        dev = self.device
        decode_bt = decode_lens_t = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            table = np.zeros((len(decode_tables), width), dtype=np.int64)
            for i, t in enumerate(decode_tables):
                table[i, :len(t)] = t
            decode_bt = torch.from_numpy(table).to(dev)
            decode_lens_t = torch.tensor(decode_lens, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decodes=len(decode_tables),
            decode_block_tables=decode_bt,
            decode_context_lens=decode_lens_t,
            block_size=bs,
            prefills=prefills,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return input_ids, pos_t, meta, torch.tensor(logits_indices, dtype=torch.long, device=dev), sampling_items

    def _sample(self, logits: torch.Tensor, items: list[ScheduledRequest], result: ModelRunnerOutput,
                allowed_token_mask: torch.Tensor | None = None) -> None:
        """One row of logits per sampling request, or k + 1 for a request with k drafts (verified here)."""
        requests = [item.request for item in items]
        drafts = [item.spec_token_ids for item in items]
        speculative = any(drafts)
        rows = [len(d) + 1 for d in drafts]
        row_requests = [r for r, n in zip(requests, rows) for _ in range(n)] if speculative else requests
        meta = self._sampling_metadata(row_requests)
        if allowed_token_mask is not None:  # one mask row per request (constrained requests never draft)
            meta.allowed_token_mask = allowed_token_mask.repeat_interleave(torch.tensor(rows), dim=0) \
                if speculative else allowed_token_mask
        logprobs: LogprobsTensors | None
        if speculative:
            draft_probs = [self.drafter.draft_probs(r.request_id) if d else None for r, d in zip(requests, drafts)]
            verified = rejection_sample(logits, meta, DraftBatch(drafts, draft_probs), self.default_generator)
            token_lists, logprobs = verified.token_ids, verified.logprobs
        else:
            out = self.sampler(logits, meta, self.default_generator)
            token_lists, logprobs = [[t] for t in out.sampled_token_ids.tolist()], out.logprobs
        for r, tokens in zip(requests, token_lists):
            result.sampled[r.request_id] = tokens
        if logprobs is not None:
            self._collect_logprobs(requests, token_lists, logprobs, result)

    def _sampling_metadata(self, row_requests: list) -> SamplingMetadata:
        params = [r.sampling_params for r in row_requests]
        generators = {}
        banned = {}
        for row, r in enumerate(row_requests):
            p = r.sampling_params
            if p.seed is not None and not p.greedy:
                g = self.generators.get(r.request_id)
                if g is None:  # each of the n samples of a request gets its own stream: seed + index
                    g = torch.Generator(device=self.device).manual_seed(p.seed + r.sample_index)
                    self.generators[r.request_id] = g
                generators[row] = g
            if r.num_output_tokens < p.min_tokens:
                banned[row] = sorted(r.eos_token_ids | set(p.stop_token_ids))
        any_penalty = any(p.needs_penalties for p in params)
        return SamplingMetadata.build(
            params, generators,
            [r.prompt_token_ids for r in row_requests] if any_penalty else [],
            [r.output_token_ids for r in row_requests] if any_penalty else [],
            banned, self.device)

    @staticmethod
    def _collect_logprobs(requests: list, token_lists: list[list[int]], lp: LogprobsTensors,
                          result: ModelRunnerOutput) -> None:
        """lp has one row per produced token, requests in order."""
        top_ids, top_lps = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
        sampled_lps, sampled_ranks = lp.sampled_logprobs.tolist(), lp.sampled_ranks.tolist()
        row = 0
        for r, tokens in zip(requests, token_lists):
            k = r.sampling_params.logprobs
            if k is not None:
                entries = []
                for i, token in enumerate(tokens, start=row):
                    entry = {token: Logprob(sampled_lps[i], sampled_ranks[i])}
                    for rank, (tid, tlp) in enumerate(zip(top_ids[i][:k], top_lps[i][:k]), start=1):
                        entry.setdefault(tid, Logprob(tlp, rank))
                    entries.append(entry)
                result.logprobs[r.request_id] = entries
            row += len(tokens)


class Drafter(Protocol):
    """Speculative decoding's proposer side (spec_decode/): drafts for each sampling request of the step."""

    def propose(self, items: list[ScheduledRequest], sampled: dict[str, list[int]], batch_size: int,
                constrained: dict) -> dict[str, list[int]]: ...

    def draft_probs(self, request_id: str) -> torch.Tensor | None: ...

    def forget(self, finished_ids: list[str], preempted_ids: list[str]) -> None: ...


def configure_threads(num_threads: int | None) -> None:
    """Intra-op threads = cores by default; one pool, no oversubscription."""
    torch.set_num_threads(num_threads or os.cpu_count() or 1)
