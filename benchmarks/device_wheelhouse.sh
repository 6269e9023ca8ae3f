#!/usr/bin/env bash
# Downloads the pure-Python (and small binary) packages that the GPU machine's image lacks into .device_wheelhouse/,
# for its Python 3.12, at the versions installed here; benchmarks/device_check.sh installs them first. The image
# has torch, triton, transformers, tokenizers, safetensors, numpy, httpx, anyio, prometheus-client and pytest
# (the device library's KINDS.md lists them); it had none of these. About 9 MB; carry it with the run
# (`carry: [".device_wheelhouse"]`, and `echo /.device_wheelhouse/ >> .git/info/exclude` once).
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection typing_extensions openai
      jiter distro sniffio httpx2 httpcore2 truststore opentelemetry-api idna anyio h11 llguidance jsonschema
      jsonschema-specifications referencing rpds-py)
pins=()
for p in "${PKGS[@]}"; do  # the version installed here, else the newest
  v=$(python3 -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}' || true)
  pins+=("$p${v:+==$v}")
done
rm -rf .device_wheelhouse
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device_wheelhouse "${pins[@]}"
ls .device_wheelhouse
