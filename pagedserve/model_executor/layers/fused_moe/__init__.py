"""Mixture-of-experts layers: the router (top-k, optional renormalisation) and the grouped expert computation."""
from pagedserve.model_executor.layers.fused_moe.layer import (
    SparseMoeBlock,
    fused_experts,
    select_experts,
)

__all__ = ["SparseMoeBlock", "fused_experts", "select_experts"]
