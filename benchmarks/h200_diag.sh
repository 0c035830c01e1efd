#!/usr/bin/env bash
# Diagnostics for the host-path and device-path issues, on the machine benchmarks/h200_spec.sh set up (its wheels,
# py-spy and uvloop included, in /tmp/site):
#
#   bash benchmarks/h200_diag.sh spy       # random:smollm2-135m served at rate inf (default flags, 6 client
#       processes) under py-spy (every process and thread, 250 Hz): $OUT/spy_smollm2.txt (raw stacks),
#       $OUT/spy_summary.txt (benchmarks/spy_summary.py), $OUT/served.json (busy_by_phase, host seconds);
#       SPY_SETTING="NAME=FLAGS" serves another setting (SPY_SETTING="api2=--api-server-count 2")
#   bash benchmarks/h200_diag.sh prefill   # prefill_profile.py at 2048 and 8192 tokens, naming the kernels
#       outside the known groups (the 8192-token chunk's unexplained time)
#   bash benchmarks/h200_diag.sh prefill-graphs   # the prefill-graph and decode-graph tests on CUDA, then
#       random:smollm2-135m served at rate inf with --prefill-cuda-graphs off and with the default (auto)
#   bash benchmarks/h200_diag.sh sweep     # attention_backends.py --decode-sweep: every Triton decode tile (block_n x
#       warps x stages x splits) on both model shapes at 64-256 rows; the default and the fastest per case
#   bash benchmarks/h200_diag.sh splits    # the default decode tile at 1-8 splits, 8-128 rows, both shapes
#   bash benchmarks/h200_diag.sh tiles     # the attention, decode-graph and prefill-graph tests on CUDA,
#       decode_profile.py for random:llama-3-8b and random:smollm2-135m, random:smollm2-135m served (default and 16 steps)
#   bash benchmarks/h200_diag.sh served8b  # random:llama-3-8b served at rate inf, default flags, 4 client processes
#   bash benchmarks/h200_diag.sh prefill-graphs-quick   # the same with the prefill-graph tests and the default only
#   bash benchmarks/h200_diag.sh variant   # carrying .whl/variant (this tree with a change): smollm2 served, this tree then it
#   bash benchmarks/h200_diag.sh ab        # carrying .whl/variant: smollm2 served, this tree / variant / variant / this tree
#   bash benchmarks/h200_diag.sh norm-linear   # LOCKSTEP_NORM_LINEAR=1 against the default: tests, tile sweep,
#       decode profiles; norm-linear-served: random:smollm2-135m served off / on / on / off
#   bash benchmarks/h200_diag.sh overlap-tail   # carrying .whl/variant: overlap and decode-graph tests on CUDA, then
#       `variant` twice (QUICK=1: the overlap tests, then `variant` once)
#   bash benchmarks/h200_diag.sh splits-served   # carrying .whl/prev (an older tree, git archive): the Triton
#       attention tests on CUDA, random:smollm2-135m served with this tree (one and two API servers), then with .whl/prev's
set -u
OUT=${OUT:-.bench}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT PYTHONPATH=/tmp/site:$PWD:$PWD/engine:$PWD/gateway PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH

runs() {  # the engine's own figures of each served run
    python3 - "$OUT/served.json" <<'PY'
import json, sys
for row in json.load(open(sys.argv[1])).get("runs", []):
    print({k: row.get(k) for k in ("label", "req_per_s", "idle_fraction", "median_boundary_gap_us", "host_s",
                                   "busy_by_phase", "forwards_by_phase", "gap_by_boundary", "windows", "steps",
                                   "overlapped_windows", "longest_output_ttft_s", "longest_output_e2el_s", "duration_s")})
PY
    ls "$OUT"/requests_*.json >/dev/null 2>&1 && python3 benchmarks/intake_report.py "$OUT"/requests_*.json
}

gpu_tests() {  # SECONDS FILES...: the GPU test files, their last lines
    local seconds=$1; shift
    timeout "$seconds" python3 -m pytest -q -p no:cacheprovider "$@" >"$OUT/graph_tests.log" 2>&1
    echo "== GPU tests exit $?"; tail -n 3 "$OUT/graph_tests.log"
}

