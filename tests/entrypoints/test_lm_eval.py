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
from server_helpers import FP32_CHUNKED_ARGS, get_server

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
    return get_server(model_dir, FP32_CHUNKED_ARGS)  # chunked prefill; shared with test_server_prompt_logprobs


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


class LmEvalRun:
    """`lm_eval --model MODEL` on DOCS as the task `task_yaml` describes (local files, offline), started in a
    subprocess at once; samples() waits for it and returns its logged samples, one per doc."""

    def __init__(self, work_dir, task_yaml: str, task: str, model: str, model_args: str, *extra: str) -> None:
        self.task = task
        data = work_dir / "docs.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
        tasks = work_dir / "tasks"
        tasks.mkdir()
        (tasks / f"{task}.yaml").write_text(task_yaml.format(data=data))
        self.out_dir = work_dir / "out"
        self.stderr_path = work_dir / "stderr.txt"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.stderr_path, "wb") as stderr:  # a file, not a pipe: nobody reads it while the run goes on
            self.proc = subprocess.Popen([sys.executable, "-m", "lm_eval", "--model", model, "--model_args",
                                          model_args, *extra, "--tasks", task, "--include_path", str(tasks),
                                          "--output_path", str(self.out_dir), "--log_samples"],
                                         env=env, stdout=subprocess.DEVNULL, stderr=stderr)

    def samples(self) -> list[dict]:
        returncode = self.proc.wait(timeout=600)
        assert returncode == 0, self.stderr_path.read_text(errors="replace")[-4000:]
        samples_files = list(self.out_dir.rglob(f"samples_{self.task}_*.jsonl"))
        assert samples_files, list(self.out_dir.rglob("*"))
        samples = [json.loads(line) for line in samples_files[0].read_text().splitlines()]
        assert len(samples) == len(DOCS)
        return samples


@pytest.fixture(scope="module")
def lm_eval_runs(server, model_dir, tmp_path_factory):
    """Both runs, started together: each is mostly lm_eval's own start (its imports, one core's work), so two
    cores overlap them; each test waits for its own run and checks it."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pagedserve[test] installs it)")
    completions = (f"model={model_dir},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={model_dir},num_concurrent=1,max_retries=1,tokenized_requests=True")
    chat = f"model={model_dir},base_url={server.url}/v1/chat/completions,num_concurrent=1,max_retries=1"
    runs = {"completions": LmEvalRun(tmp_path_factory.mktemp("lm_eval_mc"), TASK_YAML, "pagedserve_tiny_mc",
                                     "local-completions", completions),
            "chat": LmEvalRun(tmp_path_factory.mktemp("lm_eval_gen"), GEN_TASK_YAML, "pagedserve_tiny_gen",
                              "local-chat-completions", chat, "--apply_chat_template")}
    yield runs
    for run in runs.values():
        if run.proc.poll() is None:  # a test that failed before waiting for its run
            run.proc.kill()
            run.proc.wait()


def test_lm_eval_local_completions_loglikelihoods(lm_eval_runs, model_dir):
    from transformers import AutoTokenizer

    samples = lm_eval_runs["completions"].samples()
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


def test_lm_eval_local_chat_completions_generate_until(lm_eval_runs, model_dir):
    """`local-chat-completions --apply_chat_template` with a generate_until task: lm_eval sends chat requests
    (temperature 0, max_tokens, stop, seed); each answer it records equals HF's greedy answer to the same
    messages, cut at the stop string."""
    from transformers import AutoTokenizer

    samples = lm_eval_runs["chat"].samples()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for sample in samples:
        question = sample["doc"]["question"]
        expected = hf_chat_greedy(str(model_dir), tokenizer, [{"role": "user", "content": question}], 8, "\n")
        assert sample["resps"][0][0] == expected, (question, sample["resps"], expected)
