"""The pooler against a direct per-sequence computation (over prefill chunks, as the pooling runner sees them), the
sentence-transformers config it reads, and the runner selection."""
import json

import pytest
import torch
import torch.nn.functional as F

from pagedserve.core.request import Request
from pagedserve.core.scheduler import ScheduledRequest
from pagedserve.model_executor.pooler import PoolerConfig, truncate_dimensions
from pagedserve.model_executor.pooling_runner import PoolingRunner
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


def _write_st_config(tmp_path, mode_key, normalize, hf=None):
    (tmp_path / "config.json").write_text(json.dumps(hf or {}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, mode_key: True}))


@pytest.mark.parametrize("mode_key,kind", [("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
                                          ("pooling_mode_cls_token", "CLS")])
@pytest.mark.parametrize("normalize", [False, True])
def test_pool_matches_per_sequence_reference(tmp_path, mode_key, kind, normalize):
    _write_st_config(tmp_path, mode_key, normalize)
    cfg = PoolerConfig.from_model_dir(tmp_path, "CLS" if kind != "CLS" else "LAST")
    assert (cfg.pooling_type, cfg.normalize) == (kind, normalize)
    torch.manual_seed(0)
    lens = [3, 1, 7, 12]
    seqs = [torch.randn(n, 8) for n in lens]
    got = _run_chunked(PoolingRunner(cfg, torch.nn.Identity()), seqs, chunk=4)
    for i, s in enumerate(seqs):
        want = {"LAST": s[-1], "CLS": s[0], "MEAN": s.mean(0)}[kind]
        if normalize:
            want = F.normalize(want, dim=-1)
        assert torch.allclose(got[str(i)], want, atol=1e-6)


def _run_chunked(runner: PoolingRunner, seqs: list[torch.Tensor], chunk: int) -> dict[str, torch.Tensor]:
    """Steps of at most `chunk` tokens per sequence, all sequences in each step until done; the rows handed to the
    runner are the last num_rows of each chunk's hidden states, as the model returns them."""
    runner.model.pooler_head = lambda x: x
    requests = [Request(str(i), list(range(len(s))), SamplingParams(), 0, pooling_params=PoolingParams())
                for i, s in enumerate(seqs)]
    outputs: dict[str, torch.Tensor] = {}
    while len(outputs) < len(seqs):
        items = [ScheduledRequest(r, min(chunk, r.num_tokens - r.num_computed_tokens), [])
                 for r in requests if r.request_id not in outputs]
        rows = []
        for item in items:
            start = item.request.num_computed_tokens
            span = seqs[int(item.request.request_id)][start:start + item.num_new_tokens]
            rows.append(span[len(span) - runner.num_rows(item):])
        outputs.update(runner.step(items, torch.cat(rows)))
        for item in items:
            item.request.num_computed_tokens += item.num_new_tokens
    assert not runner.partial  # nothing left behind
    return outputs


def test_defaults_without_sentence_transformers_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = PoolerConfig.from_model_dir(tmp_path, "LAST")
    assert (cfg.pooling_type, cfg.normalize, cfg.is_matryoshka) == ("LAST", True, False)


def test_unsupported_pooling_mode_is_a_value_error(tmp_path):
    _write_st_config(tmp_path, "pooling_mode_max_tokens", False)
    with pytest.raises(ValueError, match="pooling"):
        PoolerConfig.from_model_dir(tmp_path, "LAST")


def test_dimensions_checked_and_truncated(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    plain = PoolerConfig.from_model_dir(tmp_path, "LAST")
    plain.check_dimensions(None, 8)
    with pytest.raises(ValueError, match="dimensions"):
        plain.check_dimensions(4, 8)
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [4, 8]}))
    mrl = PoolerConfig.from_model_dir(tmp_path, "LAST")
    mrl.check_dimensions(4, 8)
    for bad in (3, 0, 9):
        with pytest.raises(ValueError, match="dimensions"):
            mrl.check_dimensions(bad, 8)
    e = F.normalize(torch.randn(2, 8), dim=-1)
    t = truncate_dimensions(e, 4)
    assert t.shape == (2, 4)
    assert torch.allclose(t, F.normalize(e[:, :4], dim=-1))
    assert torch.allclose(t.norm(dim=-1), torch.ones(2))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bidirectional_prefill_span(backend):
    """A non-causal span (encoders) attends to every token of its sequence, in the SDPA and CPU backends."""
    from pagedserve.model_executor.attention.metadata import AttentionMetadata, PrefillSpan
    from pagedserve.model_executor.attention.selector import get_attention_backend

    attn = get_attention_backend(backend, torch.device("cpu"))
    torch.manual_seed(0)
    t, h, d, bs = 5, 2, 16, 4
    q, k, v = (torch.randn(t, h, d) for _ in range(3))
    kv = attn.allocate_kv_cache(1, 4, bs, h, d, torch.float32, torch.device("cpu"))[0]
    meta = AttentionMetadata(torch.arange(t), 0, None, None, bs,
                             [PrefillSpan(0, t, t, torch.tensor([0, 1]), None, causal=False)])
    out = attn.forward(q, k, v, kv[0], kv[1], meta, d ** -0.5)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_attention_from_the_steps_qkv(backend, dtype):
    """forward_encoder (an encoder keeps no KV cache): each span attends to its own tokens both ways, read straight
    from the fused QKV projection's output (strided q/k/v), as SDPA per span; spans of odd lengths, one token too."""
    from pagedserve.model_executor.attention.metadata import AttentionMetadata, PrefillSpan
    from pagedserve.model_executor.attention.selector import get_attention_backend

    attn = get_attention_backend(backend, torch.device("cpu"))
    torch.manual_seed(0)
    lens, h, d = [7, 1, 33, 18], 3, 32
    t = sum(lens)
    qkv = torch.randn(t, 3, h, d).to(dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    meta = AttentionMetadata(None, 0, None, None, 16, [PrefillSpan(s, n, n, None, None, causal=False)
                                                      for s, n in zip(starts, lens)])
    out = attn.forward_encoder(qkv[:, 0], qkv[:, 1], qkv[:, 2], meta, d ** -0.5)
    for s, n in zip(starts, lens):
        q, k, v = (qkv[s:s + n, i].float().transpose(0, 1) for i in range(3))
        want = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out[s:s + n].float(), want, atol=tol, rtol=tol), (s, n)


