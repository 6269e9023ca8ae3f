"""OutputProcessor: sampled tokens -> RequestOutputs, stop-string decisions and per-request stats.

Used by both the offline engine and the async one (through LLMEngine.step). It owns, per user request, the
n sequences' detokenizers and logprobs, and the request's timings (TTFT, ITL, queue/prefill/decode times);
it never calls into the scheduler: `process_tokens` returns which sequences hit a stop string, and the engine
finishes them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.request import Request, RequestStatus
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.metrics.loggers import FinishedRequestStats
from pagedserve.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                                RequestOutput)
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import RequestOutputKind

logger = logging.getLogger("pagedserve")


@dataclass
class _Sample:
    """Output state of one of the n sequences of a user request."""
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None with detokenize=False: token ids only, text stays ""
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0  # for DELTA outputs
    num_sent_logprobs: int = 0


@dataclass
class _UserRequest:
    processed: ProcessedRequest
    samples: list[_Sample]
    metrics: RequestMetrics
    progressed: set[int] = field(default_factory=set)  # sample indices with news this step
    prompt_logprobs: list[dict[int, Logprob]] | None = None  # entries for prompt tokens 1.. (when asked)
    sent_prompt_logprobs: bool = False  # DELTA outputs carry them once
    pooled: Any = None  # a pooling request's output tensor, once its prompt has run

    @property
    def request_id(self) -> str:
        return self.processed.request_id


@dataclass
class RequestStatsDelta:
    """Per-request latencies observed in one step (the metrics layer turns them into histograms)."""
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _UserRequest] = {}
        self._sequences: dict[str, tuple[_UserRequest, _Sample]] = {}  # sequence id -> its user request
        self.stats = RequestStatsDelta()  # accumulated until the engine takes it

    # ------------------------------------------------------------------------------ bookkeeping
    def add_request(self, processed: ProcessedRequest, sequences: list[Request]) -> None:
        params = processed.params
        metrics = RequestMetrics(processed.arrival_time, num_prompt_tokens=len(processed.prompt_token_ids))
        if isinstance(params, PoolingParams):
            user = _UserRequest(processed, [_Sample(seq, None, None) for seq in sequences], metrics)
        else:
            samples = [_Sample(seq, IncrementalDetokenizer(self.tokenizer, processed.prompt_token_ids, params)
                               if params.detokenize else None,
                               [] if params.logprobs is not None else None) for seq in sequences]
            user = _UserRequest(processed, samples, metrics,
                                prompt_logprobs=[] if params.prompt_logprobs is not None else None)
        self.requests[processed.request_id] = user
        for sample in user.samples:
            self._sequences[sample.request.request_id] = (user, sample)

    def sequence_ids(self, request_id: str) -> list[str]:
        user = self.requests.get(request_id)
        return [s.request.request_id for s in user.samples] if user is not None else []

    def user_request_ids(self, sequence_ids: list[str]) -> list[str]:
        """The user requests these sequences belong to, in first-seen order."""
        ids = (self._sequences[sid][0].request_id for sid in sequence_ids if sid in self._sequences)
        return list(dict.fromkeys(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_stats(self) -> RequestStatsDelta:
        stats, self.stats = self.stats, RequestStatsDelta()
        return stats

    # ------------------------------------------------------------------------------ a step's tokens
    def process_prompt_logprobs(self, chunks: dict[str, tuple[int, list[dict[int, Logprob]]]]) -> None:
        """Append each prefill chunk's prompt logprobs; entries seen already (a prefill computed again after a
        preemption) are skipped."""
        for seq_id, (start, entries) in chunks.items():
            user, sample = self._sequences.get(seq_id, (None, None))
            if user is None or user.prompt_logprobs is None or start > len(user.prompt_logprobs):
                continue
            new = entries[len(user.prompt_logprobs) - start:]
            if sample.detokenizer is not None:
                for entry in new:
                    for tid, lp in entry.items():
                        lp.decoded_token = self.tokenizer.decode([tid])
            user.prompt_logprobs.extend(new)

    def process_tokens(self, progressed: list[tuple[Request, int]],
                       logprobs: dict[str, list[dict[int, Logprob]]],
                       now: float) -> tuple[list[str], dict[str, str]]:
        """Record each sequence's new tokens (several when drafts were accepted). Returns (sequences that completed
        a stop string and are still running: the engine finishes them; user requests whose output processing
        failed: id -> message). A stop string completed before the last new token drops the tokens after it, so
        the output ends exactly where it would have without speculation."""
        to_stop: list[str] = []
        failed: dict[str, str] = {}
        touched: dict[str, _UserRequest] = {}
        for request, num_new in progressed:
            user, sample = self._sequences[request.request_id]
            if user.request_id in failed:
                continue
            new_tokens = request.all_token_ids[-num_new:]
            token_logprobs = logprobs.get(request.request_id) or [None] * num_new
            stop = None
            try:
                for i, (token, lp) in enumerate(zip(new_tokens, token_logprobs)):
                    stop = self._record_token(user, sample, token, lp, is_last=i == num_new - 1)
                    if stop is not None:
                        del request.all_token_ids[len(request.all_token_ids) - num_new + i + 1:]
                        break
            except Exception as exc:  # e.g. a tokenizer error on one request: fail it alone
                logger.exception("output processing failed for request %s", user.request_id)
                failed[user.request_id] = f"output processing failed: {type(exc).__name__}: {exc}"
                continue
            if stop is not None:
                request.stop_reason = stop
                if request.is_finished:
                    # The last allowed token completed a stop string: that is a stop, not a length cap.
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    to_stop.append(request.request_id)
            touched[user.request_id] = user
        for user in touched.values():
            m = user.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                m.first_scheduled_time = min(s.request.first_scheduled_time or now for s in user.samples)
                m.num_cached_tokens = max(max(s.request.num_cached_tokens for s in user.samples), 0)
                self.stats.ttfts.append(now - m.arrival_time)
            else:
                self.stats.itls.append(now - m.last_token_time)
            m.last_token_time = now
        return to_stop, failed

    def _record_token(self, user: _UserRequest, sample: _Sample, token: int,
                      logprobs: dict[int, Logprob] | None, is_last: bool) -> str | None:
        request = sample.request
        user.metrics.num_generation_tokens += 1
        if logprobs is not None and sample.logprobs is not None:
            if sample.detokenizer is not None:
                for tid, lp in logprobs.items():
                    lp.decoded_token = self.tokenizer.decode([tid])
            sample.logprobs.append(logprobs)
            sample.cumulative_logprob += logprobs[token].logprob
        user.progressed.add(request.sample_index)
        # A stop token's text is not part of the output (as in vLLM), unless asked for.
        # (only the last of a step's tokens can be the one that stopped the request)
        stopped_by_token = is_last and (request.status == RequestStatus.FINISHED_STOPPED
                                        and request.stop_reason is None or isinstance(request.stop_reason, int))
        if stopped_by_token and not user.processed.params.include_stop_str_in_output:
            return None
        return sample.detokenizer.update([token]) if sample.detokenizer is not None else None

    def process_pooled(self, pooled: dict[str, Any], now: float) -> list[str]:
        """Record pooling requests' outputs (their prompt has run: the first and last "token" at once); returns
        their ids, for the engine to finish."""
        done = []
        for seq_id, data in pooled.items():
            user, _ = self._sequences.get(seq_id, (None, None))
            if user is None:  # aborted while the step ran
                continue
            user.pooled = data
            user.progressed.add(0)
            m = user.metrics
            m.first_scheduled_time = min(s.request.first_scheduled_time or now for s in user.samples)
            m.first_token_time = m.last_token_time = now
            m.num_cached_tokens = max(user.samples[0].request.num_cached_tokens, 0)
            self.stats.ttfts.append(now - m.arrival_time)
            done.append(seq_id)
        return done

    # ------------------------------------------------------------------------------ outputs
    def make_outputs(self, now: float) -> list[RequestOutput | PoolingRequestOutput]:
        """One output per user request with news (or, for FINAL_ONLY, once finished)."""
        outputs = []
        for user in [u for u in self.requests.values() if u.progressed]:
            out = self._make_output(user, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _make_output(self, user: _UserRequest, now: float) -> RequestOutput | PoolingRequestOutput | None:
        kind = user.processed.params.output_kind
        finished = all(s.request.is_finished for s in user.samples)
        if isinstance(user.processed.params, PoolingParams):
            user.progressed.clear()
            if finished:
                self._finish(user, now)
            return self._pooling_output(user, finished)
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            user.progressed.clear()
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = [self._completion(s, delta) for s in user.samples
                       if not delta or s.request.sample_index in user.progressed]
        user.progressed.clear()
        if finished:
            self._finish(user, now)
        p = user.processed
        prompt_logprobs = None
        if user.prompt_logprobs is not None and not (delta and user.sent_prompt_logprobs):
            prompt_logprobs = [None, *user.prompt_logprobs]
            user.sent_prompt_logprobs = True
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, completions, finished, user.metrics,
                             user.metrics.num_cached_tokens, prompt_logprobs)

    @staticmethod
    def _completion(sample: _Sample, delta: bool) -> CompletionOutput:
        r = sample.request
        text = sample.detokenizer.get_next_output_text(r.is_finished, delta) if sample.detokenizer is not None else ""
        output_ids = r.output_token_ids
        logprobs = sample.logprobs
        if delta:
            output_ids = output_ids[sample.num_sent_tokens:]
            if logprobs is not None:
                logprobs = logprobs[sample.num_sent_logprobs:]
        sample.num_sent_tokens = r.num_output_tokens
        sample.num_sent_logprobs = len(sample.logprobs or ())
        return CompletionOutput(
            index=r.sample_index, text=text, token_ids=output_ids,
            cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
            logprobs=logprobs, finish_reason=r.status.finish_reason, stop_reason=r.stop_reason)

    def abort(self, request_id: str, now: float) -> None:
        """The request was aborted (its sequences are already finished in the scheduler): record its stats."""
        user = self.requests.get(request_id)
        if user is not None:
            self._finish(user, now)

    def fail(self, request_ids: list[str], message: str, now: float) -> list[RequestOutput]:
        """The engine failed these requests: a final output each, with `error` set."""
        outputs = []
        for rid in request_ids:
            user = self.requests.get(rid)
            if user is None:
                continue
            if isinstance(user.processed.params, PoolingParams):
                self._finish(user, now)
                outputs.append(self._pooling_output(user, True, message))
                continue
            completions = [self._completion(s, user.processed.params.output_kind == RequestOutputKind.DELTA)
                           for s in user.samples]
            self._finish(user, now)
            p = user.processed
            outputs.append(RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, completions, True,
                                         user.metrics, user.metrics.num_cached_tokens, error=message))
        return outputs

    @staticmethod
    def _pooling_output(user: _UserRequest, finished: bool, error: str | None = None) -> PoolingRequestOutput:
        p = user.processed
        return PoolingRequestOutput(p.request_id, PoolingOutput(user.pooled), p.prompt_token_ids, finished, p.prompt,
                                    user.metrics, error)

    def _finish(self, user: _UserRequest, now: float) -> None:
        m = user.metrics
        m.finished_time = now
        del self.requests[user.request_id]
        for sample in user.samples:
            self._sequences.pop(sample.request.request_id, None)
        self.stats.finished.append(self._finished_stats(user, now))

    @staticmethod
    def _finished_stats(user: _UserRequest, now: float) -> FinishedRequestStats:
        m = user.metrics
        reasons = [s.request.status.finish_reason or "abort" for s in user.samples]
        queue = prefill = decode = inference = tpot = None
        if m.first_scheduled_time is not None:
            queue = max(0.0, m.first_scheduled_time - m.arrival_time)
            inference = max(0.0, (m.last_token_time or now) - m.first_scheduled_time)
            if m.first_token_time is not None:
                prefill = max(0.0, m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = max(0.0, m.last_token_time - m.first_token_time)
            per_seq = max(s.request.num_output_tokens for s in user.samples)
            if per_seq > 1:
                tpot = decode / (per_seq - 1)
        return FinishedRequestStats(
            finish_reasons=reasons, e2e_latency=max(0.0, now - m.arrival_time),
            num_prompt_tokens=m.num_prompt_tokens,
            num_generation_tokens=sum(s.request.num_output_tokens for s in user.samples), queue_time=queue,
            prefill_time=prefill, decode_time=decode, inference_time=inference, mean_time_per_output_token=tpot,
            num_cached_tokens=m.num_cached_tokens, n=len(user.samples), max_tokens=user.processed.max_tokens)
