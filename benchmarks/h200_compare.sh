#!/usr/bin/env bash
# Before/after check of a change on one H200, in one device call (under ten minutes):
#
#   bash benchmarks/h200_compare.sh BEFORE_DIR
#
# BEFORE_DIR holds the tree before the change (e.g. `git archive <commit> | tar -x -C .gpu_before`,
# ignored by git and carried to the device). Runs, in this order: the GPU kernel, step-timer and
# decode-graph tests on the current tree; then sharegpt-synth N=8 (1000 requests, rate inf,
# offline) for the tree before and the tree after, alternating twice, so host noise shows as spread.
# Logs and JSON go to $OUT.
set -u
before=${1:?usage: $0 BEFORE_DIR}
OUT=${OUT:-.bench}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
PROMPTS=${PROMPTS:-1000}
here=$PWD

echo "== GPU tests (current tree)"
PYTHONPATH=$here:$here/engine timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels \
    tests/engine/test_step_timer.py tests/engine/test_decode_graphs.py >"$OUT/tests.log" 2>&1
echo "== tests exit $? ($(tail -n 1 "$OUT/tests.log"))"

run() {  # run LABEL TREE
    local label=$1 tree=$2
    (cd "$tree" && PYTHONPATH=$tree:$tree/engine OUT=$OUT/$label timeout 170 python benchmarks/gpu_run.py \
        --num-prompts "$PROMPTS" --steps 8 --peer-prompts 0 --skip peer match roofline profile \
        >"$OUT/$label.log" 2>&1)
    echo "== $label exit $?"
    grep -E "^N=8 " "$OUT/$label.log" || tail -n 5 "$OUT/$label.log"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
    run "before$round" "$before"
    run "after$round" "$here"
done
