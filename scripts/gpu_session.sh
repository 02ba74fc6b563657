#!/usr/bin/env bash
# What one GPU session (one H100, ~25 minutes) should run, in order: the measurements the CPU cannot
# make, then a drafter leg. Every stage logs "stage: NAME rc=N" so a caller can follow it.
#
#   GREEDY_DIR=.cache/train WORK=/tmp/gpu-session scripts/gpu_session.sh
#
# 1. setup-default (converts the embedded target once; prints its directory)
# 2. CUDA graphs vs eager, committed drafter: `dflash-trt bench --runtime batched` C = 1 8, 64 tokens
#    (bbg0 / bbg1; each writes $WORK/NAME/bench.json, `dflash-trt bench report` prints it again)
# 3. the DFlash runtime forced plain (--policy fixed:0) vs the plain runtime at C=8: its own overhead,
#    the open question behind the last GPU sweep's C=8 0.87x (bbk0)
# 4. scripts/gpu_drafter.sh: sampled answers, then a train-draft leg from the embedded drafter ($WORK/A)
# 5. the full sweep C = 1 4 8 16 32, 128 tokens, with the new drafter (graphs on if step 2 was
#    lossless) (bb_A)
# Then, on any machine: dflash-trt bench --tau-only --num-prompts 12 --max-new-tokens 256 --target T --draft
# $WORK/A, and keep the drafter only if held-out tau beats the embedded one's (MANIFEST.json: held_out.tau).
#
# GREEDY_DIR holds the greedy answers' responses.pt (features not needed). Knobs (environment):
# PY, WORK, THREADS, DEVICE (cuda; cpu runs the same flow slowly: a dry run), SHORT_TOKENS (64),
# SWEEP ("1 4 8 16 32"), SWEEP_TOKENS (128), and gpu_drafter.sh's VARIANTS ("A:2:768"; the sweep uses A; e.g.
# "A:2:768 B:3:768" also grows a third layer side by side (init-from needs equal shapes), to measure capacity headroom), SAMPLES, BATCH_PROMPTS, GEN_SECONDS, TRAIN_SECONDS, BATCH.
set -uo pipefail
: "${GREEDY_DIR:?set GREEDY_DIR to the directory holding the greedy responses.pt}"
PY=${PY:-python3}
WORK=${WORK:-/tmp/gpu-session}
THREADS=${THREADS:-4}
DEVICE=${DEVICE:-cuda}
SHORT_TOKENS=${SHORT_TOKENS:-64}
SWEEP=${SWEEP:-"1 4 8 16 32"}
SWEEP_TOKENS=${SWEEP_TOKENS:-128}
mkdir -p "$WORK"
cd "$(dirname "$0")/.."

T=$("$PY" -m dflash_trt.cli setup-default | sed -n 's/^target: //p')
[[ -n "$T" ]] || { echo "error: setup-default printed no target directory" >&2; exit 2; }
D=$("$PY" -c 'from dflash_trt.embedded import default_draft_dir; print(default_draft_dir())')
echo "stage: setup rc=0 target=$T"

bench() {  # bench NAME ARGS...: the batched runtime, DFlash vs plain, 32 math requests per level; $WORK/NAME/
    local name=$1; shift
    "$PY" -m dflash_trt.cli bench --runtime batched --device "$DEVICE" --target "$T" --draft "${DRAFT:-$D}" \
        --threads "$THREADS" --repeats 2 --category math --num-requests 32 --no-progress --out "$WORK/$name" "$@" \
        >"$WORK/$name.log" 2>&1
    echo "stage: $name rc=$?"
}

bench bbg0 --concurrency 1,8 --max-new-tokens "$SHORT_TOKENS" --no-cuda-graphs  # graphs are on by default on CUDA
bench bbg1 --concurrency 1,8 --max-new-tokens "$SHORT_TOKENS" --cuda-graphs
bench bbk0 --concurrency 8 --max-new-tokens "$SHORT_TOKENS" --policy fixed:0

TARGET=$T GREEDY_DIR=$GREEDY_DIR WORK=$WORK PY=$PY DEVICE=$DEVICE SAMPLES=${SAMPLES:-4} BATCH_PROMPTS=${BATCH_PROMPTS:-256} \
    GEN_SECONDS=${GEN_SECONDS:-240} TRAIN_SECONDS=${TRAIN_SECONDS:-600} BATCH=${BATCH:-96} VARIANTS=${VARIANTS:-"A:2:768"} \
    bash scripts/gpu_drafter.sh
echo "stage: train rc=$?"

graphs=(--no-cuda-graphs)  # on only if every graphed output equalled the reference loop's greedy decoding (bench --check)
"$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["identical_all"] is True else 1)' \
    "$WORK/bbg1/bench.json" 2>/dev/null && graphs=(--cuda-graphs)
DRAFT="$WORK/A" bench bb_A --concurrency "${SWEEP// /,}" --max-new-tokens "$SWEEP_TOKENS" "${graphs[@]}"
echo "stage: all-done graphs=${graphs[*]:-off}"
