"""Tensor and pipeline parallelism (docs/PARALLEL.md): 2 ranks on gloo over the CPU, the tiny random-weight models.

Greedy outputs with tensor_parallel_size=2 and with pipeline_parallel_size=2 match Hugging Face token for token in
float32 for every architecture and the engine's features (chunked prefill, prefix caching, preemption, n>1) give
the same tokens as one process. A killed worker fails the requests with a clear error and marks the engine dead
(never a hang); the same holds behind `pagedserve serve -tp 2`. The Ray backend joins a `ray start --head`
cluster and gives the same outputs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import pytest
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from tiny_models import ARCHS

from pagedserve import LLM, EngineArgs, SamplingParams
from pagedserve.core.kv_cache_manager import cdiv
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.fault_injection import FaultInjector
from pagedserve.executor.cpu_binding import parse_cpu_bind
from pagedserve.model_executor.parallel_state import ParallelLayout

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def short_collective_timeout(monkeypatch):
    """A regression that makes a rank wait on a dead peer fails in seconds instead of hanging."""
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "60")


@contextmanager
def engine(model_dir, **kwargs):
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("num_kv_blocks", 512)
    llm = LLM(str(model_dir), num_threads=1, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()


def generate(llm: LLM, prompts, params=GREEDY):
    return [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def assert_drained(llm: LLM) -> None:
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert not llm.llm_engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked after every request finished"


# ------------------------------------------------------------------------------------------- layout and flags
def test_layout_splits_heads_layers_and_vocabulary():
    tp4 = ParallelLayout(4, 1)
    assert tp4.local_kv_heads(8) == 2 and [tp4.kv_head_start(8, r) for r in range(4)] == [0, 2, 4, 6]
    # fewer KV heads than ranks: each rank holds a replica of the one its query heads use
    assert tp4.local_kv_heads(2) == 1 and [tp4.kv_head_start(2, r) for r in range(4)] == [0, 0, 1, 1]
    assert tp4.vocab_rows(770) == 193  # the last rank's tail is padding
    pp3 = ParallelLayout(1, 3)
    assert [list(pp3.layer_range(7, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [ParallelLayout(2, 2).coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("tp, pp, heads, kv_heads, match", [
    (3, 1, 4, 2, "4 attention heads are not divisible"),
    (4, 1, 8, 3, "3 KV heads can neither be split"),
    (1, 3, 4, 2, "exceeds the model's 2 layers"),
])
def test_layout_refuses_what_it_cannot_split(tp, pp, heads, kv_heads, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(tp, pp).validate(heads, kv_heads, 256, 2)


def test_engine_refuses_bad_parallel_settings_before_starting_workers(tiny_model_dir):
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=3"):
        LLM(str(tiny_model_dir("llama")), tensor_parallel_size=3, num_kv_blocks=16)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="uni, mp or ray"):
        EngineArgs(distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="2 core set"):
        parse_cpu_bind("0|0", 3)
    with pytest.raises(ValueError, match="not available"):
        parse_cpu_bind(f"0|{os.cpu_count() + 7}", 2)
    assert parse_cpu_bind("0-1,0|0", 2) == [[0, 1, 0], [0]]


def test_cli_flags_as_in_vllm():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["-tp", "2", "-pp", "1", "--distributed-executor-backend",
                                                       "mp", "--cpu-bind", "0|1"]))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.resolved_executor_backend,
            args.cpu_bind) == (2, 1, "mp", "0|1")
    long = EngineArgs.from_cli_args(parser.parse_args(["--pipeline-parallel-size", "2"]))
    assert long.world_size == 2 and long.resolved_executor_backend == "mp"


# ------------------------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_greedy_matches_transformers(arch, tp, pp, tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=8)
    with engine(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        assert llm.llm_engine.config.parallel.distributed_executor_backend == "mp"
        ours = generate(llm, prompts)
        assert_drained(llm)
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS))


def test_engine_features_same_tokens_as_one_process(tiny_model_dir, tiny_tokenizer):
    """A 32-token budget (chunked prefill), a pool that fits only the longest request (preemption), every prompt
    twice (prefix cache hits) and n=2 seeded sampling: TP=2, and PP=2 with two batches in flight
    (tests/engine/test_pipeline_inflight.py), give exactly what one process gives."""
    model_dir = tiny_model_dir("qwen3")
    prompts = mixed_prompts(tiny_tokenizer, n=6, lengths=(5, 120))
    prompts = prompts + prompts
    config = dict(max_num_batched_tokens=32, num_kv_blocks=cdiv(max(map(len, prompts)) + MAX_TOKENS, 16))
    sampled = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)
    results = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        with engine(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **config) as llm:
            greedy = [o.token_ids for o in generate(llm, prompts)]
            outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=sampled, use_tqdm=False)
            stats = llm.llm_engine.get_stats().scheduler
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
            assert llm.llm_engine.max_batches_in_flight_seen == (2 if pp == 2 else 0)  # 0: the synchronous path
            assert_drained(llm)
            results[tp, pp] = greedy, [[c.token_ids for c in o.outputs] for o in outs]
    assert results[2, 1] == results[1, 1]
    assert results[1, 2] == results[1, 1]


# ------------------------------------------------------------------------------------------- failures
def test_killed_worker_fails_requests_clearly_and_engine_reports_dead(tiny_model_dir, tiny_tokenizer):
    prompts = mixed_prompts(tiny_tokenizer, n=4, lengths=(5, 40))
    with engine(tiny_model_dir("llama"), tensor_parallel_size=2) as llm:
        executor = llm.llm_engine.executor
        assert len(generate(llm, prompts)) == 4 and executor.dead_reason is None
        pid = executor.worker_pids[1]
        os.kill(pid, signal.SIGKILL)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        reason = f"rank 1 (pid {pid}) exited with code -9"
        assert all(o.outputs[0].finish_reason == "error" and reason in o.error for o in outs), outs[0].error
        assert reason in llm.llm_engine.dead_reason
        health = AsyncLLM(llm.llm_engine, log_stats=False, start=False).health()
        assert (health.healthy, health.status) == (False, "dead") and reason in health.message
        assert_drained(llm)


def test_failed_forward_on_the_driver_ends_the_group(tiny_model_dir, tiny_tokenizer):
    """An exception inside the driver's forward leaves the worker inside a collective: the executor must not run
    another step with it (the ranks would pair the wrong messages), it stops the worker and says why."""
    prompts = mixed_prompts(tiny_tokenizer, n=2, lengths=(5, 20))
    with engine(tiny_model_dir("llama"), tensor_parallel_size=2) as llm:
        llm.llm_engine.fault_injector = FaultInjector(llm.llm_engine.runner.model, lambda out: True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert all("the forward failed (InjectedFault" in o.error for o in outs)
        executor = llm.llm_engine.executor
        assert "forward failed" in executor.dead_reason
        assert all(not p.is_alive() for p in executor._procs.values())


# ------------------------------------------------------------------------------------------- server
def test_server_tp2_serves_hf_tokens_and_reports_dead_worker(tiny_model_dir, tiny_tokenizer):
    import httpx
    import openai
    from server_helpers import ServerProcess

    model_dir = tiny_model_dir("llama")
    prompts = mixed_prompts(tiny_tokenizer, n=2, lengths=(5, 60))
    server = ServerProcess(model_dir, ("--dtype", "float32", "--num-kv-blocks", "128", "--tensor-parallel-size", "2"),
                           env={"PAGEDSERVE_DIST_TIMEOUT_S": "60"})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        served = [client.completions.create(model=str(model_dir), prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0] for p in prompts]
        hf = hf_greedy(model_dir, prompts, MAX_TOKENS)
        assert [tiny_tokenizer.decode(r.token_ids) for r in hf] == [c.text for c in served]
        worker = next(pid for pid in _descendants(server.proc.pid) if _comm(pid) == "pagedserve-r1")
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model=str(model_dir), prompt=prompts[0], max_tokens=4)
        assert failed.value.status_code in (500, 503) and "rank 1" in str(failed.value)
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "rank 1" in health.text
    finally:
        server.stop()


def _descendants(pid: int) -> list[int]:
    """The worker is a child of multiprocessing's fork server, itself a child of the server (of its engine thread:
    /proc lists children per thread)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(p) for p in f.read().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return children + [d for child in children for d in _descendants(child)]


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


