"""CUDA graphs for decode-only steps: one captured forward per (padded batch size, padded block-table width).

A decode step of a small model is hundreds of small kernels launched from Python, and the launches, not the GPU,
set its time. A CUDA graph records the launches once and replays them with one call. A graph replays fixed
addresses and shapes, so the step's inputs are copied into static buffers of a captured shape: the row count is
padded up to the nearest capture size (vLLM's list: 1, 2, 4, then multiples of 8), the block table's width up to
a power of two, at least the attention backend's `cuda_graph_min_width_tokens` (the Triton backend's: one decode
partition, which fixes its decode kernel's split-K grid, so short contexts keep few partitions). A padding row has slot -1 (writes no K/V) and context length 0 (attends to nothing, output
0); its logits are dropped.

Graphs are captured lazily, the first time a decode step of that shape arrives (one warm-up forward that also
compiles the backend's kernels, then the capture), and share one memory pool. Steps with prefill chunks, more
rows than the largest capture size, or parallel ranks run eagerly; so does everything with `enforce_eager`
(vLLM's --enforce-eager), and every backend that does not support graphs (`supports_cuda_graphs`: its K/V write
must skip padding rows). The CPU never gets here (the runner builds no DecodeGraphs there).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.model_executor.attention.backend import AttentionBackend
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.input_batch import InputBatch

logger = logging.getLogger("pagedserve")

MAX_CAPTURE_SIZE = 256  # decode rows; a bigger step is compute-bound enough that launches no longer dominate
CAPTURE_SIZES = (1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8))


def wants_cuda_graphs(attn_backend: AttentionBackend, device: torch.device, enforce_eager: bool,
                      world_size: int) -> bool:
    """Graphs on a GPU with an attention backend that supports them, one rank (collectives stay eager), unless
    enforce_eager."""
    return device.type == "cuda" and not enforce_eager and world_size == 1 and attn_backend.supports_cuda_graphs


def padded_batch_size(num_rows: int) -> int | None:
    """The smallest capture size holding num_rows rows; None when the step is too big for any graph."""
    return next((size for size in CAPTURE_SIZES if size >= num_rows), None)


def padded_width(num_blocks: int, block_size: int, min_width_tokens: int) -> int:
    """Block-table width of the graph serving a table num_blocks wide: the next power of two, at least
    min_width_tokens (block tables narrower than that share a graph, so short contexts do not multiply the
    captures)."""
    return max(1 << max(0, num_blocks - 1).bit_length(), -(-min_width_tokens // block_size))


@dataclass
class DecodeGraphInputs:
    """The static buffers one graph reads: a decode-only step of `rows` rows and block tables `width` wide."""
    input_ids: torch.Tensor  # [rows] long
    positions: torch.Tensor  # [rows] long
    slot_mapping: torch.Tensor  # [rows] long, -1 on padding rows
    block_tables: torch.Tensor  # [rows, width] long
    context_lens: torch.Tensor  # [rows] long, 0 on padding rows
    logits_indices: torch.Tensor  # [rows]: every row (the real rows' logits are picked after the replay)

    @classmethod
    def allocate(cls, rows: int, width: int, device: torch.device) -> DecodeGraphInputs:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        inputs = cls(longs(rows), longs(rows), longs(rows), longs(rows, width), longs(rows),
                     torch.arange(rows, device=device))
        inputs.slot_mapping.fill_(-1)
        return inputs

    def metadata(self, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping, self.input_ids.shape[0], self.block_tables, self.context_lens,
                                 block_size, [])

    def load(self, batch: InputBatch) -> None:
        """Copies a decode-only step into the buffers (device to device, no host sync) and resets the rest, so
        that rows and table columns left over from a bigger earlier step are padding again."""
        meta = batch.attn_metadata
        n, width = meta.decode_block_tables.shape
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.block_tables[:n, width:].zero_()
        for buffer in (self.input_ids, self.positions, self.context_lens, self.block_tables):
            buffer[n:].zero_()
        self.slot_mapping[n:].fill_(-1)


@dataclass
class CapturedDecode:
    inputs: DecodeGraphInputs
    replay: Callable[[], torch.Tensor]  # runs the step on the buffers; returns the static logits [rows, vocab]


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Runs the decode-only steps that fit a graph (`fits`) through captured graphs (`run`).

    capture=False replays by running the forward on the static buffers without a graph: the padding and buffer
    logic, testable on a CPU (Triton's interpreter), minus the recording itself."""

    def __init__(self, forward: Forward, block_size: int, device: torch.device, attn_backend: AttentionBackend,
                 capture: bool = True) -> None:
        self.forward = forward
        self.block_size = block_size
        self.device = device
        self.min_width_tokens = attn_backend.cuda_graph_min_width_tokens
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[int, int], CapturedDecode] = {}

    @staticmethod
    def fits(batch: InputBatch) -> bool:
        meta = batch.attn_metadata
        return not meta.prefills and 0 < meta.num_decodes <= MAX_CAPTURE_SIZE

    def run(self, batch: InputBatch) -> torch.Tensor:
        """The step's logits, rows as in batch.logits_indices."""
        meta = batch.attn_metadata
        key = (padded_batch_size(meta.num_decodes),
               padded_width(meta.decode_block_tables.shape[1], self.block_size, self.min_width_tokens))
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(*key)
        graph.inputs.load(batch)
        return graph.replay()[batch.logits_indices]

    def _capture(self, rows: int, width: int) -> CapturedDecode:
        inputs = DecodeGraphInputs.allocate(rows, width, self.device)
        meta = inputs.metadata(self.block_size)

        def step() -> torch.Tensor:
            return self.forward(inputs.input_ids, inputs.positions, meta, inputs.logits_indices)

        if not self.capture:
            return CapturedDecode(inputs, step)
        # warm up on a side stream (compiles the backend's kernels, lets cuBLAS pick its kernels) before recording;
        # every row is padding here, so nothing is written to the KV cache
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        logger.info("Captured a CUDA graph for decode steps of %d rows, block tables %d wide (%d graphs)",
                    rows, width, len(self.graphs) + 1)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return CapturedDecode(inputs, replay)
