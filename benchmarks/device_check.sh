#!/usr/bin/env bash
# The GPU checks (issues 18 and 13) in one run (the steps' limits add up to 740 s; ~8 min on an H200), from the repository root:
#
#     OUT=bench_results/device bash benchmarks/device_check.sh      # the device tool sets $OUT itself
#
# 1. the Triton kernel (attention, small ops) and CUDA-graph tests on the real GPU (compiled kernels, bfloat16
#    tensor-core dots, real graph capture and replay);
# 2. structured output's tests on CUDA (masks added to the logits on the GPU, the test server on the GPU too);
#    greedy outputs on CUDA (float32 with graphs and eager, bfloat16) vs HF float32 for every tiny architecture
#    (benchmarks/device_check.py correctness), and the engine's correctness tests with the default device (cuda);
# 3. on a random-weight qwen3-0.6b shape in bfloat16: the device's roofline, decode step time vs batch size with
#    and without CUDA graphs, prefill throughput, `bench serve` against a `pagedserve serve --device cuda`
#    and transformers' continuous batching on the same workload (benchmarks/side_by_side.py);
# 4. DIR/summary.md + summary.json from the JSON files of every step (benchmarks/device_check.py summarize).
#
# Each step has its own time limit and its exit status goes to steps.txt; a failing step does not stop the
# others. The image must have torch with CUDA, triton and this project's pure-Python dependencies; a folder of
# wheels carried as .device_wheelhouse/ (docs/GPU.md says how to build it) is installed first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_results/device}
mkdir -p "$OUT"
: > "$OUT/steps.txt"
PY=${PYTHON:-python3}
CLI=("$PY" -m pagedserve.entrypoints.cli)

step() {  # step NAME SECONDS CMD...: runs CMD with a time limit, its output in NAME.log, its status in steps.txt
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/steps.txt"
}

PYTHON=$PY bash benchmarks/device_wheelhouse.sh install "$OUT/wheelhouse.log"
"$PY" - > "$OUT/env.json" <<'EOF'
import datetime, importlib, json
import torch
info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
for mod in ("triton", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "openai", "pytest"):
    try:
        info[mod] = getattr(importlib.import_module(mod), "__version__", "installed")
    except Exception as e:
        info[mod] = f"MISSING ({type(e).__name__})"
print(json.dumps(info, indent=2))
EOF
cat "$OUT/env.json"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

# 1. kernels and graph logic on the GPU (compiles every kernel variant the tests use)
step kernel_tests 90 "$PY" -m pytest -v --tb=short -p no:cacheprovider tests/model_executor/test_triton_attention.py \
  tests/model_executor/test_triton_layer_ops.py tests/model_executor/test_cuda_graphs.py

# 2. structured output's masks on CUDA (the engine and the test server default to the GPU), correctness on CUDA
step structured_output_cuda 120 "$PY" -m pytest -v --tb=short -p no:cacheprovider tests/engine/test_structured_output.py
step correctness 90 "$PY" benchmarks/device_check.py correctness --out "$OUT"
step engine_tests_cuda 120 "$PY" -m pytest -v --tb=short -p no:cacheprovider tests/model_executor/test_correctness.py \
  tests/engine/test_llm_api.py tests/engine/test_engine_boundary.py tests/engine/test_spec_decode.py tests/model_executor/test_tiny_models.py \
  tests/engine/test_kv_sharing.py

# 3. performance on a 0.5B-class shape, bfloat16
M=$OUT/qwen3-0.6b
step make_model 40 "${CLI[@]}" bench make-model --shape qwen3-0.6b --dtype bfloat16 --out "$M"
step roofline 30 "${CLI[@]}" bench roofline --shape "$M" --device cuda --dtype bfloat16 --sizes 4096,8192 \
  --bw-mib 2048 --output-json "$OUT/roofline.json"
SWEEP=(bench latency --model "$M" --device cuda --dtype bfloat16 --max-model-len 2048 --num-kv-blocks 10000
       --batch-sizes 1,2,4,8,16,32,64,128,256 --input-len 512 --output-len 32 --roofline-json "$OUT/roofline.json"
       --disable-tqdm)
step decode_graphs 45 "${CLI[@]}" "${SWEEP[@]}" --output-json "$OUT/decode_graphs.json"
step decode_eager 45 "${CLI[@]}" "${SWEEP[@]}" --enforce-eager --output-json "$OUT/decode_eager.json"
step prefill 30 "${CLI[@]}" bench throughput --model "$M" --device cuda --dtype bfloat16 --max-model-len 4096 \
  --num-kv-blocks 9000 --max-num-batched-tokens 8192 --input-len 2048 --output-len 1 --num-prompts 64 \
  --roofline-json "$OUT/roofline.json" --output-json "$OUT/prefill_throughput.json" --disable-tqdm
step side_by_side 130 "$PY" benchmarks/side_by_side.py --model "$M" --device cuda --dtype bfloat16 \
  --engines pagedserve,hf-cb --concurrency 32 --num-prompts 64 --dataset random --random-input-len 512 \
  --random-output-len 128 --max-model-len 1024 --roofline-json "$OUT/roofline.json" --skip-batch1 \
  --output-dir "$OUT/side_by_side"
rm -rf "$M"  # the checkpoint (1.2 GB) does not come back

# 4. the report
"$PY" benchmarks/device_check.py summarize --out "$OUT"
