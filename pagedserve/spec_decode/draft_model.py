"""Draft-model proposer: a smaller model with the same vocabulary proposes k tokens per request per step, batched
over the requests, with its own paged KV cache inside the engine.

Its cache has the target's block ids (one more tensor per draft layer), so the scheduler's block tables and
allocate_slots serve both; the scheduler reserves num_speculative_tokens lookahead slots past each step for the
draft's K/V of its own proposals. Per request the drafter knows how many leading positions of its cache are
valid (its K/V of accepted tokens); each step it first catches up on the tokens it has not seen (the prompt on
the first step, then the accepted drafts and the bonus token), which yields draft 1, then runs one batched
decode per further draft. Drafts that the target rejects leave stale K/V past that point: they are recomputed
next step. After a preemption the request starts over from position 0.
"""
from __future__ import annotations

import torch

from pagedserve.config import SpeculativeConfig, dtype_name
from pagedserve.core.kv_cache_groups import KVCacheGroup
from pagedserve.core.scheduler import ScheduledRequest
from pagedserve.model_executor.input_batch import TokenSpan, prepare_batch, runs_as_decode
from pagedserve.model_executor.model_config import ModelConfig, resolve_model_dir
from pagedserve.model_executor.model_loader import allocate_kv_cache, kv_bytes_per_block, load_model
from pagedserve.model_executor.quantization.base import QuantizationConfig
from pagedserve.model_executor.quantization.packed import CheckpointQuantizationConfig
from pagedserve.model_executor.quantization.registry import get_quantization_config, resolve_quantization
from pagedserve.model_executor.sampler import (SAMPLING_EPS, SamplingMetadata, inverse_cdf_sample,
                                               processed_logits, sampling_probs)
from pagedserve.spec_decode.drafter import Drafter, DrafterContext


def _draft_quant_config(cfg: ModelConfig, context: DrafterContext) -> QuantizationConfig:
    """The target's `--quantization` (int8, int4: quantized as the weights load) where both checkpoints are float; a
    pre-quantized checkpoint's format is its own, read from the draft's config.json."""
    if cfg.quantization_config is None and not isinstance(context.quant_config, CheckpointQuantizationConfig):
        return context.quant_config
    return get_quantization_config(resolve_quantization(None, cfg.quantization_config), "auto", context.device,
                                   cfg.quantization_config)


class DraftModelDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        model_dir = resolve_model_dir(config.model)
        try:
            cfg = ModelConfig.from_dir(model_dir, dtype=dtype_name(context.dtype), max_model_len=context.max_model_len)
        except ValueError as exc:
            raise ValueError(f"speculative_config.model: {exc}") from None
        if cfg.vocab_size != context.vocab_size:
            raise ValueError(f"speculative_config.model has a vocabulary of {cfg.vocab_size} tokens, the target "
                             f"{context.vocab_size}: a draft model must share the target's tokenizer.")
        self.model_config = cfg
        self.device = context.device
        self.kv_dtype = context.kv_dtype
        self.block_size = context.block_size
        self.model = load_model(cfg, context.device, context.dtype, _draft_quant_config(cfg, context),
                                context.attn_backend)
        # one block table (the target's group 0) for every layer: one KV tensor per layer
        self.model.set_kv_cache_groups([KVCacheGroup(tuple(range(cfg.num_layers)), None)])
        self.generator = torch.Generator(device=context.device).manual_seed(context.seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_valid: dict[str, int] = {}  # request id -> leading positions whose draft K/V is valid
        self._probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] q of its current drafts (random rows)

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.block_size, self.kv_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.model, num_blocks, self.block_size, self.kv_dtype, self.device)

    def forget(self, finished_ids: list[str], preempted_ids: list[str]) -> None:
        super().forget(finished_ids, preempted_ids)
        for request_id in (*finished_ids, *preempted_ids):  # a preempted request's blocks are gone
            self.num_valid.pop(request_id, None)
            self._probs.pop(request_id, None)

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        return self._probs.get(request_id)

    @torch.inference_mode()
    def _propose(self, chosen: list[tuple[ScheduledRequest, list[int], int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in chosen]
        active = []  # (index in chosen, request, its tokens, block ids, drafts wanted)
        for i, (item, new_tokens, k) in enumerate(chosen):
            request = item.request
            tokens = request.all_token_ids + new_tokens
            # the draft writes K/V up to position len(tokens) + k - 2: only as far as the request's blocks reach
            k = min(k, len(item.block_ids) * self.block_size - len(tokens) + 1)
            self._probs.pop(request.request_id, None)
            if k > 0:
                active.append((i, request, tokens, item.block_ids, k))
        if not active:
            return drafts
        # 1. catch up on unseen tokens; the last position's logits give each request's first draft
        spans = [TokenSpan(tokens[self.num_valid.get(r.request_id, 0):], self.num_valid.get(r.request_id, 0),
                           block_ids, 1) for _, r, tokens, block_ids, _ in active]
        order = sorted(range(len(spans)), key=lambda j: not runs_as_decode(len(spans[j].token_ids)))
        logits = self._forward([spans[j] for j in order])
        logits = logits[torch.argsort(torch.tensor(order))]  # back to `active` order
        for _, r, tokens, _, _ in active:
            self.num_valid[r.request_id] = len(tokens)
        q_rows: dict[str, list[torch.Tensor]] = {}  # random requests: the distribution of each draft
        step_tokens = self._sample([r for _, r, _, _, _ in active], logits, q_rows)
        for (i, *_), token in zip(active, step_tokens):
            drafts[i].append(token)
        # 2. one batched decode per further draft, for the requests that want more
        for step in range(1, max(k for *_, k in active)):
            rows = [entry for entry in active if entry[4] > step]
            spans = [TokenSpan([drafts[i][-1]], len(tokens) + step - 1, block_ids, 1)
                     for i, _, tokens, block_ids, _ in rows]
            step_tokens = self._sample([r for _, r, _, _, _ in rows], self._forward(spans), q_rows)
            for (i, *_), token in zip(rows, step_tokens):
                drafts[i].append(token)
        self._probs.update({request_id: torch.stack(q) for request_id, q in q_rows.items()})
        return drafts

    def _forward(self, spans: list[TokenSpan]) -> torch.Tensor:
        batch = prepare_batch(spans, self.block_size, self.device)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata,
                          batch.logits_indices)

    def _sample(self, requests, logits: torch.Tensor, q_rows: dict[str, list[torch.Tensor]]) -> list[int]:
        """Greedy requests draft the argmax; random ones draw from their own sampling distribution q, appended to
        q_rows for the rejection sampler."""
        meta = SamplingMetadata.build([r.sampling_params for r in requests], {}, [], [], {}, self.device)
        logits, _ = processed_logits(logits, meta)
        greedy_ids = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_ids.tolist()
        probs = sampling_probs(logits, meta)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        is_random = meta.temperature >= SAMPLING_EPS
        for request, row_probs, random_row in zip(requests, probs, is_random.tolist()):
            if random_row:
                q_rows.setdefault(request.request_id, []).append(row_probs)
        return torch.where(is_random, inverse_cdf_sample(probs, {}, self.generator), greedy_ids).tolist()
