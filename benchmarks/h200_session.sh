#!/usr/bin/env bash
# The GPU runs of one device session, on a two-GPU H200 host, in two calls of under ten minutes:
#
#   bash benchmarks/h200_session.sh single     # GPU 0: benchmarks/gpu_run.py (N=8/1/auto with
#                                              #   longest-output-first admission, FCFS and 512 seats as
#                                              #   extra runs, roofline, kernel profile, token matches);
#                                              # GPU 1 meanwhile: the transformers peer, the kernel,
#                                              #   step-timer and decode-graph tests
#   bash benchmarks/h200_session.sh parallel   # both GPUs: TP=1/TP=2/PP=2 at N=8 and 1 (NCCL)
#   bash benchmarks/h200_session.sh served     # one GPU (nvidia-h200): benchmarks/h200_served.py, the served
#                                              #   headline (lockstep bench serve against lockstep serve, default
#                                              #   flags and N=1, rate inf and Poisson 10/25); needs the wheels
#                                              #   of benchmarks/fetch_gpu_wheels.sh in .whl (carry: [".whl"]):
#                                              #   fastapi, starlette, uvicorn, pydantic, pydantic_core,
#                                              #   annotated-types, typing-inspection, typing_extensions,
#                                              #   opentelemetry-api
#   SETTINGS="default= seqs512=--max-num-seqs+512" bash benchmarks/h200_session.sh sweep
#                                              # one GPU, carrying .whl: one rate-inf run (1000 requests)
#                                              #   per server setting ('+' stands for a space in its
#                                              #   flags), then the kernel, decode-graph, step-timer tests
#   RATES="5 10 20 30 40" ARRIVAL_S=15 bash benchmarks/h200_session.sh poisson
#                                              # one GPU, carrying .whl: per setting (SETTINGS, as sweep;
#                                              #   default flags, N=1, N=8 FCFS unless given) one server and
#                                              #   a Poisson run per rate, rate x ARRIVAL_S requests each
#   bash benchmarks/h200_session.sh peer       # one GPU: benchmarks/transformers_peer.py, plain transformers
#                                              #   generate (static batches of PEER_BATCH, default 64) on the
#                                              #   served headline's requests (PROMPTS), stopped with a partial
#                                              #   result after PEER_S seconds (default 480); PEER_ARGS: more
#                                              #   of its flags, e.g. "--order prompt-length"
#   PEER_S=120 bash benchmarks/h200_session.sh served|poisson
#                                              # PEER_S > 0 (default 0): the peer runs after the servers have
#                                              #   stopped, for PEER_S seconds, its table after theirs; lower
#                                              #   BUDGET_S / POISSON_S by as much to stay inside the call
#
# Logs and JSON go to $OUT (at most 8 files come back from the device tool).
set -u
OUT=${OUT:-.bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/engine:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PROMPTS=${PROMPTS:-1000}

# The transformers peer on the served requests (sharegpt-synth seed 0, the headline's first run's ids),
# for $1 seconds; its JSON line also goes to $OUT/peer.json (its progress to stderr, not to one more file).
peer() {
    timeout "$(($1 + 60))" python3 benchmarks/transformers_peer.py --num-prompts "$PROMPTS" --time-limit-s "$1" \
        --batch-size "${PEER_BATCH:-64}" --result-json "$OUT/peer.json" ${PEER_ARGS:-}
    echo "== transformers_peer exit $?"
}

case "${1:-}" in
single)
    (
        export CUDA_VISIBLE_DEVICES=1
        OUT=$OUT/peer timeout 330 python benchmarks/gpu_run.py --num-prompts "$PROMPTS" --peer-prompts 200 \
            --peer-timeout 280 --skip match runs roofline profile
        echo "== peer exit $?"
        timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_step_timer.py \
            tests/engine/test_decode_graphs.py
        echo "== tests exit $?"
    ) >"$OUT/gpu1.log" 2>&1 &
    side=$!
    # Longest-output-first admission for the table's N=8/1/auto; FCFS and more seats as extra runs.
    CUDA_VISIBLE_DEVICES=0 timeout 560 python benchmarks/gpu_run.py --num-prompts "$PROMPTS" --steps 8 1 auto \
        --scheduling-policy lof --max-num-batched-tokens 16384 --peer-prompts 200 --skip peer \
        --extra-runs policy=fcfs seqs=512 n=16,seqs=512 2>"$OUT/gpu0.log"
    echo "== gpu_run exit $?"
    wait $side
    tail -n 40 "$OUT/gpu1.log"
    ;;
