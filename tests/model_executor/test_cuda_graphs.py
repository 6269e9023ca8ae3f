"""CUDA graphs for decode steps (pagedserve/model_executor/cuda_graphs.py), the parts a CPU can check: when graphs
are used, the capture sizes and padding, the static buffers' input copy, and whole generations through the
padded static-buffer forward (Triton's interpreter, no recording) against Hugging Face. The recording and replay
themselves need a GPU (benchmarks/device_check.sh)."""
from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts

from pagedserve.config import EngineArgs
from pagedserve.model_executor.attention.selector import get_attention_backend
from pagedserve.model_executor.cuda_graphs import (
    CAPTURE_SIZES,
    MAX_CAPTURE_SIZE,
    DecodeGraphInputs,
    DecodeGraphs,
    padded_batch_size,
    padded_width,
    wants_cuda_graphs,
)
from pagedserve.model_executor.input_batch import TokenSpan, prepare_batch

# Triton's interpreter must be on before triton is first imported (it patches triton.language then)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def test_capture_sizes_and_padding():
    assert CAPTURE_SIZES[:5] == (1, 2, 4, 8, 16) and CAPTURE_SIZES[-1] == MAX_CAPTURE_SIZE
    assert [padded_batch_size(n) for n in (1, 2, 3, 5, 8, 9, 17, 255, 256)] == [1, 2, 4, 8, 8, 16, 24, 256, 256]
    assert padded_batch_size(MAX_CAPTURE_SIZE + 1) is None
    assert [padded_width(n, 128, 512) for n in (1, 2, 3, 4, 5, 100)] == [4, 4, 4, 4, 8, 128]  # >= 512 tokens
    assert [padded_width(n, 16, 512) for n in (1, 32, 33, 100)] == [32, 32, 64, 128]
    assert [padded_width(n, 16, 0) for n in (1, 2, 3, 100)] == [1, 2, 4, 128]


def test_graphs_only_for_one_cuda_rank_unless_enforce_eager():
    """Graphs where the attention backend supports them (its K/V write skips padding rows: Triton; not the
    reference backend), on one CUDA rank, unless enforce_eager."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    reference = get_attention_backend("torch", cpu)
    assert not reference.supports_cuda_graphs and not wants_cuda_graphs(reference, cuda, False, 1)
    assert not wants_cuda_graphs(get_attention_backend("cpu", cpu), cpu, False, 1)
    pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[triton]')")
    triton = get_attention_backend("triton", cpu)
    assert wants_cuda_graphs(triton, cuda, False, 1)
    assert not wants_cuda_graphs(triton, cpu, False, 1)
    assert not wants_cuda_graphs(triton, cuda, True, 1)
    assert not wants_cuda_graphs(triton, cuda, False, 2)


def test_enforce_eager_flag():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    assert parser.parse_args([]).enforce_eager is False


def decode_step(spans: list[tuple[int, int, list[int]]], block_size: int = 4):
    """A decode-only batch: (token, position, block table) per row."""
    return prepare_batch([TokenSpan([tok], pos, table, 1) for tok, pos, table in spans], block_size,
                         torch.device("cpu"))


def test_static_inputs_load_and_reset_padding():
    inputs = DecodeGraphInputs.allocate(4, 8, torch.device("cpu"))
    big = decode_step([(5, 9, [3, 4, 7]), (6, 0, [2]), (7, 4, [1, 5])])
    assert DecodeGraphs.fits(big)
    inputs.load(big)
    assert inputs.input_ids.tolist() == [5, 6, 7, 0]
    assert inputs.positions.tolist() == [9, 0, 4, 0]
    assert inputs.slot_mapping.tolist() == [7 * 4 + 1, 2 * 4, 5 * 4, -1]
    assert inputs.context_lens.tolist() == [10, 1, 5, 0]
    assert inputs.block_tables.tolist() == [[3, 4, 7, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0],
                                            [1, 5, 0, 0, 0, 0, 0, 0], [0] * 8]
    small = decode_step([(8, 1, [6])])  # rows and columns of the bigger step are padding again
    inputs.load(small)
    assert inputs.input_ids.tolist() == [8, 0, 0, 0] and inputs.positions.tolist() == [1, 0, 0, 0]
    assert inputs.slot_mapping.tolist() == [6 * 4 + 1, -1, -1, -1]
    assert inputs.context_lens.tolist() == [2, 0, 0, 0]
    assert inputs.block_tables.tolist() == [[6] + [0] * 7] + [[0] * 8] * 3
    meta = inputs.metadata(4)
    assert meta.num_decodes == 4 and not meta.prefills and meta.decode_block_tables is inputs.block_tables


def test_prefill_steps_and_big_batches_run_eagerly():
    prefill = prepare_batch([TokenSpan(list(range(20)), 0, [1, 2, 3, 4, 5], 1)], 4, torch.device("cpu"))
    assert not DecodeGraphs.fits(prefill)
    big = decode_step([(1, 0, [1])] * (MAX_CAPTURE_SIZE + 1))
    assert not DecodeGraphs.fits(big)


@pytest.mark.slow
@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="recording a CUDA graph needs a GPU"))])
def test_padded_static_decode_matches_transformers(capture, tiny_model_dir, tiny_tokenizer):
    """Whole generations whose decode steps run through the graph path's padded static buffers (rows padded to
    8 and 4, block tables to 128 blocks of 4, padding rows' K/V writes skipped) on the Triton kernels, attention
    and the layers' small ops (in the interpreter without a GPU; captured and replayed as CUDA graphs with one):
    greedy tokens equal HF's float32 ones."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[triton]')")
    from pagedserve import LLM, SamplingParams
    from pagedserve.model_executor import triton_layer_ops

    model_dir = tiny_model_dir("qwen3")  # GQA, q/k norms, head_dim 32
    prompts = mixed_prompts(tiny_tokenizer, n=5, lengths=(5, 24))
    # a 128-token budget still takes the five prompts' prefills in one step, and holds the engine warm-up's
    # full-budget step (in Triton's interpreter without a GPU: most of this test's time) to 128 tokens, not 252
    llm = LLM(str(model_dir), dtype="float32", num_threads=1, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=128, attention_backend="triton")
    runner = llm.llm_engine.runner
    assert runner.attn_backend.fused_ops(torch.zeros(1)) is triton_layer_ops  # RMSNorm, rotary, silu * mul too
    if not capture:
        runner.decode_graphs = DecodeGraphs(runner.run_model, runner.block_size, runner.device,
                                            runner.attn_backend, capture=False)
    assert runner.decode_graphs is not None and runner.decode_graphs.capture == capture
    runner.decode_graphs.graphs.clear()  # only this generation's shapes (not the engine warm-up's)
    max_tokens = [3, 6, 6, 6, 6]  # 5 decode rows (padded to 8), then 4 (no padding)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=[
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens])
    assert set(runner.decode_graphs.graphs) == {(8, 128), (4, 128)}
    hf = [dataclasses.replace(ref, token_ids=ref.token_ids[:n])
          for ref, n in zip(hf_greedy(model_dir, prompts, max(max_tokens)), max_tokens)]
    assert_greedy_match([o.outputs[0] for o in outs], hf)
