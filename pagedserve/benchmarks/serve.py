"""`pagedserve bench serve`: load-test any OpenAI-compatible server, the way `vllm bench serve` does.

Requests arrive by a gamma process (``--request-rate`` per second, ``--burstiness`` 1.0 =
Poisson, ``inf`` = all at once), optionally capped by ``--max-concurrency``.  Each request is a
streaming completion with a token-id prompt (``"prompt": [ids]``), ``max_tokens`` = the
sample's output length, ``ignore_eos`` and ``stream_options.include_usage``.  The client
records TTFT, the gap between consecutive chunks (ITL) and E2E; TPOT and goodput come from
those (see metrics.py).  The printed block and the saved JSON use vLLM's labels and keys, so
results can be compared with `vllm bench serve` runs line by line.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from datetime import datetime
from typing import Any, AsyncIterator

import numpy as np

from pagedserve import envs
from pagedserve.benchmarks import datasets as ds
from pagedserve.benchmarks.metrics import (METRIC_HEADERS, RequestOutcome, calculate_metrics, format_result,
                                           parse_goodput, result_dict)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                   help="openai: /v1/completions with token-id prompts; openai-chat: chat messages (text)")
    p.add_argument("--label", default=None, help="prefix of the result file name (default: the backend)")
    p.add_argument("--base-url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 (overrides host/port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default /v1/completions (/v1/chat/completions for openai-chat)")
    p.add_argument("--model", default=None, help="model name to send (default: the first one of GET /v1/models)")
    p.add_argument("--served-model-name", default=None, help="name sent in requests when it differs from --model")
    ds.add_dataset_args(p, default_dataset="random", default_num_prompts=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 more uniform")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--structured-output", choices=sorted(STRUCTURED_OUTPUT_BODIES), default=None,
                   help="constrain every request: json_schema (response_format with an array schema that cannot "
                        "be complete before max_tokens, so lengths match the unconstrained run), regex or choice "
                        "(vLLM's structured_outputs; these end early)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma list of ttft,tpot,itl,e2el to print percentiles for")
    p.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ready-check-timeout-sec", type=int, default=600,
                   help="retry the first request this long while the server starts (0: no check)")
    p.add_argument("--request-timeout", type=float, default=6 * 3600)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--http-client", choices=HTTP_CLIENTS, default="httpx",
                   help="the client's HTTP library: httpx, or aiohttp (what vLLM's benchmark uses; about half "
                        "httpx's CPU per streamed chunk, which matters when the client shares the server's cores)")


# ---------------------------------------------------------------------------------------
# one request

HTTP_CLIENTS = ("httpx", "aiohttp")


def _is_aiohttp(client) -> bool:
    return type(client).__module__.startswith("aiohttp")


@contextlib.asynccontextmanager
async def _post_stream(client, url: str, body: dict[str, Any]):
    """POST with a streamed answer, either library: yields (status, read the whole body, async iterator of lines)."""
    if _is_aiohttp(client):
        async with client.post(url, json=body) as resp:
            yield resp.status, resp.read, (raw.decode() async for raw in resp.content)
    else:
        async with client.stream("POST", url, json=body) as resp:
            yield resp.status_code, resp.aread, resp.aiter_lines()

# What --structured-output adds to each request body.
STRUCTURED_OUTPUT_BODIES: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": {
        "type": "array", "minItems": 10000, "items": {
            "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 8}},
            "required": ["id", "tag"], "additionalProperties": False}}}}},
    "regex": {"structured_outputs": {"regex": "[a-z ]{1,200}\\.[0-9]{1,8}"}},
    "choice": {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
}


def _payload(backend: str, model: str, sample: ds.SampleRequest, ignore_eos: bool, temperature: float,
             tokenizer=None, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        **(extra_body or {}),
        "model": model,
        "max_tokens": sample.expected_output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if backend == "openai-chat":
        text = sample.prompt
        if not isinstance(text, str):
            text = tokenizer.decode(text) if tokenizer is not None else " ".join(map(str, text))
        body["messages"] = [{"role": "user", "content": text}]
        body["max_completion_tokens"] = sample.expected_output_len
    else:
        body["prompt"] = sample.prompt
    return body


async def send_request(client, api_url: str, body: dict[str, Any], prompt_len: int,
                       chat: bool = False) -> RequestOutcome:
    out = RequestOutcome(prompt_len=prompt_len)
    chunks = 0
    text_parts: list[str] = []
    st = time.perf_counter()
    out.start_time = st
    last = end = st
    try:
        async with _post_stream(client, api_url, body) as (status, read, lines):
            if status != 200:
                out.error = f"HTTP {status}: {(await read()).decode(errors='replace')[:500]}"
                return out
            async for line in lines:
                line = line.strip()
                if not line or line.startswith(":"):
                    continue
                data_str = line.removeprefix("data:").strip()
                if data_str == "[DONE]":
                    continue
                data = json.loads(data_str)
                if "error" in data and not data.get("choices"):
                    out.error = json.dumps(data["error"])[:500]
                    return out
                if choices := data.get("choices"):
                    now = time.perf_counter()
                    c = choices[0]
                    piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    end = now
                    # an empty closing chunk (llama-server sends one) carries no token: not an ITL sample
                    if piece or not c.get("finish_reason") or not chunks:
                        if chunks == 0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        chunks += 1
                        text_parts.append(piece or "")
                if usage := data.get("usage"):
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
        out.latency = end - st
        out.generated_text = "".join(text_parts)
        if not out.output_tokens:
            out.output_tokens = chunks
        out.success = chunks > 0
        if not out.success:
            out.error = "no streamed chunks"
    except Exception as exc:  # connection refused, timeouts, bad JSON: a failed request, not a crash
        out.error = f"{type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------------------------------
# arrivals


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent (gamma inter-arrivals, rescaled so the
    last one lands at n / rate, as vLLM does to keep runs with different seeds comparable)."""
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if request_rate == float("inf") or n == 0:
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError("request_rate must be > 0")
    rng = np.random.default_rng(seed)
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    t = np.cumsum(gaps)
    if t[-1] > 0:
        t *= (n / request_rate) / t[-1]
    return t.tolist()


