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

from pagedserve.config import SpeculativeConfig
from pagedserve.core.scheduler import ScheduledRequest
from pagedserve.model_executor.input_batch import TokenSpan, prepare_batch, runs_as_decode
from pagedserve.model_executor.model_config import ModelConfig, resolve_model_dir
from pagedserve.model_executor.sampler import (SamplingMetadata, inverse_cdf_sample, processed_logits,
                                               sampling_probs)
from pagedserve.spec_decode.drafter import Drafter


class DraftModelDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, runner) -> None:
        from pagedserve.model_executor.model_runner import load_model

        super().__init__(config, runner.config.max_model_len)
        self.num_lookahead_tokens = config.num_speculative_tokens
        cfg = ModelConfig.from_dir(resolve_model_dir(config.model))
        if cfg.vocab_size != runner.config.vocab_size:
            raise ValueError(f"speculative_config.model has a vocabulary of {cfg.vocab_size} tokens, the target "
                             f"{runner.config.vocab_size}: a draft model must share the target's tokenizer.")
        if cfg.max_position_embeddings < runner.config.max_model_len:
            raise ValueError(f"speculative_config.model supports {cfg.max_position_embeddings} positions, fewer than "
                             f"max_model_len={runner.config.max_model_len}.")
        cfg.max_model_len = runner.config.max_model_len
        self.model_config = cfg
        self.device = runner.device
        self.kv_dtype = runner.kv_dtype
        self.block_size = runner.block_size
        self.model = load_model(cfg, runner.device, runner.dtype, runner.linear_backend)
        self.generator = torch.Generator(device=runner.device).manual_seed(runner.default_generator.initial_seed())
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_valid: dict[str, int] = {}  # request id -> leading positions whose draft K/V is valid
        self._probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] q of its current drafts (random rows)

    @property
    def kv_bytes_per_block(self) -> int:
        from pagedserve.model_executor.model_runner import kv_bytes_per_block

        return kv_bytes_per_block(self.model, self.block_size, self.kv_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        from pagedserve.model_executor.model_runner import allocate_kv_cache

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
        probs_per_step: list[torch.Tensor | None] = []
        step_tokens = self._sample([r for _, r, _, _, _ in active], logits, probs_per_step)
        for (i, *_), token in zip(active, step_tokens):
            drafts[i].append(token)
        # 2. one batched decode per further draft, for the requests that want more
        for step in range(1, max(k for *_, k in active)):
            rows = [j for j, entry in enumerate(active) if entry[4] > step]
            spans = [TokenSpan([drafts[active[j][0]][-1]], len(active[j][2]) + step - 1, active[j][3], 1)
                     for j in rows]
            logits = self._forward(spans)
            step_tokens = self._sample([active[j][1] for j in rows], logits, probs_per_step, rows)
            for j, token in zip(rows, step_tokens):
                drafts[active[j][0]].append(token)
        self._keep_probs(active, probs_per_step)
        return drafts

    def _forward(self, spans: list[TokenSpan]) -> torch.Tensor:
        batch = prepare_batch(spans, self.block_size, self.device)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata,
                          batch.logits_indices)

    def _sample(self, requests, logits: torch.Tensor, probs_per_step: list, rows: list[int] | None = None) -> list[int]:
        """Greedy requests draft the argmax; random ones draw from their own sampling distribution q (kept for
        the rejection sampler)."""
        meta = SamplingMetadata.build([r.sampling_params for r in requests], {}, [], [], {}, self.device)
        logits, _ = processed_logits(logits, meta)
        if meta.all_greedy:
            probs_per_step.append(None)
            return logits.argmax(dim=-1).tolist()
        probs = sampling_probs(logits, meta)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        tokens = torch.where(meta.temperature < 1e-5, logits.argmax(dim=-1),
                             inverse_cdf_sample(probs, {}, self.generator))
        probs_per_step.append((rows, probs, (meta.temperature >= 1e-5).tolist()))
        return tokens.tolist()

    def _keep_probs(self, active, probs_per_step: list) -> None:
        """q per random request, one row per draft, for the next step's verification."""
        per_request: dict[int, list[torch.Tensor]] = {}
        for entry in probs_per_step:
            if entry is None:
                continue
            rows, probs, is_random = entry
            rows = rows if rows is not None else list(range(len(active)))
            for row, j in enumerate(rows):
                if is_random[row]:
                    per_request.setdefault(j, []).append(probs[row])
        for j, rows in per_request.items():
            self._probs[active[j][1].request_id] = torch.stack(rows)