served_small() {  # SECONDS SETTINGS...: random:smollm2-135m at rate inf, one server per setting (NAME=FLAGS)
    local seconds=$1; shift
    timeout "$seconds" python3 benchmarks/h200_served.py --model random:smollm2-135m --settings "$@" \
        --client-processes 6 --budget $((seconds - 10)) >"$OUT/small_served.log" 2>&1
    echo "== served exit $?"; grep -v '^\[' "$OUT/small_served.log" | tail -6
    grep -h "prefill graphs" "$OUT"/server_*.log
    runs
}

case "${1:-}" in
spy)
    timeout 240 py-spy record -r 250 --subprocesses --threads --nonblocking --format raw -o "$OUT/spy_smollm2.txt" -- \
        python3 benchmarks/h200_served.py --model random:smollm2-135m --settings "${SPY_SETTING:-default=}" --client-processes 6 \
        --budget 200 >"$OUT/spy_served.log" 2>&1
    echo "== served under py-spy exit $?"; grep -v '^\[' "$OUT/spy_served.log" | tail -4
    python3 benchmarks/spy_summary.py "$OUT/spy_smollm2.txt" --top 30 >"$OUT/spy_summary.txt" 2>&1
    runs
    ;;
prefill)
    timeout 200 python3 benchmarks/prefill_profile.py --chunks 2048 8192 --repeats 2 >"$OUT/prefill.log" 2>&1
    echo "== prefill_profile exit $?"; grep -v "^USDT" "$OUT/prefill.log" | tail -16
    ;;
prefill-graphs)
    gpu_tests 150 tests/engine/test_prefill_graphs.py tests/engine/test_decode_graphs.py
    served_small 260 "eager_prefill=--prefill-cuda-graphs off" "head="
    ;;
tiles)
    gpu_tests 170 tests/kernels/test_triton_attention.py tests/engine/test_decode_graphs.py \
        tests/engine/test_prefill_graphs.py
    timeout 110 python3 benchmarks/decode_profile.py 2>"$OUT/decode_profile.log" >"$OUT/decode_llama.md"
    echo "== decode_profile llama-3-8b exit $?"; tail -n 12 "$OUT/decode_llama.md"
    OUT=$OUT/small timeout 50 python3 benchmarks/decode_profile.py --model random:smollm2-135m \
        2>"$OUT/decode_profile_small.log" >"$OUT/decode_small.md"
    echo "== decode_profile smollm2-135m exit $?"; tail -n 12 "$OUT/decode_small.md"
    served_small 260 "head=" "n16=--num-scheduler-steps 16"
    ;;
served8b)
    timeout 220 python3 benchmarks/h200_served.py --model random:llama-3-8b --settings "default=" --client-processes 4 \
        --budget 210 >"$OUT/served8b.log" 2>&1
    echo "== served exit $?"; grep -v '^\[' "$OUT/served8b.log" | tail -4
    grep -h "prefill graphs\|start-up" "$OUT"/server_*.log
    runs
    ;;
sweep)
    timeout ${SWEEP_S:-300} python3 benchmarks/attention_backends.py --decode-sweep --budget $(( ${SWEEP_S:-300} - 30 )) \
        >"$OUT/sweep.log" 2>"$OUT/sweep.err"
    echo "== decode sweep exit $?"; cat "$OUT/sweep.log"; grep -i "error\|out of time" "$OUT/sweep.err" | head -5
    ;;
splits)
    timeout 150 python3 benchmarks/attention_backends.py --split-sweep --batches 8 16 32 48 64 96 128 --budget 130 \
        >"$OUT/splits.log" 2>"$OUT/splits.err"
    echo "== split sweep exit $?"; cat "$OUT/splits.log"; grep -i "error\|out of time" "$OUT/splits.err" | head -5
    ;;
prefill-graphs-quick)
    gpu_tests 70 tests/engine/test_prefill_graphs.py
    served_small 200 "head="
    ;;
splits-served)
    python3 -c "import uvloop, httptools; print('uvloop', uvloop.__version__, 'httptools', httptools.__version__)"
    gpu_tests 100 tests/kernels/test_triton_attention.py
    served_small 200 "head=" "api2=--api-server-count 2"
    mkdir -p "$OUT/prev"
    (cd .whl/prev && export OUT=$OUT/prev PYTHONPATH=/tmp/site:$PWD:$PWD/engine:$PWD/gateway \
        && served_small 110 "prev=")
    ;;