served)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    python3 -c "import fastapi, uvicorn, pydantic, lockstep_engine.api.app" || exit 1
    # EXTRA: more server settings, one rate-inf run each after the headline ('+' for a space, as SETTINGS)
    read -r -a extra <<<"${EXTRA:-}"
    extra_args=()
    [ ${#extra[@]} -gt 0 ] && extra_args=(--extra-settings "${extra[@]//+/ }")
    timeout 540 python3 benchmarks/h200_served.py "${extra_args[@]}" 2>&1 | tee "$OUT/served.log"
    echo "== h200_served exit ${PIPESTATUS[0]}"
    if [ "${PEER_S:-0}" -gt 0 ]; then peer "$PEER_S"; fi
    ;;
sweep)
    # Server settings side by side at rate inf (1000 requests each; SETTINGS overrides the list), then
    # the GPU tests; server logs come back as one archive (the device tool returns at most 8 files).
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    mkdir -p /tmp/sweep
    read -r -a settings <<<"${SETTINGS:-default=}"
    OUT=/tmp/sweep timeout "${SWEEP_S:-420}" python3 benchmarks/h200_served.py --budget "$((${SWEEP_S:-420} - 20))" \
        --settings "${settings[@]//+/ }" 2>&1 | tee "$OUT/sweep.log"
    echo "== sweep exit ${PIPESTATUS[0]}"
    cp /tmp/sweep/served.json "$OUT/" 2>/dev/null
    tar -czf "$OUT/server_logs.tgz" -C /tmp/sweep . 2>/dev/null
    if [ "${TESTS_S:-150}" -gt 0 ]; then
        timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/kernels \
            tests/engine/test_decode_graphs.py tests/engine/test_step_timer.py 2>&1 | tail -n 15 | tee "$OUT/tests.log"
    fi
    ;;
poisson)
    # Poisson arrivals per server setting (one server each, reused across RATES; ARRIVAL_S seconds of
    # arrivals per rate), no rate-inf run and no tests: the latency-against-rate sweep.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    read -r -a settings <<<"${SETTINGS:-default= steps1=--num-scheduler-steps+1 steps8-fcfs=--num-scheduler-steps+8+--scheduling-policy+fcfs}"
    read -r -a rates <<<"${RATES:-5 10 20 30 40}"
    timeout "$((${POISSON_S:-540} + 20))" python3 benchmarks/h200_served.py --budget "${POISSON_S:-540}" \
        --rates "${rates[@]}" --arrival-s "${ARRIVAL_S:-15}" --poisson-settings "${settings[@]//+/ }" 2>&1 |
        tee "$OUT/poisson.log"
    echo "== poisson exit ${PIPESTATUS[0]}"
    if [ "${PEER_S:-0}" -gt 0 ]; then peer "$PEER_S"; fi
    ;;
peer)
    peer "${PEER_S:-480}"
    ;;
parallel)
    timeout 560 python benchmarks/gpu_parallel_run.py --layouts 1x1 2x1 1x2 --steps 8 1 \
        --num-prompts "${PAR_PROMPTS:-300}" --timeout 170 2>"$OUT/parallel.log"
    echo "== gpu_parallel_run exit $?"
    grep -E "Error|error|Traceback" "$OUT/parallel.log" | head -20
    ;;
*)
    echo "usage: $0 single|parallel|served|sweep|poisson|peer" >&2
    exit 2
    ;;
esac
