"""`pagedserve serve model.gguf` over HTTP with the official `openai` client: the file's tokenizer (which has one
token more than the model's vocabulary: transformers' GGUF tokenizer adds `<|endoftext|>`) and chat template, greedy
text as the offline engine gives it, structured output (its grammar tokenizer built at start-up)."""
from __future__ import annotations

import json
import shutil

import pytest
from gguf_files import make_tiny_gguf
from server_helpers import ServerProcess

from pagedserve import LLM, SamplingParams
from pagedserve.model_executor import gguf_loader

openai = pytest.importorskip("openai")
pytest.importorskip("gguf")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = make_tiny_gguf("qwen2", "Q8_0", tmp_path_factory.mktemp("gguf"))
    converted = gguf_loader.gguf_checkpoint_dir(path)  # the server finds it in the cache; removed afterwards
    yield path
    shutil.rmtree(converted, ignore_errors=True)


@pytest.fixture(scope="module")
def gguf_server(gguf_path):
    server = ServerProcess(gguf_path, ("--max-model-len", "256", "--num-kv-blocks", "64"))
    yield server
    assert server.stop() == 0


def test_serve_gguf_file_with_openai_client(gguf_path, gguf_server):
    client = openai.OpenAI(base_url=gguf_server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [str(gguf_path)]
    llm = LLM(str(gguf_path), num_threads=1, dtype="float32")
    assert len(llm.get_tokenizer()) == llm.llm_engine.model_config.vocab_size + 1  # the case this test is for

    prompt = "the cat reads"
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model=str(gguf_path), prompt=prompt, temperature=0.0, max_tokens=8,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected

    chat = client.chat.completions.create(model=str(gguf_path), messages=[{"role": "user", "content": "hi"}],
                                          temperature=0.0, max_tokens=4, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4

    constrained = client.chat.completions.create(
        model=str(gguf_path), messages=[{"role": "user", "content": "a number"}], temperature=0.0, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    assert 0 <= json.loads(constrained.choices[0].message.content)["n"] <= 99
