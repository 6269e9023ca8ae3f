"""The suite's collection rules (tests/conftest.py): a case that cannot exist on this machine is not generated."""
from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parent / "conftest.py"


def test_an_empty_parameter_set_is_deselected_not_skipped(pytester):
    pytester.makeconftest(f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
""")
    pytester.makepyfile("""
import pytest

@pytest.mark.parametrize("isa", [])  # no level of this kind on the machine
@pytest.mark.parametrize("rows", [1, 16])
def test_kernel(isa, rows):
    raise AssertionError("never generated")

@pytest.mark.skip(reason="this machine lacks X")
def test_lacking():
    pass

def test_runs():
    pass
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-o", "addopts=")
    result.assert_outcomes(passed=1, skipped=1, deselected=2)
