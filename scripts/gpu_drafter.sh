#!/usr/bin/env bash
# Grow a DFlash drafter on one GPU: the target's sampled answers to the train prompts, then
# online-feature training (the target computes every step's features; nothing is cached), one
# process per drafter shape, side by side on the same GPU.
#
#   TARGET=~/.cache/dflash-trt/smollm2-135m-instruct GREEDY_DIR=.cache/train WORK=/tmp/gpu-drafter \
#       scripts/gpu_drafter.sh
#
# GREEDY_DIR holds the greedy answers (responses.pt from `dflash-trt train-data`, or
# train-draft's <out>.data); the features in it are not needed. Drafters land in $WORK/<name>.
# Knobs (environment): PY, SAMPLES, TEMPERATURE, GEN_SECONDS, TRAIN_SECONDS, BATCH, LR, SEED,
# INIT_FROM, VARIANTS ("name:layers:intermediate[:family] ...", family dflash (default) or dflash2),
# DEVICE (cuda), DTYPE (of the answer job: float32), BATCH_PROMPTS (128), SEQUENTIAL (1: one variant
# after the other, each with the GPU to itself), and DFlash2's recipe: SELECTOR_RANK (64: the
# codebooks are 2 x 49152 x rank, 12.6 MB in bf16 at 64, so the embedded drafter stays < 40 MB),
# SELECTOR_TOP_K (16), CONV_KERNEL (2), CONV_GROUP (16) (speculators 0.9.0's defaults but the rank).
#
# DFlash v1 against DFlash2 at equal budget (issue 43 item 7; docs/drafter.md "DFlash2"): both from
# the shipped drafter, the same answers, the same seconds each, one at a time:
#
#   TARGET=... GREEDY_DIR=... SEQUENTIAL=1 TRAIN_SECONDS=380 VARIANTS="v1:2:768 d2:2:768:dflash2" \
#       scripts/gpu_drafter.sh
#   for d in dflash_trt/assets/smollm2-135m-dflash $WORK/v1 $WORK/d2; do
#       OMP_NUM_THREADS=2 dflash-trt bench --tau-only --num-prompts 39 --draft $d --target $TARGET; done
#   PYTHONPATH=$PWD python scripts/zlab_tau.py --draft $WORK/d2 --temperature 1 --passes match,probabilistic
set -euo pipefail
: "${TARGET:?set TARGET to the target checkpoint directory}"
: "${GREEDY_DIR:?set GREEDY_DIR to the directory holding the greedy responses.pt}"
PY=${PY:-python3}
WORK=${WORK:-/tmp/gpu-drafter}
SAMPLES=${SAMPLES:-8}
TEMPERATURE=${TEMPERATURE:-0.7}
GEN_SECONDS=${GEN_SECONDS:-200}
TRAIN_SECONDS=${TRAIN_SECONDS:-450}
BATCH=${BATCH:-32}
LR=${LR:-1e-3}
SEED=${SEED:-7}
INIT_FROM=${INIT_FROM:-dflash_trt/assets/smollm2-135m-dflash}
VARIANTS=${VARIANTS:-"A:2:768"}
DEVICE=${DEVICE:-cuda}
BATCH_PROMPTS=${BATCH_PROMPTS:-128}
DTYPE=${DTYPE:-float32}
SEQUENTIAL=${SEQUENTIAL:-0}
SELECTOR_RANK=${SELECTOR_RANK:-64}
SELECTOR_TOP_K=${SELECTOR_TOP_K:-16}
CONV_KERNEL=${CONV_KERNEL:-2}
CONV_GROUP=${CONV_GROUP:-16}
mkdir -p "$WORK"
[[ -f "$GREEDY_DIR/responses.pt" ]] || { echo "error: $GREEDY_DIR/responses.pt not found" >&2; exit 2; }

echo "[gpu-drafter] sampling $SAMPLES answers per train prompt at T=$TEMPERATURE for ${GEN_SECONDS}s"
"$PY" -m dflash_trt.train.sampled "$TARGET" "$WORK/sampled.pt" --samples "$SAMPLES" \
    --temperature "$TEMPERATURE" --batch-prompts "$BATCH_PROMPTS" --device "$DEVICE" --dtype "$DTYPE" --seed "$SEED" --time-limit "$GEN_SECONDS" \
    --no-progress

pids=()
status=0
for v in $VARIANTS; do
    IFS=: read -r name layers inter family <<<"$v"
    family=${family:-dflash}
    recipe=()
    if [[ $family == dflash2 ]]; then
        recipe=(--selector-rank "$SELECTOR_RANK" --selector-top-k "$SELECTOR_TOP_K"
                --conv-kernel-size "$CONV_KERNEL" --conv-group-size "$CONV_GROUP")
    fi
    echo "[gpu-drafter] training $name: $family, $layers layers, MLP $inter, ${TRAIN_SECONDS}s"
    "$PY" -m dflash_trt.cli train-draft --target "$TARGET" --out "$WORK/$name" --data-dir "$GREEDY_DIR" \
        --extra-data "$WORK/sampled.pt" --device "$DEVICE" --batch-sequences "$BATCH" --features online \
        --num-layers "$layers" --intermediate-size "$inter" --init-from "$INIT_FROM" --sampled-vocab 4096 \
        --family "$family" "${recipe[@]}" \
        --steps 1000000 --time-limit "$TRAIN_SECONDS" --warmup-steps 100 --lr "$LR" --seed "$SEED" \
        >"$WORK/$name.log" 2>&1 &
    if [[ $SEQUENTIAL == 1 ]]; then wait "$!" || status=1; else pids+=($!); fi
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
for v in $VARIANTS; do tail -n 2 "$WORK/${v%%:*}.log"; done
exit $status
