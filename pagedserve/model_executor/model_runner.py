"""Owns the model and the KV cache tensors; turns a SchedulerOutput into one flat forward and samples.

The only place that knows tensor layouts: token ids, positions and slot mapping of the flattened batch,
block tables and context lengths for attention, and which rows produce logits.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.kv_transfer.block_io import write_kv_blocks
from pagedserve.lora.model_manager import LoRAModelManager
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.attention.selector import get_attention_backend
from pagedserve.model_executor.cuda_graphs import DecodeGraphs, wants_cuda_graphs
from pagedserve.model_executor.host_allocator import keep_freed_memory
from pagedserve.model_executor.input_batch import TokenSpan, prepare_batch, runs_as_decode
from pagedserve.model_executor.model_loader import allocate_kv_cache, kv_bytes_per_block, load_model
from pagedserve.model_executor.models.registry import is_encoder_only
from pagedserve.model_executor.parallel_state import SINGLE, ParallelState
from pagedserve.model_executor.platform import available_memory, torch_dtype
from pagedserve.model_executor.pooling_runner import PoolingRunner
from pagedserve.model_executor.prompt_logprobs import (
    PromptChunk,
    PromptLogprobRows,
    compute_prompt_logprobs,
    prompt_chunk,
    prompt_logprob_rows,
)
from pagedserve.model_executor.quantization.registry import get_quantization_config
from pagedserve.model_executor.rejection_sampler import DraftBatch, rejection_sample
from pagedserve.model_executor.sampler import LogprobsTensors, Sampler, SamplerOutput, SamplingMetadata
from pagedserve.model_executor.token_controls import bad_word_bans
from pagedserve.outputs import Logprob
from pagedserve.spec_decode.drafter import DrafterContext
from pagedserve.spec_decode.selector import make_drafter

@dataclass
class StepMasks:
    """One step's token masks (structured output). bias: the rows filled up front as a logit bias ([N, >= V]
    float32, row i <-> sampling row i; free rows all 0), or None; checked_rows: the constrained rows to sample
    without a mask first and then check (TokenMaskSource.allows / masks_now)."""
    bias: "Future[torch.Tensor] | None"
    checked_rows: list[int]


class TokenMaskSource(Protocol):
    """Structured output's side of a step (engine/structured_output.py)."""

    matchers: dict  # sequence id -> its grammar's matcher

    def start_masks(self, sequence_ids: list[str], needs_whole_mask: Sequence[bool]) -> StepMasks | None: ...

    def allows(self, sequence_ids: list[str], tokens: list[int]) -> list[bool]: ...

    def masks_now(self, sequence_ids: list[str]) -> torch.Tensor: ...


