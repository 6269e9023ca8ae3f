"""The CLI's process-wide settings: what `pagedserve ...` sets before torch loads."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _gomp_spincount_seen_by_a_command(env_value: str | None) -> str:
    code = ("import os, sys\n"
            "from pagedserve.entrypoints.cli import main\n"
            "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "sys.stderr.write('GOMP=' + os.environ.get('GOMP_SPINCOUNT', '<unset>'))\n")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if env_value is not None:
        env["GOMP_SPINCOUNT"] = env_value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return out.stderr.rsplit("GOMP=", 1)[1]


@pytest.mark.slow
def test_cli_sets_a_short_openmp_spin_unless_the_user_chose_one():
    assert _gomp_spincount_seen_by_a_command(None) == "10000"
    assert _gomp_spincount_seen_by_a_command("200000") == "200000"
