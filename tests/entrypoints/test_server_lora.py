"""Multi-LoRA through `pagedserve serve --enable-lora --lora-modules name=path` with the official openai client: a
chat completion with model=<adapter> answers as PEFT's merged model does in HF (greedy, float32), adapters are listed
in /v1/models with the base model as parent, unknown names are 404, and adapters load and unload at run time (with
PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1, behind the API key)."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from hf_reference import hf_greedy  # noqa: E402
from lora_adapters import make_peft_adapter  # noqa: E402
from server_helpers import API_KEY, ServerProcess, auth_headers  # noqa: E402

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Write a function that reverses a list."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    return [make_peft_adapter(model_dir, tmp_path_factory.mktemp(f"server_lora{i}"), rank=4 * i, seed=10 + i)
            for i in (1, 2)]


@pytest.fixture(scope="module")
def server(model_dir, adapters):
    server = ServerProcess(model_dir, ("--dtype", "float32", "--num-kv-blocks", "128", "--enable-lora",
                                       "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2",
                                       "--lora-modules", f"alpha={adapters[0][0]}", "--api-key", API_KEY),
                           env={"PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    yield server
    assert server.stop() == 0


def expected_text(tiny_tokenizer, merged_dir) -> str:
    prompt = tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    return tiny_tokenizer.decode(hf_greedy(merged_dir, [ids], MAX_TOKENS)[0].token_ids, skip_special_tokens=True)


def chat(client, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.model == model
    return r.choices[0].message.content


def test_chat_with_adapter_matches_peft(server, adapters, model_dir, tiny_tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    base_name = client.models.list().data[0].id
    cards = {m.id: m for m in client.models.list().data}
    assert cards["alpha"].parent == base_name and cards["alpha"].root == str(adapters[0][0])
    adapted, base = expected_text(tiny_tokenizer, adapters[0][1]), expected_text(tiny_tokenizer, model_dir)
    assert adapted != base
    assert chat(client, "alpha") == adapted
    assert chat(client, base_name) == base
    with pytest.raises(openai.NotFoundError):
        chat(client, "no-such-adapter")


def test_load_and_unload_at_run_time(server, adapters, tiny_tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    body = {"lora_name": "beta", "lora_path": str(adapters[1][0])}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60).status_code == 401  # the API key
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=auth_headers(), timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=auth_headers(), timeout=60).status_code == 400
    assert "beta" in {m.id for m in client.models.list().data}
    assert chat(client, "beta") == expected_text(tiny_tokenizer, adapters[1][1])
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"},
                   headers=auth_headers(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=auth_headers(), timeout=60)
    assert r.status_code == 200, r.text
    assert "beta" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        chat(client, "beta")
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=auth_headers(), timeout=60)
    assert r.status_code == 404