@dataclass
class ModelRunnerOutput:
    # request id -> its new tokens: the drafts the target accepted, then one token sampled by the target
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)  # one per new token, if asked
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts proposed for the next step
    forward_time: float = 0.0  # the model forward alone (no input prep, no sampling)
    # request id -> (index of the first entry, entries): prompt logprobs of this step's prefill chunk; entry j is
    # the prompt token at position j + 1 (the first prompt token has none)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    # pooling runner: request id -> its output (embedding / class probabilities), for requests whose prompt is done
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StartedStep:
    """A step whose forward ran on this rank (later pipeline stages may still be running it): what sampling needs.
    `logits` is None on a pipeline driver until the last stage's logits arrive (executor/distributed.py)."""
    num_scheduled: int
    sampling_items: list[ScheduledRequest]
    masks: StepMasks | None
    token_masks: TokenMaskSource | None  # its matchers' requests get no drafts
    logits: torch.Tensor | None
    forward_time: float  # this rank's forward alone (no input prep, no sampling)
    prompt_rows: PromptLogprobRows | None = None  # when a prefill chunk asked for prompt logprobs
    pooling_items: list[ScheduledRequest] | None = None  # pooling runner: the step's chunks, `logits` their rows


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelState = SINGLE) -> None:
        """Every rank builds its runner from the engine's config; only the driver's has a drafter."""
        self.model_config = config.model
        self.device = device = torch.device(config.parallel.device)
        self.dtype = torch_dtype(config.model.dtype)
        self.kv_dtype = torch_dtype(config.cache.kv_cache_dtype)  # a bfloat16 cache halves what decode attention reads
        self.block_size = config.cache.block_size
        if device.type == "cpu":
            keep_freed_memory()  # each step's activations reuse the last step's pages (host_allocator.py)
        self.attn_backend = get_attention_backend(config.attention_backend, device)
        self.quant_config = get_quantization_config(config.load.quantization, config.load.linear_backend, device,
                                                    config.model.quantization_config)
        self.model = load_model(self.model_config, device, self.dtype, self.quant_config, self.attn_backend, parallel,
                                pooling=config.pooler is not None)
        self.pooler = PoolingRunner(config.pooler, self.model) if config.pooler is not None else None
        self.causal = not is_encoder_only(config.model.architecture)  # an encoder attends both ways
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=device).manual_seed(config.seed)
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # speculative decoding: proposes each sampling request's next drafts
        self.drafter = make_drafter(config.speculative, DrafterContext(
            device, self.dtype, self.kv_dtype, self.block_size, self.model_config.max_model_len,
            self.model_config.vocab_size, config.seed, self.quant_config, self.attn_backend)) \
            if config.speculative is not None and parallel.is_driver else None
        # CUDA graphs for decode-only steps (cuda_graphs.py)
        self.use_cuda_graphs = wants_cuda_graphs(self.attn_backend, device, config.enforce_eager,
                                                 parallel.layout.world_size) and config.lora is None \
            and self.pooler is None and len(self.model.kv_cache_groups) == 1  # graphs record one group's tables
        # multi-LoRA: the projections wrapped in LoRA layers, adapters in slots (lora/model_manager.py)
        self.lora_manager = LoRAModelManager(self.model, config.lora, device, self.dtype) \
            if config.lora is not None else None
        self.decode_graphs: DecodeGraphs | None = None  # built with the KV cache (graphs record its addresses)

    # ------------------------------------------------------------------ KV cache
    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block in every layer's K and V (a draft model's cache included)."""
        draft = self.drafter.kv_bytes_per_block if self.drafter is not None else 0
        return kv_bytes_per_block(self.model, self.block_size, self.kv_dtype) + draft

    def available_memory(self) -> int:
        return available_memory(self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # a sliding-window group's tables point at the null block (id num_blocks, past the pool) behind the window
        num_blocks += any(g.sliding_window for g in self.model.kv_cache_groups)
        self.kv_caches = allocate_kv_cache(self.model, num_blocks, self.block_size, self.kv_dtype, self.device)
        if self.use_cuda_graphs:
            self.decode_graphs = DecodeGraphs(self.run_model, self.block_size, self.device, self.attn_backend)
        if self.drafter is not None:  # same block ids, its own layers: the block tables serve both
            self.drafter.allocate_kv_cache(num_blocks)

    # ------------------------------------------------------------------ the step
    def execute_model(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> ModelRunnerOutput:
        return self.finish_step(self.start_step(out, token_masks))

    @torch.inference_mode()
    def start_step(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> StartedStep:
        """Inputs and the forward. token_masks (structured output): asked for the sampling rows' token masks (a
        logit bias) before the forward, so that they are computed while the forward runs."""
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(out.finished_request_ids, out.preempted_request_ids)
        if self.pooler is not None:
            self.pooler.forget(out.finished_request_ids + out.preempted_request_ids)
        if out.kv_loads:  # KV connector: blocks loaded from outside the pool, read by this forward
            write_kv_blocks(self.kv_caches, *map(list, zip(*out.kv_loads)))
        # decode rows first: attention batches them together
        items = sorted(out.scheduled, key=lambda s: not runs_as_decode(s.num_new_tokens))
        sampling_items = [item for item in items if item.samples] if self.pooler is None else []
        chunks = [prompt_chunk(item) for item in items]
        spans = self._spans(items, chunks)
        if self.pooler is not None:  # rows of hidden states the pooler reads, not logits
            for span, item in zip(spans, items):
                span.num_logits = self.pooler.num_rows(item)
        batch = prepare_batch(spans, self.block_size, self.device, self.causal)
        if self.pooler is not None:  # a cross-encoder's pair: the second text's token types
            self.pooler.add_token_types(items, batch.input_ids, batch.positions)
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(out.lora_slots, [(item.request.lora_request, len(span.token_ids))
                                                            for item, span in zip(items, spans)], self.device)
        # A speculative batch is verified against masks, so every constrained row's mask comes first there.
        speculative = any(item.spec_token_ids for item in sampling_items)
        masks = token_masks.start_masks([i.request.request_id for i in sampling_items],
                                        [speculative or i.request.sampling_params.truncates for i in sampling_items]) \
            if token_masks is not None and sampling_items else None
        t0 = time.perf_counter()
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            logits = self.decode_graphs.run(batch)
        else:
            logits = self.run_model(batch.input_ids, batch.positions, batch.attn_metadata, batch.logits_indices)
        return StartedStep(len(out.scheduled), sampling_items, masks, token_masks, logits, time.perf_counter() - t0,
                           prompt_logprob_rows(items, spans, chunks, self.device),
                           items if self.pooler is not None else None)

    @torch.inference_mode()
    def finish_step(self, step: StartedStep) -> ModelRunnerOutput:
        """Sampling (and the next drafts) from the step's logits."""
        result = ModelRunnerOutput(forward_time=step.forward_time)
        logits = step.logits
        if step.pooling_items is not None:
            result.pooled = self.pooler.step(step.pooling_items, logits)
            return result
        if step.prompt_rows is not None:
            result.prompt_logprobs = compute_prompt_logprobs(logits, step.prompt_rows.chunks)
            logits = logits[step.prompt_rows.sample_rows]
        if step.sampling_items:
            self._sample(logits, step.sampling_items, result, step.masks, step.token_masks)
            if self.drafter is not None:
                constrained = step.token_masks.matchers if step.token_masks is not None else {}
                result.spec_token_ids = self.drafter.propose(step.sampling_items, result.sampled,
                                                             step.num_scheduled, constrained)
        return result

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  logits_indices: torch.Tensor) -> torch.Tensor | None:
        """The forward over the flat batch (a parallel driver first broadcasts these inputs to its workers)."""
        return self.model(input_ids, positions, self.kv_caches, meta, logits_indices)

    @staticmethod
    def _spans(items: list[ScheduledRequest], chunks: list[PromptChunk | None]) -> list[TokenSpan]:
        spans = []
        for item, chunk in zip(items, chunks):
            r = item.request
            first = r.num_computed_tokens
            # drafts follow the known tokens (num_new_tokens counts them); a sampling span has logits at its last
            # known token and at every draft
            tokens = r.all_token_ids[first:first + item.num_new_tokens] + item.spec_token_ids
            # a chunk asking prompt logprobs has logits at every position (its rows come first, the sample row last)
            spans.append(TokenSpan(tokens, first, item.block_ids,
                                   len(tokens) if chunk is not None else
                                   len(item.spec_token_ids) + 1 if item.samples else 0, item.group_block_ids))
        return spans

    def _sample(self, logits: torch.Tensor, items: list[ScheduledRequest], result: ModelRunnerOutput,
                masks: StepMasks | None = None, token_masks: TokenMaskSource | None = None) -> None:
        """One row of logits per sampling request, or k + 1 for a request with k drafts (verified here)."""
        requests = [item.request for item in items]
        drafts = [item.spec_token_ids for item in items]
        speculative = any(drafts)
        rows = [len(d) + 1 for d in drafts]
        row_requests = [r for r, n in zip(requests, rows) for _ in range(n)] if speculative else requests
        # a verification row after draft tokens sees them as output (bad_words match across them)
        row_drafts = [d[:i] for d, n in zip(drafts, rows) for i in range(n)] if speculative else None
        meta = self._sampling_metadata(row_requests, row_drafts)
        token_mask_bias = masks.bias.result() if masks is not None and masks.bias is not None else None
        if token_mask_bias is not None:  # one mask row per request (constrained requests never draft)
            meta.token_mask_bias = token_mask_bias.repeat_interleave(
                torch.tensor(rows, device=token_mask_bias.device), dim=0) \
                if speculative else token_mask_bias
        logprobs: LogprobsTensors | None
        if speculative:
            draft_probs = [self.drafter.draft_probs(r.request_id) if d else None for r, d in zip(requests, drafts)]
            verified = rejection_sample(logits, meta, DraftBatch(drafts, draft_probs), self.default_generator)
            token_lists, logprobs = verified.token_ids, verified.logprobs
        else:
            out = self.sampler(logits, meta, self.default_generator)
            if masks is not None and masks.checked_rows:
                assert token_masks is not None
                self._resample_rejected(logits, requests, out, masks.checked_rows, token_masks)
            token_lists, logprobs = [[t] for t in out.sampled_token_ids.tolist()], out.logprobs
        for r, tokens in zip(requests, token_lists):
            result.sampled[r.request_id] = tokens
        if logprobs is not None:
            self._collect_logprobs(requests, token_lists, logprobs, result)

    def _resample_rejected(self, logits: torch.Tensor, requests: list, out: SamplerOutput, rows: list[int],
                           token_masks: TokenMaskSource) -> None:
        """Structured output, rows sampled without their masks: a row whose grammar rejects its token samples again
        under its mask. Exact: an allowed argmax is the masked argmax; and a plain random sample (no top-k/p, min-p),
        kept if allowed (set A) and otherwise drawn again from the masked distribution, has probability
        p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A) for every t in A: the masked distribution."""
        sampled = out.sampled_token_ids
        allowed = token_masks.allows([requests[r].request_id for r in rows], sampled[rows].tolist())
        rejected = [r for r, ok in zip(rows, allowed) if not ok]
        if not rejected:
            return
        meta = self._sampling_metadata([requests[r] for r in rejected])
        meta.token_mask_bias = token_masks.masks_now([requests[r].request_id for r in rejected])
        again = self.sampler(logits[rejected], meta, self.default_generator)
        index = torch.tensor(rejected, device=sampled.device)
        sampled[index] = again.sampled_token_ids
        if out.logprobs is not None and again.logprobs is not None:  # raw logprobs: only the sampled token's change
            out.logprobs.sampled_logprobs[index] = again.logprobs.sampled_logprobs
            out.logprobs.sampled_ranks[index] = again.logprobs.sampled_ranks

    def _sampling_metadata(self, row_requests: list, row_drafts: list[list[int]] | None = None) -> SamplingMetadata:
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
            if p.bad_words_token_ids:
                output = list(r.output_token_ids) + row_drafts[row] if row_drafts else r.output_token_ids
                banned[row] = banned.get(row, []) + bad_word_bans(p.bad_words_token_ids, output)
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