async def _arrivals(samples, offsets) -> AsyncIterator[ds.SampleRequest]:
    start = time.perf_counter()
    for s, off in zip(samples, offsets):
        delay = start + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield s


# ---------------------------------------------------------------------------------------


async def get_first_model(client, base_url: str) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    if _is_aiohttp(client):
        async with client.get(url) as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]
    r = await client.get(url)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def wait_until_ready(client, api_url: str, body: dict, prompt_len: int, chat: bool, timeout_s: float) -> RequestOutcome:
    deadline = time.perf_counter() + timeout_s
    while True:
        out = await send_request(client, api_url, body, prompt_len, chat)
        if out.success or time.perf_counter() > deadline:
            return out
        if out.error and not any(k in out.error for k in ("Connect", "Remote", "ReadError", "Disconnected", "HTTP 503")):
            return out  # the server answered with a real error: don't keep retrying
        await asyncio.sleep(1.0)


def _client(http_client: str, max_concurrency: int | None, request_timeout: float, headers: dict | None):
    """The HTTP client session (an async context manager): one connection per concurrent request, kept alive."""
    if http_client == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
        timeout = aiohttp.ClientTimeout(total=request_timeout, connect=30.0)
        return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)
    if http_client != "httpx":
        raise ValueError(f"http_client: want one of {HTTP_CLIENTS}, got {http_client!r}")
    import httpx

    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=max_concurrency or None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout, connect=30.0), headers=headers)


