#!/usr/bin/env bash
# The rest of the test suite on a GPU machine (issue 18: "the whole suite's engine tests with --device cuda"): every
# test file that benchmarks/device_check.sh does not run, with the engine's default device (cuda there). Run it in
# a second call after device_check.sh, from the repository root, with the same wheels installed:
#
#     OUT=bench_results/device bash benchmarks/device_suite.sh       # -> $OUT/suite.log, failures summarised at its end
#
# One pytest run, 120 s per test, 420 s in all (the CPU machines take ~4 minutes for these files on 2 cores).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_results/device}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PYTHON=$PY bash benchmarks/device_wheelhouse.sh install "$OUT/wheelhouse.log"
ALREADY=" $(grep -o 'tests/[a-z_]*/test_[a-z0-9_]*\.py' benchmarks/device_check.sh | tr '\n' ' ') "  # device_check.sh's files
FILES=()
for f in tests/*/test_*.py; do
  [[ "$ALREADY" == *" $f "* ]] || FILES+=("$f")
done
PER_TEST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 120)  # the GPU image has pytest-timeout
timeout 420 "$PY" -m pytest -p no:cacheprovider "${PER_TEST[@]}" -rfE "${FILES[@]}" > "$OUT/suite.log" 2>&1
rc=$?
echo "suite rc=$rc (${#FILES[@]} files)" | tee -a "$OUT/suite.log"
tail -30 "$OUT/suite.log"
