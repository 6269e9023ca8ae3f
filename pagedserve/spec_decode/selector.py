"""The proposer for a speculative config: one class per `speculative_config.method`."""
from __future__ import annotations

from pagedserve.config import SpeculativeConfig
from pagedserve.spec_decode.draft_model import DraftModelDrafter
from pagedserve.spec_decode.drafter import Drafter, DrafterContext, NgramDrafter

DRAFTERS: dict[str, type[Drafter]] = {"ngram": NgramDrafter, "draft_model": DraftModelDrafter}


def make_drafter(config: SpeculativeConfig, context: DrafterContext) -> Drafter:
    return DRAFTERS[config.method](config, context)