# ------------------------------------------------------------------------------------------- ray
@pytest.fixture
def ray_cluster(monkeypatch):
    """`ray start --head` (2 CPUs) in its own session; torn down by killing that session's processes only."""
    pytest.importorskip("ray", reason="the Ray backend needs `pip install pagedserve[ray]`")
    from server_helpers import free_port

    port = free_port()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a loopback-only test cluster; whatever ~/.ray/auth_token holds
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix socket paths live under it
    log = open(os.path.join(temp_dir, "head.log"), "wb")
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--num-cpus", "2", "--port", str(port),
                             "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp_dir],
                            start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not _accepts_connections(port):  # the head's GCS; the executor then joins it through RAY_ADDRESS
            assert head.poll() is None, "ray start --head exited: " + open(log.name, errors="replace").read()
            assert time.monotonic() < deadline, "the Ray head did not start in 90 s"
            time.sleep(0.5)
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        yield
    finally:
        import ray

        ray.shutdown()
        _kill_session(head.pid)
        head.wait()
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _accepts_connections(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _kill_session(sid: int) -> None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_ray_backend_same_outputs_and_dead_actor(ray_cluster, tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir("llama")
    prompts = mixed_prompts(tiny_tokenizer, n=4, lengths=(5, 60))
    llm = LLM(str(model_dir), dtype="float32", num_threads=1, num_kv_blocks=256, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        assert llm.llm_engine.config.parallel.distributed_executor_backend == "ray"
        ours = generate(llm, prompts)
        assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS))
        llm.llm_engine.executor.kill_worker(1)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert all("rank 1 (Ray actor)" in o.error for o in outs), outs[0].error
    finally:
        llm.llm_engine.shutdown()


# ------------------------------------------------------------------------------------------- two "machines"
TWO_NODE_DRIVER = """
import json, sys, time
import ray
from pagedserve import LLM, SamplingParams
deadline = time.monotonic() + 120
while True:  # the head's port opens before its own node registers: on a busy machine ray.init() can come between
    try:
        ray.init()
        break
    except ConnectionError:
        ray.shutdown()
        assert time.monotonic() < deadline, "the head node did not register"
        time.sleep(0.5)
while len([n for n in ray.nodes() if n["Alive"]]) < 2:
    assert time.monotonic() < deadline, "the second node did not join"
    time.sleep(0.5)
hosts = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
llm = LLM(sys.argv[1], dtype="float32", num_threads=1, num_kv_blocks=256, tensor_parallel_size=2,
          distributed_executor_backend="ray")
outs = llm.generate(prompt_token_ids=json.loads(sys.argv[2]), use_tqdm=False,
                    sampling_params=SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True))
print(json.dumps({"worker_hosts": hosts, "driver_host": ray.util.get_node_ip_address(),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
llm.llm_engine.shutdown()
"""


@pytest.fixture
def two_namespaces(monkeypatch):
    """Two network namespaces joined by a veth pair: two "machines" (10.215.0.1, 10.215.0.2) that reach each other
    only through that link. Needs root (CAP_NET_ADMIN) and iproute2; skipped otherwise."""
    pytest.importorskip("ray", reason="the Ray backend needs `pip install pagedserve[ray]`")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two network namespaces need root and iproute2 (`ip netns`)")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a test cluster reachable only through the veth link
    tag = os.getpid() % 100000
    nodes = [(f"ps{tag}a", f"v{tag}a", "10.215.0.1", "10.215.0.2"), (f"ps{tag}b", f"v{tag}b", "10.215.0.2", "10.215.0.1")]
    commands = [["ip", "netns", "add", nodes[0][0]], ["ip", "netns", "add", nodes[1][0]],
                ["ip", "link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1]]]
    for ns, dev, addr, peer in nodes:
        commands += [["ip", "link", "set", dev, "netns", ns], ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                     ["ip", "-n", ns, "link", "set", dev, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "-n", ns, "route", "add", "default", "via", peer, "dev", dev]]
    try:
        for command in commands:
            setup = subprocess.run(command, capture_output=True, text=True)
            if setup.returncode:
                pytest.skip(f"cannot build two network namespaces here ({' '.join(command)}: {setup.stderr.strip()})")
        yield nodes
    finally:
        for ns, *_ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its end of the veth pair along


def _wait_for_port_in_namespace(ns: str, ip: str, port: int, timeout_s: float = 120.0) -> None:
    """Until something accepts TCP connections at ip:port inside network namespace `ns` (a bound for a hang)."""
    probe = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=2).close()"
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True).returncode:
        assert time.monotonic() < deadline, f"nothing listens at {ip}:{port} in {ns}"
        time.sleep(0.2)


@pytest.mark.timeout(900)  # two Ray nodes and a driver, each a fresh process (minutes on a loaded machine)
def test_ray_tensor_parallel_across_two_network_namespaces(two_namespaces, tiny_model_dir, tiny_tokenizer):
    """The multi-node path without any address outside this machine: a Ray head (no CPUs: it can host no worker) in
    one namespace, a Ray node with one CPU in the other, the engine in the first; gloo between the two over the
    veth link. The worker rank must run on the second "machine", and the outputs are HF's."""
    import json

    model_dir = tiny_model_dir("llama")
    prompts = mixed_prompts(tiny_tokenizer, n=3, lengths=(5, 60))
    (ns_a, dev_a, ip_a, _), (ns_b, dev_b, ip_b, _) = two_namespaces
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    port = 6379
    heads = []
    try:
        for ns, dev, extra in ((ns_a, dev_a, ["--head", "--port", str(port), "--num-cpus", "0",
                                                "--include-dashboard=false", "--node-ip-address", ip_a]),
                               (ns_b, dev_b, ["--address", f"{ip_a}:{port}", "--num-cpus", "1",
                                              "--node-ip-address", ip_b])):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=dev)  # gloo binds to the namespace's end of the link
            heads.append(subprocess.Popen(["ip", "netns", "exec", ns, ray_cli, "start", "--block",
                                           "--disable-usage-stats", "--temp-dir", os.path.join(temp_dir, ns), *extra],
                                          env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            if ns == ns_a:  # the node joins a head that listens
                _wait_for_port_in_namespace(ns_a, ip_a, port)
        env = dict(os.environ, GLOO_SOCKET_IFNAME=dev_a, RAY_ADDRESS=f"{ip_a}:{port}",
                   PAGEDSERVE_DIST_TIMEOUT_S="60")
        driver = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", TWO_NODE_DRIVER, str(model_dir),
                                 json.dumps(prompts), str(MAX_TOKENS)], env=env, capture_output=True, text=True,
                                timeout=300)
        assert driver.returncode == 0, driver.stderr[-3000:]
        result = json.loads(driver.stdout.strip().splitlines()[-1])
    finally:
        for head in heads:
            _kill_session(head.pid)
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert result["driver_host"] == ip_a and result["worker_hosts"] == [ip_b]
    assert result["tokens"] == [r.token_ids for r in hf_greedy(model_dir, prompts, MAX_TOKENS)]
