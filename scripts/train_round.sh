#!/bin/bash
# One round of the shipped EAGLE-3 head's recipe (docs/training.md), resumable and meant for nohup:
#
#   committed answers ──specrt answers replay──► a store ──specrt train (warm, --resume)──► a head
#   ──specrt export──► a bundle ──scripts/chain_alpha.py, runtime_acceptance.py──► its run-time α1
#
# Every step skips what is done, so a stopped round (a session's end, TRAIN_MINUTES) goes on where it was
# when run again, on the same machine; on a fresh one it starts again from the committed answers.
#
#   ANSWERS="drafters/smollm2-135m-instruct/answers/*.npz" OUT=artifacts/train/eagle3-r8 \
#       nohup setsid bash scripts/train_round.sh >> artifacts/train/round.log 2>&1 &
#
# The head is scored when its run ended by itself: its epoch whole, or TRAIN_MINUTES spent (the learning rate
# anneals to the limit: loop.py lr_scale); not when a stop cut it mid-schedule. On a fresh machine size both
# limits to the session (Zen 4: replay ~1,100 rows/s, training ~0.6 s a step in bf16 with one draft step). Ship the head only if
# its α1 beats the shipped head's (drafters/smollm2-135m-instruct/eagle3/metrics.json "run_time").
set -euo pipefail
cd "$(dirname "$0")/.."
SPECRT=${SPECRT:-.venv/bin/specrt}
PY=${PY:-.venv/bin/python}
BUNDLE=${BUNDLE:-artifacts/bundles/smollm2-135m-instruct}
SHIPPED=${SHIPPED:-drafters/smollm2-135m-instruct/eagle3}
STORE=${STORE:-artifacts/train/store}
OUT=${OUT:?name the head folder, e.g. OUT=artifacts/train/eagle3-r8}
TRAIN_MINUTES=${TRAIN_MINUTES:-400}
# replay at most this long (the answers come held-out first, then every prompt's greedy answer, then the sampled
# rounds: a cut replay keeps the most distinct prompts); empty: all of them
REPLAY_MINUTES=${REPLAY_MINUTES:-}
THREADS=${THREADS:-2}
say() { echo "[$(date -u +%FT%TZ)] $*"; }

[ -f "$BUNDLE/manifest.json" ] || { say "no bundle at $BUNDLE: run make build first"; exit 2; }
for a in ${ANSWERS:?name the answer files, e.g. ANSWERS=\"drafters/smollm2-135m-instruct/answers/*.npz\"}; do
    say "replay $a into $STORE"
    nice -n 10 "$SPECRT" answers replay "$a" --target "$BUNDLE" --store "$STORE" --threads "$THREADS" \
        ${REPLAY_MINUTES:+--max-minutes "$REPLAY_MINUTES"}
done

resume=()
[ -f "$OUT.train-state/state.json" ] && resume=(--resume)  # export/training/checkpoint.py's saved run
say "train $OUT ${resume[*]}"
nice -n 10 "$SPECRT" train eagle3 --store "$STORE" --init "$SHIPPED" --epochs 1.5 --batch 8 --lr 3e-4 --steps 1 \
    --draft-vocab 4096 --save-dtype fp16 --checkpoint-minutes 10 --max-minutes "$TRAIN_MINUTES" \
    "${resume[@]}" -o "$OUT"
ended='import json, sys; sys.exit(json.load(open(sys.argv[1])).get("interrupted", False))'
if "$PY" -c "$ended" "$OUT/metrics.json"; then
    name=$(basename "$OUT")
    say "training ended: export and score $name"
    "$SPECRT" export -o "artifacts/bundles/smollm2-$name" --quantize int4 --drafter "eagle3=$OUT"
    "$PY" scripts/chain_alpha.py "$BUNDLE" --threads "$THREADS"  # the shipped head, on this machine, to compare
    "$PY" scripts/chain_alpha.py "artifacts/bundles/smollm2-$name" --threads "$THREADS"
    "$PY" scripts/runtime_acceptance.py "artifacts/bundles/smollm2-$name" --threads "$THREADS"
    say "if its alpha1 beats the shipped head's above: runtime_acceptance.py ... --write $OUT, commit $OUT"
else
    say "stopped mid-schedule: run this again to go on from the checkpoint"
fi
