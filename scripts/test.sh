#!/usr/bin/env bash
# The test suite as CI runs it (.ci/run), in two tiers: the fast tier first (no server processes, no builds beyond
# the default kernels, nothing marked slow), stopping at its first failure, then the rest. Each prints its 25
# slowest tests and writes a JUnit file under test-results/. Both run in pytest-xdist workers, each test file in one
# worker (--dist loadfile: a module's servers and fixtures stay in one process), and each worker's torch gets its
# share of the cores (conftest). The fast tier is in-process computation: FAST_WORKERS (2) keep two cores busy. The
# rest spends most of its time waiting on server and engine subprocesses: PYTEST_WORKERS (3) keep two cores busy.
#   scripts/test.sh                  both tiers
#   scripts/test.sh fast|rest        one tier
#   scripts/test.sh thorough ...     the same with hypothesis drawing new, more examples (HYPOTHESIS_PROFILE)
# Extra arguments go to pytest (e.g. scripts/test.sh fast -k scheduler).
set -euo pipefail
cd "$(dirname "$0")/.."
FAST="not slow and not server and not kernels_build"
if [ "${1:-}" = thorough ]; then
  export HYPOTHESIS_PROFILE=thorough
  shift
fi
tier=all
case "${1:-}" in fast | rest) tier=$1; shift ;; esac
mkdir -p test-results
if [ "$tier" != rest ]; then
  python -m pytest -x -m "$FAST" -n "${FAST_WORKERS:-2}" --dist loadfile --durations=25 \
    --junitxml=test-results/fast.xml "$@"
fi
if [ "$tier" != fast ]; then
  python -m pytest -m "not ($FAST)" -n "${PYTEST_WORKERS:-3}" --dist loadfile --durations=25 \
    --junitxml=test-results/rest.xml "$@"
fi
