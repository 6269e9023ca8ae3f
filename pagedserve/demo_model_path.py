"""Location of the small demo model that ships inside the package (see demo_model/MODEL_CARD.md)."""

from __future__ import annotations

from pathlib import Path

_DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"


def default_model_path() -> str:
    """Absolute path of the packaged demo checkpoint (``pagedserve/demo_model``).

    Used when ``LLM()`` / ``pagedserve serve`` get no model: it is a normal Hugging Face
    checkpoint directory (LlamaForCausalLM + tokenizer), so it loads with no network.
    """
    return str(_DEMO_MODEL_DIR)
