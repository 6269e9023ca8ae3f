"""vLLM's serving plumbing that scripts and deployments rely on: model-name aliases, a chat template from the command
line, SageMaker's /ping and /invocations, CORS, a root path, HTTPS, --gpu-memory-utilization and
--trust-remote-code. Real servers on loopback, the official openai client."""
from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagedserve.config import EngineArgs
from server_helpers import REPO_ROOT, ServerProcess, free_port

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess(tiny_model_dir("llama"), ("--served-model-name", "tiny", "tiny-alias", "--chat-template",
                                                  str(template), "--allowed-origins", json.dumps([ORIGIN]),
                                                  "--root-path", "/api", "--trust-remote-code",
                                                  "--gpu-memory-utilization", "0.2"))
    yield srv
    srv.stop()


def test_every_alias_is_served_and_reported_as_asked(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    for name in ("tiny", "tiny-alias"):
        r = client.completions.create(model=name, prompt="hello", max_tokens=2, temperature=0)
        assert r.model == name and r.choices[0].text is not None
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="hello", max_tokens=2)
    assert "`tiny`, `tiny-alias`" in info.value.body["message"]


def test_chat_template_from_the_command_line(server, tiny_tokenizer):
    messages = [{"role": "user", "content": "hi there"}]
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tiny_tokenizer.encode("<<user|hi there>>=>", add_special_tokens=False)


def test_ping_and_invocations(server):
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    chat = httpx.post(server.url + "/invocations", json={"model": "tiny", "max_tokens": 3, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    direct = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    completion = httpx.post(server.url + "/invocations", json={"prompt": "hello", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    for body, param in (({"max_tokens": 3}, "messages"), ({"prompt": "hi", "max_tokens": -1}, "max_tokens")):
        r = httpx.post(server.url + "/invocations", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/invocations", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_cors_for_the_allowed_origin_only(server):
    preflight = httpx.options(server.url + "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_root_path(server):
    """Behind a proxy that serves the API under /api and strips the prefix (vLLM's --root-path): requests arrive
    without it, and the URLs the server documents carry it."""
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(server.url + "/openapi.json").json()["servers"] == [{"url": "/api"}]
    assert "/api/openapi.json" in httpx.get(server.url + "/docs").text


def test_trust_remote_code_is_accepted_and_said_to_be_ignored(server):
    assert "--trust-remote-code: accepted and ignored" in server.log()


def test_gpu_memory_utilization_is_the_kv_share():
    assert EngineArgs(gpu_memory_utilization=0.25).kv_cache_memory_fraction == 0.25
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineArgs(gpu_memory_utilization=bad)


def test_a_chat_template_that_is_neither_file_nor_template_is_refused(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(tiny_model_dir("llama")),
                        "--port", str(free_port()), "--chat-template", "no/such/file.jinja", "--num-threads", "1"],
                       capture_output=True, text=True, timeout=240, cwd=str(REPO_ROOT))
    assert r.returncode == 2 and "--chat-template 'no/such/file.jinja'" in r.stderr


def test_https(tiny_model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    trusted = ssl.create_default_context(cafile=str(cert))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(tiny_model_dir("llama")),
                             "--port", str(port), "--num-threads", "1", "--ssl-keyfile", str(key), "--ssl-certfile",
                             str(cert)], cwd=str(REPO_ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the HTTPS server did not come up"
            try:
                if httpx.get(f"https://127.0.0.1:{port}/health", verify=trusted, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="none",
                               http_client=httpx.Client(verify=trusted))
        assert client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2).choices
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        proc.terminate()
        proc.wait(30)
