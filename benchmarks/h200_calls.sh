#!/usr/bin/env bash
# The decode-profile, long-prompt and served-rate-inf calls on one H200 (kind nvidia-h200), each under ten minutes:
#
#   bash benchmarks/h200_calls.sh profile   # benchmarks/decode_profile.py (a decode step per kernel group
#                                             #   against its byte bound, batch 64/128/256), then the GPU test
#                                             #   files (tests/kernels, test_decode_graphs, test_step_timer,
#                                             #   test_arrival_cuts)
#   bash benchmarks/h200_calls.sh long      # carrying .whl (benchmarks/fetch_gpu_wheels.sh): long prompts
#                                             #   among streams per --long-prefill-token-threshold (CAPS, default
#                                             #   "0 1024 1536 2048"; LONG_S seconds of arrivals, default 35)
#   bash benchmarks/h200_calls.sh served    # carrying .whl: served rate inf, default flags,
#                                             #   random:smollm2-135m and random:llama-3-8b (1000 requests each)
#
# Tables go to stdout; JSON and logs to $OUT (at most 8 files come back from the device tool).
set -u
OUT=${OUT:-.bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/engine:${PYTHONPATH:-} PYTHONUNBUFFERED=1

case "${1:-}" in
profile)
    timeout 300 python3 benchmarks/decode_profile.py 2>"$OUT/decode_profile.log"
    echo "== decode_profile exit $?"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_decode_graphs.py \
        tests/engine/test_step_timer.py tests/engine/test_arrival_cuts.py >"$OUT/tests.log" 2>&1
    echo "== tests exit $?"
    tail -n 15 "$OUT/tests.log"
    ;;
long)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    settings=()
    for cap in ${CAPS:-0 1024 1536 2048}; do settings+=("cap$cap=--long-prefill-token-threshold $cap"); done
    mkdir -p /tmp/long
    OUT=/tmp/long timeout 560 python3 benchmarks/long_prompts.py --duration "${LONG_S:-35}" \
        --settings "${settings[@]}" 2>/tmp/long/client.log | tee "$OUT/long.txt"
    echo "== long_prompts exit ${PIPESTATUS[0]}"
    cp /tmp/long/long_prompts.json "$OUT/" 2>/dev/null
    tar -czf "$OUT/logs.tgz" -C /tmp long 2>/dev/null
    ;;
served)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    mkdir -p /tmp/small /tmp/large
    # CLIENTS: client processes per run (one httpx client saturates a core below smollm2's rate)
    OUT=/tmp/small timeout 300 python3 benchmarks/h200_served.py --model random:smollm2-135m \
        --settings "smollm2=" --client-processes "${CLIENTS:-1}" \
        --budget 290 >/tmp/small/served.log 2>&1
    echo "== smollm2 exit $?"
    cp /tmp/small/served.json "$OUT/served_smollm2.json" 2>/dev/null
    OUT=/tmp/large timeout 250 python3 benchmarks/h200_served.py --settings "default=" --budget 240 \
        --client-processes "${CLIENTS:-1}" >/tmp/large/served.log 2>&1
    echo "== llama-3-8b exit $?"
    cp /tmp/large/served.json "$OUT/served_llama.json" 2>/dev/null
    tar -czf "$OUT/logs.tgz" -C /tmp small large 2>/dev/null
    python3 - "$OUT" <<'EOF'
import json, os, sys
for name in ("served_smollm2.json", "served_llama.json"):
    path = os.path.join(sys.argv[1], name)
    if not os.path.exists(path):
        print(f"{name}: missing"); continue
    data = json.load(open(path))
    for run in data["runs"]:
        print(f"{data['model']} {run['label']}: {run['req_per_s']:.2f} req/s, {run['output_tok_per_s']:.0f} out tok/s, "
              f"TTFT p50/p99 {run['ttft_p50_ms']:.0f}/{run['ttft_p99_ms']:.0f} ms, TPOT p50 {run['tpot_p50_ms']:.2f} ms, "
              f"ITL p99/max {run['itl_p99_ms']:.0f}/{run['itl_max_ms']:.0f} ms, idle {run['idle_fraction']:.1%}, "
              f"median boundary gap {run['median_boundary_gap_us']} us, client CPU {run['client_cpu_share']:.2f}")
        print(f"  windows {run['windows']:.0f}, steps {run['steps']:.0f}, cut {run['cut_windows']:.0f}; host s "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(run['host_s'].items()))
              + f"; longest output {run['longest_output_tokens']} tokens: TTFT {run['longest_output_ttft_s']:.2f} s, "
              f"E2E {run['longest_output_e2el_s']:.2f} s of the run's {run['duration_s']:.2f} s")
    for error in data["errors"]:
        print(f"{name} error: {error[-400:]}")
EOF
    ;;
*)
    echo "usage: $0 profile|long|served" >&2
    exit 2
    ;;
esac
