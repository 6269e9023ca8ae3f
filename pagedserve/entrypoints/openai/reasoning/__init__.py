"""Reasoning parsers (`--reasoning-parser`, vLLM's names): split a chat answer's text into `reasoning_content`
and `content`, streamed or whole, through the same state machine (so the deltas concatenate to the whole)."""
from pagedserve.entrypoints.openai.reasoning.parsers import (REASONING_PARSERS, ReasoningDelta, ReasoningParser,
                                                             make_reasoning_parser)

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "make_reasoning_parser"]