def test_runner_selection(tmp_path):
    """vLLM's --runner / --task: pooling architectures pool by themselves, a causal LM only when asked (embed)."""
    from pagedserve.model_executor.pooler import resolve_pooler_config

    (tmp_path / "config.json").write_text(json.dumps({"num_labels": 1}))
    assert resolve_pooler_config(tmp_path, "Qwen3ForCausalLM", "auto", "auto") is None
    assert resolve_pooler_config(tmp_path, "Qwen3ForCausalLM", "generate", "auto") is None
    for runner, task in (("pooling", "auto"), ("auto", "embed"), ("pooling", "score")):
        cfg = resolve_pooler_config(tmp_path, "Qwen3ForCausalLM", runner, task)
        assert (cfg.task, cfg.pooling_type, cfg.supported_tasks) == ("embed", "LAST", ("embed", "score"))
    cls = resolve_pooler_config(tmp_path, "Qwen2ForSequenceClassification", "auto", "auto")
    assert (cls.task, cls.num_labels, cls.normalize, cls.supported_tasks) == ("classify", 1, False,
                                                                              ("classify", "score"))
    assert resolve_pooler_config(tmp_path, "Qwen2Model", "auto", "auto").task == "embed"
    for arch, runner, task, match in (("Qwen3ForCausalLM", "auto", "classify", "ForSequenceClassification checkpoint"),
                                      ("Qwen2ForSequenceClassification", "generate", "auto", "pooling model"),
                                      ("Qwen2Model", "auto", "classify", "not supported"),
                                      ("Qwen3ForCausalLM", "pooling", "generate", "exclude"),
                                      ("Qwen3ForCausalLM", "encode", "auto", "runner must be")):
        with pytest.raises(ValueError, match=match):
            resolve_pooler_config(tmp_path, arch, runner, task)
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(ValueError, match="one label"):
        resolve_pooler_config(tmp_path, "LlamaForSequenceClassification", "pooling", "score")