async def benchmark(*, base_url: str, api_url: str, backend: str, model: str | None, samples: list[ds.SampleRequest],
                    request_rate: float = float("inf"), burstiness: float = 1.0, max_concurrency: int | None = None,
                    ignore_eos: bool = False, temperature: float = 0.0, disable_tqdm: bool = False,
                    seed: int = 0, num_warmups: int = 0, ready_check_timeout_sec: float = 600,
                    request_timeout: float = 6 * 3600, tokenizer=None, verbose: bool = True,
                    extra_body: dict[str, Any] | None = None, http_client: str = "httpx"):
    """Run the load; returns (model, outcomes in sample order, benchmark duration in seconds)."""
    from tqdm import tqdm

    chat = backend == "openai-chat"
    log = print if verbose else (lambda *a, **k: None)
    api_key = envs.OPENAI_API_KEY  # as vLLM's bench: the key of a server started with --api-key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with _client(http_client, max_concurrency, request_timeout, headers) as client:
        if model is None:
            deadline = time.perf_counter() + max(ready_check_timeout_sec, 1)
            while True:
                try:
                    model = await get_first_model(client, base_url)
                    break
                except Exception:
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"could not GET {base_url}/v1/models")
                    await asyncio.sleep(1.0)
        first = samples[0]
        if ready_check_timeout_sec > 0:
            log("Starting initial single prompt test run...")
            out = await wait_until_ready(client, api_url, _payload(backend, model, first, ignore_eos, temperature, tokenizer, extra_body),
                                         first.prompt_len, chat, ready_check_timeout_sec)
            if not out.success:
                raise ValueError(f"Initial test run failed - check the benchmark arguments. Error: {out.error}")
            log("Initial test run completed.")
        for _ in range(num_warmups):
            await send_request(client, api_url, _payload(backend, model, first, ignore_eos, temperature, tokenizer, extra_body),
                               first.prompt_len, chat)
        log("Starting main benchmark run...")
        distribution = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
        log(f"Traffic request rate: {request_rate}")
        log(f"Burstiness factor: {burstiness} ({distribution})")
        log(f"Maximum request concurrency: {max_concurrency}")

        pbar = tqdm(total=len(samples), disable=disable_tqdm)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(sample: ds.SampleRequest) -> RequestOutcome:
            body = _payload(backend, model, sample, ignore_eos, temperature, tokenizer, extra_body)
            if sem is None:
                out = await send_request(client, api_url, body, sample.prompt_len, chat)
            else:
                async with sem:
                    out = await send_request(client, api_url, body, sample.prompt_len, chat)
            pbar.update(1)
            return out

        offsets = arrival_offsets(len(samples), request_rate, burstiness, seed)
        t0 = time.perf_counter()
        tasks = []
        async for s in _arrivals(samples, offsets):
            tasks.append(asyncio.create_task(one(s)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        pbar.close()
    return model, list(outcomes), duration


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos")


def scrape_spec_decode_counters(base_url: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters from its Prometheus /metrics (pagedserve: or vllm: names),
    summed over label sets except the draft position; None when it has none or /metrics is not reachable."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
        families = list(text_string_to_metric_families(text))
    except Exception:
        return None
    counters: dict[str, float] = {}
    # pagedserve exports each counter under both prefixes (the same series): read one, pagedserve's if there
    prefix = "pagedserve:" if any(f.name.startswith("pagedserve:") for f in families) else "vllm:"
    for family in families:
        name = family.name.split(":", 1)[-1]
        if name not in SPEC_COUNTERS or not family.name.startswith(prefix):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = name + (f"[{sample.labels['position']}]" if "position" in sample.labels else "")
                counters[key] = counters.get(key, 0.0) + sample.value
    return counters or None


def spec_decode_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """Acceptance over the run: rate, mean acceptance length (accepted + 1 per draft) and per position."""
    if after is None:
        return None
    before = before or {}
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    drafts = delta.get("spec_decode_num_drafts", 0.0)
    drafted = delta.get("spec_decode_num_draft_tokens", 0.0)
    accepted = delta.get("spec_decode_num_accepted_tokens", 0.0)
    positions = sorted((int(k.split("[")[1].rstrip("]")), v) for k, v in delta.items() if "[" in k)
    return {
        "num_drafts": int(drafts), "num_draft_tokens": int(drafted), "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance_rate": [v / drafts for _, v in positions] if drafts else [],
    }


def format_spec_decode(spec: dict) -> str:
    rate = spec["acceptance_rate"]
    length = spec["mean_acceptance_length"]
    lines = [
        "{s:{c}^{n}}".format(s=" Speculative Decoding ", n=50, c="-"),
        f"{'Drafts:':<40}{spec['num_drafts']:<10}",
        f"{'Draft tokens:':<40}{spec['num_draft_tokens']:<10}",
        f"{'Accepted tokens:':<40}{spec['num_accepted_tokens']:<10}",
        f"{'Acceptance rate (%):':<40}{'-' if rate is None else f'{100 * rate:.2f}':<10}",
        f"{'Acceptance length:':<40}{'-' if length is None else f'{length:.2f}':<10}",
        "Per-position acceptance (%): " + ", ".join(f"{100 * r:.1f}" for r in spec["per_position_acceptance_rate"]),
        "=" * 50,
    ]
    return "\n".join(lines)


def _parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run_serve(args: argparse.Namespace) -> int:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    api_url = base_url + endpoint
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    for m in selected:
        if m not in METRIC_HEADERS:
            raise ValueError(f"--percentile-metrics: unknown metric {m!r}")
    percentiles = _parse_floats(args.metric_percentiles)
    slos = parse_goodput(args.goodput)

    tok_name = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
    tokenizer = ds.load_tokenizer(tok_name)
    model_path = args.model if args.model and os.path.isdir(args.model) else None
    samples = ds.get_samples(args, tokenizer, model_path)
    print(f"workload: {args.dataset_name}: {ds.describe(samples)}")
    np.random.seed(args.seed)

    spec_before = scrape_spec_decode_counters(base_url)
    cpu0 = time.process_time()  # the client's own CPU while it loads the server (it may share the server's cores)
    model, outcomes, duration = asyncio.run(benchmark(
        base_url=base_url, api_url=api_url, backend=args.backend, model=args.served_model_name or args.model,
        samples=samples, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
        disable_tqdm=args.disable_tqdm, seed=args.seed, num_warmups=args.num_warmups,
        ready_check_timeout_sec=args.ready_check_timeout_sec, request_timeout=args.request_timeout,
        tokenizer=tokenizer, extra_body=STRUCTURED_OUTPUT_BODIES.get(args.structured_output),
        http_client=args.http_client))
    client_cpu_s = time.process_time() - cpu0
    metrics = calculate_metrics(outcomes, duration, percentiles, slos)
    failed = [o.error for o in outcomes if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, err in enumerate(failed[:10]):
            print(f"Error {i}: {err}")
    print(format_result(metrics, selected, args.max_concurrency, args.request_rate))
    spec = spec_decode_summary(spec_before, scrape_spec_decode_counters(base_url))
    if spec is not None:
        print(format_spec_decode(spec))

    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "endpoint_type": args.backend,
        "label": args.label,
        "base_url": base_url,
        "endpoint": endpoint,
        "model_id": model,
        "tokenizer_id": tok_name,
        "dataset_name": args.dataset_name,
        "num_prompts": len(samples),
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "structured_output": args.structured_output,
        "http_client": args.http_client,
        "goodput_slos_ms": slos or None,
    }
    result.update(result_dict(metrics, outcomes))
    result["spec_decode"] = spec
    result["client_cpu_s"] = client_cpu_s
    if args.save_result or args.result_filename or args.result_dir:
        path = result_path(args, model, result["date"])
        with open(path, "w") as f:
            json.dump(result, f, indent=None)
        print(f"saved {path}")
    return 0 if metrics.completed else 1


def result_path(args: argparse.Namespace, model: str, date: str) -> str:
    base_model = os.path.basename(str(model).rstrip("/")) or "model"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or f"{args.label or args.backend}-{args.request_rate}qps{conc}-{base_model}-{date}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name
