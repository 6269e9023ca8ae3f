"""Shared fixtures: the home-made tiny tokenizer and tiny random-weight checkpoints.

    def test_x(tiny_model_dir, tiny_tokenizer):
        path = tiny_model_dir("qwen3")                  # built once per session (per arch+overrides)
        prompts = mixed_prompts(tiny_tokenizer, n=8)

See tests/tiny_models.py (checkpoints) and tests/hf_reference.py (HF greedy reference + matcher).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Tests live in one folder per subsystem (core/, model_executor/, engine/, entrypoints/, benchmarks/); the shared
# helpers (tiny_models, hf_reference, server_helpers) sit here, and a few test modules import another's fixtures:
# every folder is importable by module name.
_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS, *sorted(p for p in _TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))):
    sys.path.insert(0, str(_folder))

from tiny_models import ARCHS, MOE_ARCHS, build_tiny_tokenizer, make_tiny_checkpoint  # noqa: E402

# Hypothesis: the same examples on every run of a commit ("ci", the default: a red run reproduces, a green one
# cannot turn red by chance); HYPOTHESIS_PROFILE=thorough draws new, more examples (scripts/test.sh thorough).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("thorough", max_examples=1000, derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Without a GPU the Triton kernels' tests run in Triton's interpreter, which must be on before triton is first
# imported and when each kernel module is imported (the decorator reads it), whichever test imports one first: set
# for this process here. Server subprocesses do not inherit it (server_helpers.ServerProcess).
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session):
    """Builds (or loads) the native kernels the selected tests need once, before the first test: the engine's
    default level unless only the pure-Python tests (core/) run, and the levels named by `kernels_build(isa, ...)`
    marks. A cold build (~75 s each, minutes on a loaded machine) then counts against no test's timeout, and the
    builds stay cached across sessions (kernels.py: keyed by sources and flags)."""
    if session.config.option.collectonly:
        return
    levels = {isa for item in session.items for mark in item.iter_markers("kernels_build") for isa in mark.args}
    if levels or any(Path(item.path).parent.name != "core" for item in session.items):
        from pagedserve.model_executor.kernels import load_cpu_kernels

        load_cpu_kernels()
        for isa in sorted(levels):
            load_cpu_kernels(isa)


SERVER_STARTERS = ("ServerProcess", "get_server", "start_servers", "start_cli_process")  # server_helpers' ways to start one


EMPTY_PARAMETER_SET = "got empty parameter set"  # pytest's reason when a parametrize list is empty


def pytest_collection_modifyitems(config, items):
    """Cases that cannot exist on this machine are not generated: a parametrize list built from the machine's
    capabilities (kernel levels, AMX, GEMM dtypes) that comes out empty would otherwise be a skipped case per test, so
    they are deselected. Server tests (the tiers: pyproject's markers) found without a mark too: a test that takes
    the shared `server` fixture, or any test of a module that imports a way to start a server process from
    server_helpers."""
    impossible = [item for item in items if any(str(mark.kwargs.get("reason", "")).startswith(EMPTY_PARAMETER_SET)
                                                for mark in item.iter_markers("skip"))]
    if impossible:
        config.hook.pytest_deselected(items=impossible)
        dropped = set(impossible)
        items[:] = [item for item in items if item not in dropped]
    for item in items:
        module = getattr(item, "module", None)
        if "server" in getattr(item, "fixturenames", ()) or any(hasattr(module, n) for n in SERVER_STARTERS):
            item.add_marker(pytest.mark.server)


def pytest_configure(config):
    """In pytest-xdist workers (scripts/test.sh runs the tiers in several), each worker's torch gets its share of the
    cores: with every worker at torch's default (all cores) the intra-op pools oversubscribe the CPU and each spins
    waiting for cores another holds."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.fixture(autouse=True)
def restore_process_state():
    """Every test leaves the process state as it found it: os.environ and torch's intra-op thread count."""
    env = dict(os.environ)
    threads = torch.get_num_threads()
    yield
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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
        if arch not in ARCHS + MOE_ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS + MOE_ARCHS}")
        key = (arch, json.dumps(kwargs, sort_keys=True, default=repr))
        if key not in cache:
            name = arch if not kwargs else f"{arch}-{len(cache)}"
            out = tmp_path_factory.mktemp(f"tiny_{name}")
            cache[key] = make_tiny_checkpoint(arch, out, tokenizer=tiny_tokenizer, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir):
    """The tiny llama checkpoint most engine and server tests run on (a module may define its own)."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """One `pagedserve serve` process on the tiny llama, shared by the server test modules."""
    from server_helpers import get_server

    return get_server(tiny_model_dir("llama"))


@pytest.fixture(scope="session", autouse=True)
def shared_servers_exit_cleanly():
    """The servers the session's tests share (server_helpers.get_server) stop at its end, each with exit code 0."""
    yield
    helpers = sys.modules.get("server_helpers")
    if helpers is not None:
        codes = helpers.stop_all()
        assert all(code == 0 for code in codes.values()), codes
