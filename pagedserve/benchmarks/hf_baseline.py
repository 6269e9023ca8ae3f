"""External baselines: Hugging Face transformers `generate`, one request at a time and in static padded
batches (left-padded to the longest prompt, every sequence decodes until the batch's longest output), and
transformers' own continuous batching (`model.init_continuous_batching()`, see run_hf_continuous).

Token times come from a StoppingCriteria that stamps the clock after every generated token, so TTFT and
ITL are measured the same way as for the engine (time the token exists on the host).  KV waste is the
padded contiguous cache's: slots held for padding and for sequences that already finished, over all
slots held, per decode step.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Sequence

from pagedserve.benchmarks.datasets import SampleRequest
from pagedserve.benchmarks.driver import ReqTiming, StepRecord, TraceResult


def load_hf_model(model_dir: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype,
                                                                                                   torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model.eval()
    if torch.cuda.is_available():
        model.to("cuda")
    return model


def run_hf(model, samples: Sequence[SampleRequest], name: str, batch_size: int,
           arrivals: Sequence[float] | None = None, max_model_len: int = 2048, pad_token_id: int = 0,
           pbar=None) -> TraceResult:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    device = next(model.parameters()).device
    arrivals = list(arrivals) if arrivals is not None else [0.0] * len(samples)
    pending = deque(sorted(range(len(samples)), key=lambda i: arrivals[i]))
    timings: list[ReqTiming] = []
    steps: list[StepRecord] = []
    t0 = time.perf_counter()

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - t0)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    # warm-up outside the clock
    with torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7, 8]], device=device), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=pad_token_id)

    while pending:
        now = time.perf_counter() - t0
        if arrivals[pending[0]] > now:
            time.sleep(arrivals[pending[0]] - now)
            now = time.perf_counter() - t0
        batch = []
        while pending and arrivals[pending[0]] <= now and len(batch) < batch_size:
            batch.append(pending.popleft())
        lens = [samples[i].prompt_len for i in batch]
        outs = [samples[i].expected_output_len for i in batch]
        lp, T = max(lens), max(outs)
        ids = torch.full((len(batch), lp), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), lp), dtype=torch.long)
        for row, i in enumerate(batch):
            p = list(samples[i].prompt)
            ids[row, lp - len(p):] = torch.tensor(p)
            mask[row, lp - len(p):] = 1
        clock = Clock()
        start = time.perf_counter() - t0
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=T, min_new_tokens=T,
                           do_sample=False, pad_token_id=pad_token_id,
                           stopping_criteria=StoppingCriteriaList([clock]))
        times = clock.times
        for row, i in enumerate(batch):
            s = samples[i]
            timings.append(ReqTiming(s.request_id or f"req-{i}", s.prompt_len, s.expected_output_len, arrivals[i],
                                     token_times=times[:s.expected_output_len]))
            if pbar is not None:
                pbar.update(1)
        prev = start
        for k, t in enumerate(times):  # step k produced token k+1 of every row
            active = [r for r in range(len(batch)) if k < outs[r]]
            held = len(batch) * (lp + k + 1)
            useful = sum(lens[r] + k + 1 for r in active)
            steps.append(StepRecord(
                t_start=prev, t_end=t, scheduled_tokens=len(batch) * (lp if k == 0 else 1),
                prompt_tokens=len(batch) * lp if k == 0 else 0, decode_tokens=0 if k == 0 else len(batch),
                num_reqs=len(batch), budget=len(batch) * lp if k == 0 else len(batch), running=len(batch),
                waiting=len(pending), used_blocks=0, num_blocks=0, stored_tokens=useful, allocated_slots=held,
                per_request_tokens=useful, exact_reservation=sum(lens[r] + outs[r] for r in range(len(batch))),
                forward_time=t - prev, step_time=t - prev))
            prev = t
    makespan = time.perf_counter() - t0
    return TraceResult(name, timings, steps, makespan, max_model_len,
                       notes=f"transformers generate, static padded batches of {batch_size}")


def cb_num_blocks(samples: Sequence[SampleRequest], concurrency: int, page_size: int,
                  safety_margin: float = 0.15) -> int:
    """KV blocks (of `page_size` tokens, all layers) for `concurrency` of the workload's longest requests in flight at
    once, with one spare block each, grown so that the scheduler's safety margin (it admits at most one new prefill
    per step once less than `safety_margin` of the cache is free; 0.15 for the FIFO scheduler) never binds: no
    request is ever offloaded or held back for lack of KV."""
    longest = max(s.prompt_len + s.expected_output_len for s in samples)
    per_request = math.ceil(longest / page_size) + 1
    return math.ceil(concurrency * per_request / (1.0 - safety_margin)) + 1


def run_hf_continuous(model, samples: Sequence[SampleRequest], concurrency: int | None = None,
                      name: str = "hf-cb", arrivals: Sequence[float] | None = None, max_batch_tokens: int = 2048,
                      num_blocks: int | None = None, page_size: int | None = None, max_model_len: int = 2048,
                      request_timeout: float = 600.0, pbar=None) -> TraceResult:
    """The workload through transformers' continuous batching (`model.init_continuous_batching()` ->
    ContinuousBatchingManager, its background generation thread, paged KV cache and FIFO scheduler with chunked
    prefill), closed loop at `concurrency`: C requests are submitted (`add_request(..., streaming=True)`), and each
    time one finishes (its final output comes out of `get_result`) the next one is submitted, as
    `pagedserve bench serve --max-concurrency C --request-rate inf` does.  The manager admits requests while it runs,
    so the closed loop is real.  With `arrivals` (seconds after the start) a request is also not submitted before its
    arrival time and its TTFT counts from that time (open loop, capped at `concurrency` in flight; None = no cap).

    Same workload as run_hf: prompt token ids, greedy (`do_sample=False`), exactly `expected_output_len` tokens
    (`max_new_tokens` per request, `eos_token_id=-1`, which disables EOS for the request; None would fall back to the
    generation config's EOS).  As with `ignore_eos` in pagedserve / vLLM, EOS is not masked: it can be
    generated and decoding goes on after it (run_hf's `min_new_tokens` masks the EOS logit instead, so its greedy
    tokens can differ; the reference for these is `generate(..., eos_token_id=None)`).  Token times: the manager's
    own per-token stamps (`record_timestamps=True`:
    time.perf_counter() in the generation thread when the sampled token is on the host and appended to the request,
    the same moment the StoppingCriteria clock of run_hf stamps), against the same clock as the submission times;
    where a version of transformers gives no stamps, the time the streamed output is taken off the manager's queue.
    TTFT = first token - submission (or arrival), ITL = gaps between tokens.

    Attention: whatever the model was loaded with, as transformers' CB keeps it: "sdpa" (the default on CPU) stays
    "sdpa" (a block-diagonal mask over the batch's concatenated keys/values gathered from the paged cache),
    "eager" becomes "paged|eager", flash implementations need CUDA.  The manager restores the original
    implementation when it stops.  KV: `num_blocks` blocks of `page_size` tokens (default: cb_num_blocks, enough for C
    of the longest requests; page size: transformers' default), `max_batch_tokens` tokens per forward (prefill chunk
    budget; 2048 = pagedserve's default --max-num-batched-tokens), `max_requests_per_batch` = C.  Sized explicitly
    because on CPU transformers would otherwise claim 60% of the machine's RAM for the cache.

    No StepRecords (the manager does not expose per-step stats), so the TraceResult's KV-waste fields are zero.
    The manager is always stopped (a hard stop on error, so in-flight requests do not keep it running).
    """
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    n = len(samples)
    if n == 0:
        return TraceResult(name, [], [], 0.0, max_model_len, notes="no requests")
    conc = n if concurrency is None else max(1, min(int(concurrency), n))
    defaults = ContinuousBatchingConfig()
    page_field = "page_size" if hasattr(defaults, "page_size") else "block_size"  # page_size since transformers 5.18
    cb_kwargs = {} if page_size is None else {page_field: int(page_size)}
    page = cb_kwargs.get(page_field, getattr(defaults, page_field))
    if num_blocks is None:
        num_blocks = cb_num_blocks(samples, conc, page)
    cb_config = ContinuousBatchingConfig(num_blocks=int(num_blocks), max_batch_tokens=int(max_batch_tokens),
                                         max_requests_per_batch=conc, **cb_kwargs)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(s.expected_output_len
                                                                                        for s in samples))
    arrivals = list(arrivals) if arrivals is not None else None
    order = sorted(range(n), key=lambda i: arrivals[i]) if arrivals is not None else list(range(n))
    pending = deque(order)
    rid_of = {i: f"hfcb-{i}" for i in range(n)}
    idx_of = {r: i for i, r in rid_of.items()}
    submitted: dict[int, float] = {}
    engine_times: dict[int, list[float]] = {}
    client_times: dict[int, list[float]] = {i: [] for i in range(n)}
    tokens: dict[int, list[int]] = {}
    in_flight: set[int] = set()

    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    attn = model.config._attn_implementation
    ok = False
    try:
        manager.warmup()  # a no-op unless CUDA graphs / compile are on
        manager.start()

        def next_result(deadline: float):
            while True:
                res = manager.get_result(timeout=0.05)
                if res is not None:
                    return res
                fatal = manager.background_thread_status.fatal_error
                if fatal is not None or not manager.is_running():
                    raise RuntimeError(f"transformers continuous batching: generation thread stopped ({fatal!r})")
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"transformers continuous batching: no output for {request_timeout:.0f} s")

        # warm-up outside the clock (first forward, allocator, thread start)
        manager.add_request([5, 6, 7, 8], request_id="hfcb-warmup", max_new_tokens=2, streaming=False,
                            eos_token_id=-1)
        while True:
            res = next_result(time.perf_counter() + request_timeout)
            if res.request_id == "hfcb-warmup" and res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"transformers continuous batching warm-up failed: {res.error}")
                break

        t0 = time.perf_counter()

        def submit_ready() -> None:
            now = time.perf_counter() - t0
            while pending and len(in_flight) < conc and (arrivals is None or arrivals[pending[0]] <= now):
                i = pending.popleft()
                s = samples[i]
                t_sub = time.perf_counter() - t0
                rid = manager.add_request(list(s.prompt), request_id=rid_of[i], max_new_tokens=s.expected_output_len,
                                          streaming=True, record_timestamps=True, eos_token_id=-1)
                if rid is None:
                    raise RuntimeError("transformers continuous batching refused a request (manager stopping)")
                submitted[i] = t_sub if arrivals is None else arrivals[i]
                in_flight.add(i)
                now = time.perf_counter() - t0

        submit_ready()
        while pending or in_flight:
            if not in_flight:  # open loop: idle until the next arrival
                time.sleep(max(0.0, arrivals[pending[0]] - (time.perf_counter() - t0)))
                submit_ready()
                continue
            res = next_result(time.perf_counter() + request_timeout)
            t_host = time.perf_counter() - t0
            i = idx_of.get(res.request_id)
            if i is None:
                continue
            if res.error is not None:
                raise RuntimeError(f"transformers continuous batching: request {res.request_id} failed: {res.error}")
            got = len(res.generated_tokens)
            client_times[i].extend([t_host] * (got - len(client_times[i])))
            if res.is_finished():
                tokens[i] = list(res.generated_tokens)
                engine_times[i] = [t - t0 for t in (res.timestamps or [])]
                in_flight.discard(i)
                if pbar is not None:
                    pbar.update(1)
            submit_ready()
        makespan = time.perf_counter() - t0
        ok = True
    finally:
        try:
            manager.stop(block=True, hard_stop=not ok)
        finally:
            manager.destroy()

    timings: list[ReqTiming] = []
    lags = []
    for i, s in enumerate(samples):
        out = len(tokens.get(i, []))
        eng = engine_times.get(i, [])
        times = eng[:out] if len(eng) >= out else client_times[i][:out]
        lags += [c - e for c, e in zip(client_times[i], eng)]
        timings.append(ReqTiming(s.request_id or f"req-{i}", s.prompt_len, s.expected_output_len, submitted.get(i, 0.0),
                                 token_times=times))
    result = TraceResult(name, timings, [], makespan, max_model_len,
                         notes=(f"transformers continuous batching, closed loop C={conc}, attn {attn}, "
                                f"{num_blocks} KV blocks x {page} tokens, max_batch_tokens {max_batch_tokens}"
                                + (f", client lag p50 {1000 * sorted(lags)[len(lags) // 2]:.2f} ms" if lags else "")))
    result.output_tokens = [tokens.get(i, []) for i in range(n)]  # generated ids per sample, for correctness checks
    return result
