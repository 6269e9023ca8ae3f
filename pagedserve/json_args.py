"""JSON-object engine arguments (vLLM's --speculative-config, --kv-transfer-config): one parse, one set of errors."""
from __future__ import annotations

import json


def parse_json_object(value: dict | str, name: str, known: set[str] | None) -> dict:
    """A dict, or its JSON text, with only `known` fields (None: any); ValueError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object.")
    unknown = sorted(set(value) - known) if known is not None else []
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {unknown}; known: {sorted(known)}.")
    return value
