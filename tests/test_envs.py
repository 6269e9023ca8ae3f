"""Environment variables: declared in pagedserve/envs.py only, read lazily."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pagedserve
from pagedserve import envs

PACKAGE_DIR = Path(pagedserve.__file__).resolve().parent


def _reads_environment(tree: ast.AST) -> list[int]:
    """Lines that touch os.environ or call os.getenv / getenv."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment():
    offenders = {str(path.relative_to(PACKAGE_DIR)): lines for path in sorted(PACKAGE_DIR.rglob("*.py"))
                 if path.name != "envs.py" and (lines := _reads_environment(ast.parse(path.read_text())))}
    assert not offenders, f"read environment variables through pagedserve.envs, not os.environ: {offenders}"


def test_every_variable_has_a_meaning_and_reads_its_default(monkeypatch):
    for name, (meaning, _) in envs.ENVIRONMENT_VARIABLES.items():
        assert meaning, name
        monkeypatch.delenv(name, raising=False)
        getattr(envs, name)  # the default parses
    assert envs.PAGEDSERVE_DIST_TIMEOUT_S == 300.0 and envs.PAGEDSERVE_CPU_KERNELS is True
    with pytest.raises(AttributeError):
        envs.PAGEDSERVE_NO_SUCH_VARIABLE


def test_variables_are_read_when_asked(monkeypatch):
    """A variable set after the import is obeyed (tests and launchers set them late)."""
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "2.5")
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", " AVX2 ")
    assert envs.PAGEDSERVE_CPU_KERNELS is False
    assert envs.PAGEDSERVE_DIST_TIMEOUT_S == 2.5
    assert envs.PAGEDSERVE_CPU_ISA == "avx2"
    monkeypatch.delenv("PAGEDSERVE_CPU_KERNELS")
    assert envs.PAGEDSERVE_CPU_KERNELS is True
