"""Multi-LoRA through the offline API against PEFT: random adapters (non-zero A and B) built and saved by `peft` on
the tiny llama, each compared token for token (greedy, float32) with PEFT's merged model run by HF transformers.
One adapter; a batch mixing four adapters and the base model (all in slots at once, and through two slots with
adapters waiting and swapped in and out of slots and the host cache); chunked prefill; preemption; the base model
unchanged while adapters are loaded; prefix caching that never shares KV between adapters; bad input as ValueError."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts  # noqa: E402
from kernel_capabilities import default_build  # noqa: E402
from lora_adapters import make_peft_adapter  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.lora import LoRARequest  # noqa: E402
from pagedserve.model_executor.layers.fused_decode import FusedDecodeStack  # noqa: E402

MAX_TOKENS = 10
# (rank, alpha, targets, rslora): ranks below the maximum (zero-padded in the slots), partial targets, rsLoRA
ADAPTERS = [(8, 16, None, False), (4, 8, ["q_proj", "v_proj", "down_proj"], True), (16, 16, None, False),
            (2, 4, ["k_proj", "o_proj", "gate_proj", "up_proj"], False)]


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """[(LoRARequest, merged checkpoint dir)] for ADAPTERS."""
    out = []
    for i, (rank, alpha, targets, rslora) in enumerate(ADAPTERS, start=1):
        adapter_dir, merged_dir = make_peft_adapter(model_dir, tmp_path_factory.mktemp(f"lora{i}"), rank=rank,
                                                    alpha=alpha, target_modules=targets, use_rslora=rslora, seed=i)
        out.append((LoRARequest(f"adapter{i}", i, str(adapter_dir)), merged_dir))
    return out


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, num_kv_blocks=512,
               num_threads=1)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def reference(prompts, loras, adapters, model_dir):
    merged = {lora.lora_int_id: d for lora, d in adapters}
    return [hf_greedy(model_dir if lora is None else merged[lora.lora_int_id], [p], MAX_TOKENS)[0]
            for p, lora in zip(prompts, loras)]


def run(llm, prompts, loras):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)


def test_one_adapter_matches_peft_merged(llm, adapters, model_dir, tiny_tokenizer):
    prompts = mixed_prompts(tiny_tokenizer, n=3, lengths=(5, 80))
    lora, merged = adapters[0]
    outs = run(llm, prompts, lora)
    assert_greedy_match(outs, hf_greedy(merged, prompts, MAX_TOKENS), min_identical_frac=1.0, logprob_atol=1e-4)
    # the adapter changes the model: the same prompts on the base model answer differently
    assert [o.outputs[0].token_ids for o in outs] != [r.token_ids for r in hf_greedy(model_dir, prompts, MAX_TOKENS)]


# the weight dtypes the build's small GEMM runs: the whole-stack decode exists for those only (a dtype it cannot run
# is not generated)
@pytest.mark.parametrize("dtype", [d for d in ("float32", "bfloat16") if getattr(torch, d) in default_build().gemm_dtypes])
def test_decode_steps_with_adapters_run_the_native_stack(dtype, adapters, model_dir, tiny_tokenizer, monkeypatch):
    """A decode step mixing adapters and the base model runs in the native whole-stack decode (the LoRA kernel after
    each product), PEFT-exact in float32, and bitwise as the Python layers run the same steps."""
    llm = LLM(str(model_dir), dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=128,
              num_threads=1, enable_prefix_caching=False)  # the second run must prefill exactly as the first
    manager = llm.llm_engine.runner.lora_manager
    assert manager.fused_decode is not None and manager.batched, "the native whole-stack decode and LoRA kernel"
    prompts = mixed_prompts(tiny_tokenizer, n=3, lengths=(5, 40), seed=8)
    loras = [adapters[0][0], None, adapters[2][0]]
    native = FusedDecodeStack.__call__
    took: list[tuple[bool, bool]] = []  # per call: the stack ran, with adapter rows

    def counting(self, *args):
        out = native(self, *args)
        took.append((out is not None, bool(self.lora)))
        return out

    monkeypatch.setattr(FusedDecodeStack, "__call__", counting)
    fast = run(llm, prompts, loras)
    assert (True, True) in took  # decode steps with adapter rows took the native stack
    if dtype == "float32":
        assert_greedy_match(fast, reference(prompts, loras, adapters, model_dir), min_identical_frac=1.0,
                            logprob_atol=1e-4)
    monkeypatch.setattr(manager, "fused_decode", None)  # the Python layers on every step
    slow = run(llm, prompts, loras)
    for f, s in zip(fast, slow):
        f, s = f.outputs[0], s.outputs[0]
        assert f.token_ids == s.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in f.logprobs] == \
            [{t: lp.logprob for t, lp in step.items()} for step in s.logprobs]


@pytest.mark.slow
def test_mixed_batch_four_adapters_and_base(llm, adapters, model_dir, tiny_tokenizer):
    prompts = mixed_prompts(tiny_tokenizer, n=10, lengths=(5, 120), seed=1)
    loras = [None if i % 5 == 4 else adapters[i % 5][0] for i in range(len(prompts))]
    outs = run(llm, prompts, loras)
    assert_greedy_match(outs, reference(prompts, loras, adapters, model_dir), min_identical_frac=1.0,
                        logprob_atol=1e-4)
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks


@pytest.mark.slow
def test_base_outputs_unchanged_while_adapters_loaded(llm, adapters, model_dir, tiny_tokenizer):
    prompts = mixed_prompts(tiny_tokenizer, n=4, lengths=(5, 100), seed=2)
    run(llm, prompts[:1], adapters[1][0])  # adapters sit in slots and the host cache
    outs = run(llm, prompts, None)
    assert_greedy_match(outs, hf_greedy(model_dir, prompts, MAX_TOKENS), min_identical_frac=1.0, logprob_atol=1e-4)


@pytest.mark.slow
def test_slots_swapped_chunked_prefill_and_preemption(adapters, model_dir, tiny_tokenizer):
    """Two slots and a host cache of two for four adapters (requests wait for slots, adapters are reloaded from
    disk), 24-token steps (chunked prefill), and a KV pool small enough to preempt."""
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
              max_num_batched_tokens=24, num_kv_blocks=24, block_size=8, num_threads=1)
    prompts = mixed_prompts(tiny_tokenizer, n=10, lengths=(5, 90), seed=3)
    loras = [None if i % 5 == 4 else adapters[i % 5][0] for i in range(len(prompts))]
    outs = run(llm, prompts, loras)
    assert_greedy_match(outs, reference(prompts, loras, adapters, model_dir), min_identical_frac=1.0,
                        logprob_atol=1e-4)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


@pytest.mark.slow
def test_prefix_cache_not_shared_between_adapters(llm, adapters, model_dir, tiny_tokenizer):
    prompt = mixed_prompts(tiny_tokenizer, n=1, lengths=(70, 70), seed=4)
    kv = llm.llm_engine.kv_cache_manager
    results = {}
    for lora in (adapters[0][0], adapters[1][0], None, adapters[0][0]):
        hits = kv.prefix_cache_hits
        out = run(llm, prompt, lora)[0]
        key = lora.lora_int_id if lora is not None else 0
        results.setdefault(key, []).append((out.outputs[0].token_ids, kv.prefix_cache_hits - hits))
    (first, hit_first), (again, hit_again) = results[1]
    assert hit_again >= 64 and again == first  # the same adapter hits its own blocks
    assert results[2][0][1] == 0 and results[0][0][1] == 0  # another adapter / the base model: none
    refs = reference(prompt * 3, [adapters[0][0], adapters[1][0], None], adapters, model_dir)
    assert [first, results[2][0][0], results[0][0][0]] == [r.token_ids for r in refs]


def test_bad_lora_requests(llm, adapters, model_dir, tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate("hello", GREEDY, lora_request=LoRARequest("missing", 9, str(tmp_path)), use_tqdm=False)
    big = tmp_path / "big"
    big.mkdir()
    adapter_dir = adapters[2][0].lora_path  # rank 16
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (big / f).write_bytes((Path(adapter_dir) / f).read_bytes())
    config = json.loads((big / "adapter_config.json").read_text())
    config["r"] = 32
    (big / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="max_lora_rank"):
        llm.generate("hello", GREEDY, lora_request=LoRARequest("big", 10, str(big)), use_tqdm=False)
    (big / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    config["r"] = 16
    (big / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unreadable adapter_model.safetensors"):
        llm.generate("hello", GREEDY, lora_request=LoRARequest("corrupt", 11, str(big)), use_tqdm=False)
    with pytest.raises(ValueError, match="lora requests"):
        llm.generate(["a", "b"], GREEDY, lora_request=[None], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
    engine = llm.llm_engine
    engine.add_request("holder", [5, 6, 7], GREEDY, lora_request=adapters[0][0])
    with pytest.raises(ValueError, match="in use by another adapter"):  # same id, another directory
        engine.add_request("clash", [5, 6, 7], GREEDY, lora_request=LoRARequest("other", adapters[0][0].lora_int_id,
                                                                                adapters[1][0].lora_path))
    engine.abort_request("holder")
    assert not llm.llm_engine.has_unfinished_requests()


def test_lora_needs_enable_lora(model_dir, adapters):
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, num_threads=1)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("hello", GREEDY, lora_request=adapters[0][0], use_tqdm=False)


def test_kv_events_carry_the_adapter(llm, adapters, tiny_tokenizer):
    """vLLM's BlockStored.lora_id: the adapter's id for its blocks, None for the base model's."""
    from test_engine_events import recorded

    engine = llm.llm_engine
    engine.events.subscribe(True)
    try:
        prompts = mixed_prompts(tiny_tokenizer, n=2, lengths=(40, 40), seed=5)
        run(llm, prompts, [adapters[1][0], None])
        stored = [k for e in recorded(engine, private=True) for k in e.get("kv_events", ())
                  if k["type"] == "BlockStored"]
    finally:
        engine.events.unsubscribe(True)
    by_tokens = {tuple(k["token_ids"][:8]): k["lora_id"] for k in stored if k["parent_block_hash"] is None}
    assert by_tokens[tuple(prompts[0][:8])] == adapters[1][0].lora_int_id
    assert by_tokens[tuple(prompts[1][:8])] is None


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_adapter_on_other_families(arch, tiny_model_dir, tiny_tokenizer, tmp_path):
    """q/k/v bias (Qwen2: PEFT's delta adds to the biased projection) and per-head q/k norms after the projection
    (Qwen3: the delta is applied before them, as PEFT's q_proj/k_proj outputs are)."""
    base = tiny_model_dir(arch)
    adapter_dir, merged_dir = make_peft_adapter(base, tmp_path, rank=8, seed=7)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=128, num_threads=1)
    prompts = mixed_prompts(tiny_tokenizer, n=3, lengths=(5, 60), seed=6)
    outs = run(llm, prompts, [LoRARequest("a", 1, str(adapter_dir)), None, LoRARequest("a", 1, str(adapter_dir))])
    refs = [hf_greedy(merged_dir, [prompts[0]], MAX_TOKENS)[0], hf_greedy(base, [prompts[1]], MAX_TOKENS)[0],
            hf_greedy(merged_dir, [prompts[2]], MAX_TOKENS)[0]]
    assert_greedy_match(outs, refs, min_identical_frac=1.0, logprob_atol=1e-4)
