"""Token embedding, split by vocabulary rows under tensor parallelism."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model_executor.parallel_state import ParallelState


class VocabParallelEmbedding(nn.Module):
    """Token embedding holding `num_rows` consecutive vocabulary rows (all of them in one process). Under tensor
    parallelism each rank looks up the ids in its range, zeros the others, and an all-reduce sums the one
    non-zero contribution per token (exact: the other terms are zeros)."""

    def __init__(self, num_rows: int, dim: int, parallel: ParallelState) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_rows, dim))
        self.parallel = parallel
        self.start = parallel.tp_rank * num_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        return self.parallel.all_reduce(x)
