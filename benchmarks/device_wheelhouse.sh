#!/usr/bin/env bash
# The packages that the GPU machine's image lacks, as wheels in .device_wheelhouse/:
#
#     bash benchmarks/device_wheelhouse.sh                 # here: download them for its Python 3.12 (~9 MB)
#     bash benchmarks/device_wheelhouse.sh install LOG     # there (device_check.sh, device_suite.sh): install them
#
# The image has torch, triton, transformers, tokenizers, safetensors, numpy, httpx, anyio, prometheus-client and
# pytest (the device library's KINDS.md lists them); it had none of these. The versions are the ones installed
# here. Carry the folder with the run (`carry: [".device_wheelhouse"]`; .gitignore keeps it out of git).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = install ]; then  # no index there: exactly these files, nothing resolved
  [ -d .device_wheelhouse ] || exit 0
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps .device_wheelhouse/*.whl > "${2:-/dev/null}" 2>&1 \
    || { echo "wheelhouse install failed (see ${2:-its output})"; exit 1; }
  exit 0
fi
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
