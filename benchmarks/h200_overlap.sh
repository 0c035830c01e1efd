#!/usr/bin/env bash
# Overlap (--async-scheduling) on one H200 (kind nvidia-h200), two calls of under ten minutes each,
# carrying the serving wheels of benchmarks/fetch_gpu_wheels.sh in $WHEELS (default .whl):
#
#   bash benchmarks/h200_overlap.sh check   # the GPU test files of the window loop (overlap on and off,
#                                           #   decode graphs, arrival cuts, step timer), then served rate
#                                           #   inf, random:llama-3-8b, default flags against
#                                           #   --no-async-scheduling (1000 requests, CLIENTS processes)
#   bash benchmarks/h200_overlap.sh small   # the same two settings for random:smollm2-135m
#   bash benchmarks/h200_overlap.sh final   # the window-loop and fused-kernel GPU tests, then smollm2 served
#                                           #   with default flags only
#
# Tables go to stdout; JSON and logs to $OUT (at most 8 files come back from the device tool).
set -u
OUT=${OUT:-.bench}
WHEELS=${WHEELS:-.whl}
CLIENTS=${CLIENTS:-4}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/engine:$PWD/gateway:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH

summary() {
    python3 - "$@" <<'PY'
import json, os, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        print(f"{path}: missing"); continue
    data = json.load(open(path))
    for run in data["runs"]:
        busy, gap = run["engine_busy_s"], run["engine_gap_s"]
        print(f"{data['model']} {run['label']}: {run['req_per_s']:.2f} req/s, {run['output_tok_per_s']:.0f} out tok/s, "
              f"TTFT p50/p99 {run['ttft_p50_ms']:.0f}/{run['ttft_p99_ms']:.0f} ms, TPOT p50 {run['tpot_p50_ms']:.2f} ms, "
              f"ITL p99/max {run['itl_p99_ms']:.0f}/{run['itl_max_ms']:.0f} ms, idle {run['idle_fraction']:.1%}, "
              f"busy/(busy+gaps) {busy / (busy + gap):.2%}, median boundary gap {run['median_boundary_gap_us']} us")
        print(f"  windows {run['windows']:.0f} (overlapped {run['overlapped_windows']:.0f}), steps {run['steps']:.0f}, "
              f"cut {run['cut_windows']:.0f}; occupancy gauge at end {run['occupancy_gauge_at_end']}; host s "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(run['host_s'].items()))
              + f"; longest output {run['longest_output_tokens']} tokens: TTFT {run['longest_output_ttft_s']:.2f} s, "
              f"E2E {run['longest_output_e2el_s']:.2f} s of the run's {run['duration_s']:.2f} s; client CPU "
              f"{run['client_cpu_share']:.2f}")
    for error in data["errors"]:
        print(f"{path} error: {error[-600:]}")
PY
}

# served NAME MODEL SECONDS SETTING...: one rate-inf run per server setting, its JSON as $OUT/served_NAME.json
served() {
    local name=$1 model=$2 seconds=$3
    shift 3
    mkdir -p "/tmp/$name"
    OUT=/tmp/$name timeout "$seconds" python3 benchmarks/h200_served.py --model "$model" --settings "$@" \
        --client-processes "$CLIENTS" --budget $((seconds - 10)) >"/tmp/$name/served.log" 2>&1
    echo "== $model exit $?"
    cp "/tmp/$name/served.json" "$OUT/served_$name.json" 2>/dev/null
    tar -czf "$OUT/logs_$name.tgz" -C /tmp "$name" 2>/dev/null
    summary "$OUT/served_$name.json"
}

# gpu_tests SECONDS FILE...: the GPU test files, the tail of their log
gpu_tests() {
    local seconds=$1
    shift
    timeout "$seconds" python3 -m pytest -q -p no:cacheprovider "$@" >"$OUT/tests.log" 2>&1
    echo "== tests exit $?"
    tail -n 12 "$OUT/tests.log"
}

WINDOW_TESTS=(tests/engine/test_overlap.py tests/engine/test_decode_graphs.py tests/engine/test_arrival_cuts.py
              tests/engine/test_step_timer.py)

case "${1:-}" in
check)
    gpu_tests 230 "${WINDOW_TESTS[@]}"
    served llama random:llama-3-8b 310 "overlap=" "sync=--no-async-scheduling"
    ;;
small)
    served smollm2 random:smollm2-135m 400 "overlap=" "sync=--no-async-scheduling"
    ;;
final)
    gpu_tests 120 "${WINDOW_TESTS[@]}" tests/kernels/test_fused.py
    served smollm2 random:smollm2-135m 150 "overlap="
    ;;
*)
    echo "usage: $0 check|small|final" >&2
    exit 2
    ;;
esac
