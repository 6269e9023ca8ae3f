#!/usr/bin/env bash
# Smoke test of a built wheel, as a new user gets it: a clean venv, every cache empty (pip's, torch's extension
# cache, HOME), no C++ compiler reachable (CXX=false: a just-in-time kernel build would fail, so the engine must load
# the wheel's prebuilt kernels). Installs the wheel, starts `pagedserve serve` (the embedded demo model), waits for
# /health 200, sends one completion and one streamed chat, and prints how long each stage took.
#
#   python -m build --wheel && scripts/wheel_smoke.sh dist/pagedserve-*.whl
set -euo pipefail
wheel=$(realpath "$1")
work=$(mktemp -d)
server=""
cleanup() {
  if [[ -n "$server" ]]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
export HOME="$work/home" XDG_CACHE_HOME="$work/cache" TORCH_EXTENSIONS_DIR="$work/torch_extensions" \
  PIP_NO_CACHE_DIR=1 CXX=false CC=false
mkdir -p "$HOME"
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

t0=$(now)
python3 -m venv "$work/venv"
# --no-compile: byte-compiling every installed module (torch's and transformers' thousands) was half of the install's
# time (86 -> 46 s, 2-core EPYC); the modules the server imports are compiled as it imports them instead
"$work/venv/bin/pip" install -q --no-compile "$wheel"
echo "install: $(since "$t0") s (venv + the wheel and its dependencies, no cache, not byte-compiled)"

port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
t0=$(now)
"$work/venv/bin/pagedserve" serve --port "$port" >"$work/serve.log" 2>&1 &
server=$!
"$work/venv/bin/python" - "$port" "$t0" "$work/serve.log" "$TORCH_EXTENSIONS_DIR" <<'EOF'
import json
import os
import sys
import time

import httpx

port, t0, log, ext_dir = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
url = f"http://127.0.0.1:{port}"
deadline = time.time() + 600
while True:
    try:
        if httpx.get(f"{url}/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.time() > deadline:
        sys.exit(f"not healthy after 600 s:\n{open(log).read()[-3000:]}")
    time.sleep(0.05)
print(f"serve -> /health 200: {time.time() - t0:.1f} s")
server_log = open(log).read()
if "prebuilt" not in server_log or "Building native kernels" in server_log:
    sys.exit(f"the server did not load the wheel's prebuilt kernels:\n{server_log[-3000:]}")
if os.path.isdir(ext_dir) and os.listdir(ext_dir):
    sys.exit(f"something was compiled into {ext_dir}: {os.listdir(ext_dir)}")
print("kernels:", next(line for line in server_log.splitlines() if "prebuilt" in line).strip())

model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
t = time.time()
r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": 16,
                                             "temperature": 0}, timeout=120)
r.raise_for_status()
text = r.json()["choices"][0]["text"]
assert text, r.json()
print(f"completion ({time.time() - t:.2f} s): {text!r}")

t = time.time()
pieces, done = [], False
with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                  json={"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
                        "temperature": 0, "stream": True}) as r:
    r.raise_for_status()
    for line in r.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            delta = json.loads(line[len("data: "):])["choices"][0]["delta"]
            pieces.append(delta.get("content") or "")
assert done and len(pieces) > 1 and "".join(pieces), pieces
print(f"streamed chat ({time.time() - t:.2f} s, {len(pieces)} chunks): {''.join(pieces)!r}")
EOF
echo "wheel smoke test passed"
