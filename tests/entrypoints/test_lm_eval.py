"""lm-evaluation-harness (PyPI lm_eval) scoring a small multiple-choice task from local files with
`local-completions` against `pagedserve serve`: it sends `echo: true, logprobs: 1, max_tokens: 1` and reads the
prompt tokens' logprobs; the log-likelihoods it reports equal HF transformers' on the same tiny model within 1e-3.
And `local-chat-completions` with a generate_until task: its answers equal HF's greedy ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hf_reference import hf_greedy, load_hf_model
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

DOCS = [
    {"question": "the cat reads the", "choices": ["book", "dog", "evening"], "label": 0},
    {"question": "def compute(x, y):\n    return", "choices": ["x + y", "items", "the house"], "label": 0},
    {"question": "a small model", "choices": ["learns", "sleeps", "reads a book"], "label": 1},
]

TASK_YAML = """task: pagedserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerProcess(model_dir, ("--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "512",
                                       "--max-num-batched-tokens", "16"))
    yield server
    assert server.stop() == 0


def hf_loglikelihood(model_dir: str, tokenizer, context: str, continuation: str) -> float:
    """lm_eval's split (trailing context spaces move to the continuation; the whole is encoded, then cut at the
    context's length), scored by HF in float32."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    num_ctx = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logits = load_hf_model(model_dir)(torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return float(sum(logprobs[i - 1, whole[i]] for i in range(num_ctx, len(whole))))


def run_lm_eval(tmp_path, task_yaml: str, task: str, model: str, model_args: str, *extra: str) -> list[dict]:
    """`lm_eval --model MODEL` on DOCS as the task `task_yaml` describes (local files, offline) -> its logged
    samples, one per doc."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{task}.yaml").write_text(task_yaml.format(data=data))
    out_dir = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, *extra,
                           "--tasks", task, "--include_path", str(tasks), "--output_path", str(out_dir),
                           "--log_samples"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples_files = list(out_dir.rglob(f"samples_{task}_*.jsonl"))
    assert samples_files, list(out_dir.rglob("*"))
    samples = [json.loads(line) for line in samples_files[0].read_text().splitlines()]
    assert len(samples) == len(DOCS)
    return samples


def test_lm_eval_local_completions_loglikelihoods(server, model_dir, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pagedserve[test] installs it)")
    from transformers import AutoTokenizer

    model_args = (f"model={model_dir},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={model_dir},num_concurrent=1,max_retries=1,tokenized_requests=True")
    samples = run_lm_eval(tmp_path, TASK_YAML, "pagedserve_tiny_mc", "local-completions", model_args)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    checked = 0
    for sample in samples:
        for args, resp in zip(sample["arguments"].values() if isinstance(sample["arguments"], dict)
                              else sample["arguments"], sample["resps"]):
            context, continuation = (args["arg_0"], args["arg_1"]) if isinstance(args, dict) else args
            loglik = float(resp[0][0])  # the samples file stores it as a string
            assert loglik == pytest.approx(hf_loglikelihood(model_dir, tokenizer, context, continuation), abs=1e-3)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)


GEN_TASK_YAML = """task: pagedserve_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def hf_chat_greedy(model_dir: str, tokenizer, messages: list[dict], max_new_tokens: int, stop: str) -> str:
    """HF transformers' greedy answer in float32 to the chat-rendered messages, ended at EOS and cut at the stop
    string, as the server ends it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids  # the template holds BOS, as the server renders it
    tokens = list(hf_greedy(model_dir, [ids], max_new_tokens)[0].token_ids)
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens, skip_special_tokens=True).split(stop)[0]


def test_lm_eval_local_chat_completions_generate_until(server, model_dir, tmp_path):
    """`local-chat-completions --apply_chat_template` with a generate_until task: lm_eval sends chat requests
    (temperature 0, max_tokens, stop, seed); each answer it records equals HF's greedy answer to the same
    messages, cut at the stop string."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pagedserve[test] installs it)")
    from transformers import AutoTokenizer

    model_args = f"model={model_dir},base_url={server.url}/v1/chat/completions,num_concurrent=1,max_retries=1"
    samples = run_lm_eval(tmp_path, GEN_TASK_YAML, "pagedserve_tiny_gen", "local-chat-completions", model_args,
                          "--apply_chat_template")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for sample in samples:
        question = sample["doc"]["question"]
        expected = hf_chat_greedy(str(model_dir), tokenizer, [{"role": "user", "content": question}], 8, "\n")
        assert sample["resps"][0][0] == expected, (question, sample["resps"], expected)
