"""Shared fixtures: the home-made tiny tokenizer and tiny random-weight checkpoints.

    def test_x(tiny_model_dir, tiny_tokenizer):
        path = tiny_model_dir("qwen3")                  # built once per session (per arch+overrides)
        prompts = mixed_prompts(tiny_tokenizer, n=8)

See tests/tiny_models.py (checkpoints) and tests/hf_reference.py (HF greedy reference + matcher).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# Tests live in one folder per subsystem (core/, model_executor/, engine/, entrypoints/, benchmarks/); the shared
# helpers (tiny_models, hf_reference, server_helpers) sit here, and a few test modules import another's fixtures:
# every folder is importable by module name.
_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS, *sorted(p for p in _TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))):
    sys.path.insert(0, str(_folder))

from tiny_models import ARCHS, build_tiny_tokenizer, make_tiny_checkpoint  # noqa: E402


@pytest.fixture
def one_thread():
    """Tiny matrices on a shared 2-core box: one intra-op thread is far faster (use with usefixtures)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """Directory holding the tiny tokenizer files (tokenizer.json, tokenizer_config.json, chat template)."""
    d = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """The tiny tokenizer as the engine sees it: AutoTokenizer.from_pretrained(saved dir)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """Factory: ``tiny_model_dir(arch, **kwargs) -> Path`` of a checkpoint, built once per session.

    ``arch`` in ``tiny_models.ARCHS``; kwargs go to ``make_tiny_checkpoint`` (config overrides,
    ``seed``, ``max_shard_size``, ``legacy_rope_config``).  Cached per (arch, kwargs).
    Treat the directories as read-only (copy one before editing it).
    """
    cache: dict[tuple, Path] = {}

    def get(arch: str, **kwargs) -> Path:
        if arch not in ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
        key = (arch, json.dumps(kwargs, sort_keys=True, default=repr))
        if key not in cache:
            name = arch if not kwargs else f"{arch}-{len(cache)}"
            out = tmp_path_factory.mktemp(f"tiny_{name}")
            cache[key] = make_tiny_checkpoint(arch, out, tokenizer=tiny_tokenizer, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """One `pagedserve serve` process on the tiny llama, shared by the server test modules."""
    from server_helpers import get_server, stop_all

    srv = get_server(tiny_model_dir("llama"))
    yield srv
    stop_all()
