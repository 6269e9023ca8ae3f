"""Every module-level httpx call in the suite names its timeout. httpx's default is 5 s: on a loaded 2-core CI
machine a server's first /openapi.json (FastAPI builds the schema then) took longer, and a test failed on the
timing window, not on what it checks."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
METHODS = {"get", "post", "put", "patch", "delete", "head", "options", "request", "stream"}


def calls_without_timeout(source: str) -> list[int]:
    """Line numbers of `httpx.<method>(...)` calls that pass no timeout (a **kwargs may carry one)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "httpx" and node.func.attr in METHODS
            and not any(k.arg in ("timeout", None) for k in node.keywords)]


def test_the_check_finds_a_call_without_timeout():
    assert calls_without_timeout("import httpx\nhttpx.get('u')\nhttpx.post('u', json={}, timeout=60)\n") == [2]


def test_every_httpx_call_in_the_suite_names_its_timeout():
    missing = [f"{path.relative_to(TESTS)}:{line}" for path in sorted(TESTS.rglob("*.py"))
               for line in calls_without_timeout(path.read_text())]
    assert not missing, missing
