#!/usr/bin/env bash
# The main job on the embedded default pair (SmolLM2-135M-Instruct + this project's DFlash drafter):
#   build the engine directory -> write the Triton model repository -> serve it on the real Triton
#   Inference Server (tritonserver 2.51, its Python backend) -> one request with the real tritonclient
#   -> the answer with tau, the same through the OpenAI front, then the speedup over plain decoding
#   measured on the same engine in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
DFLASH=.venv/bin/dflash-trt
OUT=${DEMO_OUT:-out/demo}
PROMPT=${1:-"Write a Python function that returns the n-th Fibonacci number."}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$OUT"

echo "== 1. build (embedded default pair, CPU recipe) =="
$DFLASH build --spec smollm2-135m-cpu --out "$OUT/engine" --force --no-progress
$DFLASH verify "$OUT/engine"

echo "== 2. Triton model repository =="
$DFLASH deploy triton "$OUT/engine" --out "$OUT/triton_repo" --force --decoupled

echo "== 3. serve (tritonserver: gRPC, HTTP, metrics; the OpenAI front beside it; ephemeral ports) =="
rm -f "$OUT/ready"
$DFLASH serve --model-repository "$OUT/triton_repo" --grpc-port 0 --metrics-port 0 --http-port 0 --openai-port 0 \
  --exit-timeout-secs 5 --ready-file "$OUT/ready" >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  [ -s "$OUT/ready" ] && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited; see $OUT/server.log" >&2; tail -5 "$OUT/server.log" >&2; exit 1; }
  sleep 1
done
[ -s "$OUT/ready" ] || { echo "server not ready after 300 s; see $OUT/server.log" >&2; exit 1; }
URL=$(cut -d' ' -f1 "$OUT/ready")
HTTP="http://127.0.0.1:$(cut -d' ' -f3 "$OUT/ready")"
OPENAI="http://127.0.0.1:$(cut -d' ' -f4 "$OUT/ready")"
echo "tritonserver on $URL (gRPC) and $HTTP (HTTP); OpenAI front on $OPENAI"

echo "== 4. a Triton gRPC request (tritonclient) =="
$DFLASH client --url "$URL" --max-tokens 128 --stream "$PROMPT"

echo "== 4b. the same prompt through the OpenAI front (openai package) =="
$DFLASH client --url "$OPENAI" --max-tokens 128 "$PROMPT"

echo "== 5. speedup over plain decoding (same engine, same prompt, same run) =="
# The runtime `serve` runs (the batched runtime, adaptive policy: k <= K drafts a step, chosen from the
# costs it measures), not the reference loop's K = 15 every step: on a CPU a 16-token verify pass costs
# 2-3 plain steps, which the drafter's tau ~3 on this prompt barely repays (docs/runtime.md, issue 35).
$DFLASH generate --engine "$OUT/engine" --max-new-tokens 128 --policy adaptive --compare "$PROMPT" >/dev/null