variant)  # carrying .whl/variant (this tree changed, copied there): random:smollm2-135m served, this tree then it
    # (VARIANT_FIRST=1: the variant first)
    [ -z "${VARIANT_FIRST:-}" ] && served_small 200 "head="
    mkdir -p "$OUT/variant"
    (cd .whl/variant && export OUT=$OUT/variant PYTHONPATH=/tmp/site:$PWD:$PWD/engine:$PWD/gateway \
        && served_small 200 "variant=")
    [ -n "${VARIANT_FIRST:-}" ] && served_small 200 "head="
    ;;
ab)  # carrying .whl/variant (this tree changed, copied there): random:smollm2-135m served in the order this tree,
    # the variant, the variant, this tree (each in $OUT/<n>_<name>/), then one line per run
    n=0
    for who in head variant variant head; do
        n=$((n + 1)); dir=$OUT/${n}_$who; mkdir -p "$dir"
        if [ "$who" = head ]; then (export OUT=$dir && served_small 150 "head=") >/dev/null 2>&1
        else (cd .whl/variant && export OUT=$dir PYTHONPATH=/tmp/site:$PWD:$PWD/engine:$PWD/gateway \
            && served_small 150 "variant=") >/dev/null 2>&1; fi
        (export OUT=$dir && runs) | cut -c1-400
    done
    ;;
norm-linear)  # the fused norm + projection kernels (LOCKSTEP_NORM_LINEAR=1) against the default: their tests on
    # CUDA, the per-projection tile sweep (benchmarks/norm_linear_sweep.py), decode_profile.py on both models off
    # and on (kernels/norm_linear.py counts in the GEMM group)
    gpu_tests 120 tests/kernels/test_norm_linear.py tests/kernels/test_fused.py
    timeout 180 python3 benchmarks/norm_linear_sweep.py >"$OUT/norm_linear_sweep.md" 2>"$OUT/norm_linear_sweep.log"
    echo "== norm_linear_sweep exit $?"; cat "$OUT/norm_linear_sweep.md"
    for model in random:smollm2-135m random:llama-3-8b; do
        for v in 0 1; do
            LOCKSTEP_NORM_LINEAR=$v OUT=$OUT/profile_${model#random:}_$v timeout 70 python3 benchmarks/decode_profile.py \
                --model $model 2>"$OUT/decode_profile_${model#random:}_$v.log" >"$OUT/decode_${model#random:}_$v.md"
            echo "== decode_profile $model LOCKSTEP_NORM_LINEAR=$v exit $?"; grep -i 'gemm\|step' "$OUT/decode_${model#random:}_$v.md"
        done
    done
    ;;
norm-linear-served)  # random:smollm2-135m served with LOCKSTEP_NORM_LINEAR off, on, on, off
    n=0
    for v in 0 1 1 0; do
        n=$((n + 1)); (export OUT=$OUT/${n}_nl$v LOCKSTEP_NORM_LINEAR=$v && mkdir -p "$OUT" && served_small 140 "nl$v=") \
            >/dev/null 2>&1
        (export OUT=$OUT/${n}_nl$v && runs) | cut -c1-300
    done
    ;;
overlap-tail)  # carrying .whl/variant (this tree with another TAIL_STEPS): the overlap and decode-graph tests on
    # CUDA, then random:smollm2-135m served by this tree and the variant, twice, alternating
    # QUICK=1: the overlap tests alone, and one round
    if [ -n "${QUICK:-}" ]; then gpu_tests 150 tests/engine/test_overlap.py; else
        gpu_tests 200 tests/engine/test_overlap.py tests/engine/test_decode_graphs.py; fi
    for round in $(seq 1 $([ -n "${QUICK:-}" ] && echo 1 || echo 2)); do
        (export OUT=$OUT/r$round && mkdir -p "$OUT" && bash "$0" variant) 2>&1 | grep "@inf |"
    done
    ;;
*)
    echo "usage: bash benchmarks/h200_diag.sh spy|prefill|prefill-graphs|prefill-graphs-quick|sweep|splits|splits-served|variant|ab|norm-linear|norm-linear-served|overlap-tail|tiles|served8b" >&2
    exit 2
    ;;
esac
