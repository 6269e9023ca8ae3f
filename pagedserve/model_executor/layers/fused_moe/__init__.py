"""Mixture-of-experts layers: the router (top-k, optional renormalisation) and the grouped expert computation."""
from pagedserve.model_executor.layers.fused_moe.experts import FusedMoE, fused_experts, grouped_experts
from pagedserve.model_executor.layers.fused_moe.layer import SparseMoeBlock, select_experts

__all__ = ["FusedMoE", "SparseMoeBlock", "fused_experts", "grouped_experts", "select_experts"]
