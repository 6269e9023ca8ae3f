"""External baselines: Hugging Face transformers `generate`, one request at a time and in static padded
batches (left-padded to the longest prompt, every sequence decodes until the batch's longest output).

Token times come from a StoppingCriteria that stamps the clock after every generated token, so TTFT and
ITL are measured the same way as for the engine (time the token exists on the host).  KV waste is the
padded contiguous cache's: slots held for padding and for sequences that already finished, over all
slots held, per decode step.
"""
from __future__ import annotations

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
