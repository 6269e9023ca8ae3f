"""vLLM's server plumbing (issue 53 item 5) over loopback with the official `openai` client: several
--served-model-name aliases, --chat-template, CORS flags, --root-path, /ping, /invocations, dev-mode
/reset_prefix_cache, --gpu-memory-utilization and --trust-remote-code accepted, HTTPS with --ssl-keyfile/certfile."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import REPO_ROOT, ServerProcess, auth_headers, free_port, get_server

pytestmark = pytest.mark.server

openai = pytest.importorskip("openai")

TEMPLATE = "OVERRIDE:{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
ORIGIN = "http://ui.example"
FLAGS = ("--num-kv-blocks", "64", "--max-model-len", "256", "--served-model-name", "alpha", "beta",
         "--chat-template", TEMPLATE, "--allowed-origins", f'["{ORIGIN}"]', "--root-path", "/api",
         "--gpu-memory-utilization", "0.2", "--trust-remote-code")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    gen = tmp_path_factory.mktemp("genconfig")
    (gen / "generation_config.json").write_text('{"temperature": 0.0, "top_k": 5}')
    srv = ServerProcess(tiny_model_dir("llama"), FLAGS + ("--generation-config", str(gen)),
                        env={"PAGEDSERVE_SERVER_DEV_MODE": "1"})
    yield srv
    assert srv.stop() == 0


def test_every_served_model_name_is_accepted_and_the_first_reported(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for name in ("alpha", "beta"):
        out = client.completions.create(model=name, prompt="a b c", max_tokens=3, temperature=0)
        assert out.model == "alpha"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt="a", max_tokens=1)
    assert "--trust-remote-code is accepted and ignored" in server.log()


def test_generation_config_folder_sets_the_defaults_a_request_leaves_unset(server):
    """temperature 0 from the folder's generation_config.json: a request without one is greedy."""
    body = {"prompt": "a b c d", "max_tokens": 8, "seed": 123}
    default = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    greedy = httpx.post(server.url + "/v1/completions", json={**body, "temperature": 0}, timeout=60).json()["choices"][0]["text"]
    assert default == greedy
    sampled = [httpx.post(server.url + "/v1/completions", json={**body, "temperature": 2.0, "top_k": 0, "seed": s}
                          , timeout=60).json()["choices"][0]["text"] for s in range(4)]
    assert any(t != greedy for t in sampled)  # a request's own temperature still wins


def test_chat_template_flag_replaces_the_tokenizers(server, tiny_tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi there"}]}, timeout=60)
    assert r.status_code == 200
    assert r.json()["tokens"] == tiny_tokenizer.encode("OVERRIDE:[hi there]", add_special_tokens=False)


def test_cors_headers_follow_the_flags(server):
    pre = httpx.options(server.url + "/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}, timeout=60)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    got = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=60)
    assert got.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=60)
    assert "access-control-allow-origin" not in other.headers


def test_root_path_is_the_proxys_prefix(server):
    """As vLLM's: a proxy strips /api before forwarding; the app still routes /v1/..., and the links it
    generates (OpenAPI servers) carry the prefix."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["alpha"]
    assert httpx.get(server.url + "/openapi.json", timeout=60).json()["servers"] == [{"url": "/api"}]


def test_ping_and_invocations(server):
    assert httpx.get(server.url + "/ping", timeout=60).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=60).status_code == 200
    comp = httpx.post(server.url + "/invocations", json={"prompt": "a b c", "max_tokens": 3, "temperature": 0}, timeout=60)
    direct = httpx.post(server.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 3, "temperature": 0}, timeout=60)
    assert comp.status_code == 200 and comp.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    chat = httpx.post(server.url + "/invocations", json={"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    bad = httpx.post(server.url + "/invocations", json={"input": "x"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    bad = httpx.post(server.url + "/invocations", json={"prompt": "x", "max_tokens": -1}, timeout=60)
    assert bad.status_code == 400


def test_reset_prefix_cache_in_dev_mode(server, tiny_model_dir):
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=60).status_code == 200


def test_reset_prefix_cache_absent_without_dev_mode(tiny_model_dir):
    srv = get_server(tiny_model_dir("llama"))  # the session's main server: no dev mode (shared, not started here)
    assert httpx.post(srv.url + "/reset_prefix_cache", headers=auth_headers(), timeout=60).status_code == 404


@pytest.mark.slow
def test_https_with_ssl_keyfile_and_certfile(tiny_model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(tiny_model_dir("llama")),
                             "--port", str(port), "--num-threads", "1", "--num-kv-blocks", "32", "--max-model-len",
                             "128", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
                            env=env, cwd=str(REPO_ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "server exited"
            try:
                if httpx.get(f"https://127.0.0.1:{port}/health", verify=ssl.create_default_context(cafile=str(cert)),
                             timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.25)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=60)
        # a streamed body over TLS: its chunks are written straight to the (TLS) transport (direct_write.py)
        with httpx.stream("POST", f"https://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"prompt": "hi", "max_tokens": 4, "stream": True, "ignore_eos": True},
                          verify=ssl.create_default_context(cafile=str(cert))) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200 and text.count('"finish_reason":"length"') == 1 and text.endswith("data: [DONE]\n\n")
    finally:
        proc.terminate()
        proc.wait(30)
