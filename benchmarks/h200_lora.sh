#!/usr/bin/env bash
# The cost of LoRA on one H200 (kind nvidia-h200), in one call of under ten minutes: `lockstep bench serve`
# (sharegpt-synth seed 0, token-id prompts, ignore_eos, streamed, rate inf, PROMPTS requests from CLIENTS
# client processes) against `lockstep serve $MODEL` (default random:llama-3-8b), three measured runs:
#
#   base       the server without --enable-lora, base-model requests
#   lora_base  the server with --enable-lora --max-loras 4 --max-lora-rank 16 and four rank-16 adapters on
#              all seven targets (benchmarks/make_lora_adapters.py), base-model requests only: the cost of
#              having LoRA on
#   lora       the same server, requests spread evenly over the four adapters (--lora-modules: request i
#              names adapter i mod 4)
#
# Each server is warmed with WARM requests at rate inf (the LoRA server's mix the base model and all four
# adapters) before it is measured, and stopped before the next starts (SIGTERM to the API server, SIGKILL to
# its process group after STOP_S). Every run sends prompt ids of its own (--vocab-size VOCAB, VOCAB-STEP, ...:
# the same lengths, other ids), so no run hits the prefix cache of an earlier one. Every wait is bounded.
#
#   bash benchmarks/fetch_gpu_wheels.sh && bash benchmarks/h200_lora.sh fetch  # here, once: wheels into .whl/,
#                                                                              #   safetensors among them
#   bash benchmarks/h200_lora.sh          # there (carry [".whl"]): all three runs, then the table
#   bash benchmarks/h200_lora.sh base     # only the base server;  ... lora: only the LoRA server's two runs
#   OUT=DIR bash benchmarks/h200_lora.sh table   # only the table, from DIR's base.json, lora_base.json, lora.json
#   MODEL=random:tiny SERVER_ARGS="--device cpu --max-model-len 2048" PROMPTS=8 WARM=4 CLIENTS=2 VOCAB=1024 \
#       STEP=4 bash benchmarks/h200_lora.sh   # a CPU dry run of the whole script
#
# The table goes to stdout (req/s, output tok/s, TTFT p50/p99, TPOT p50, and each run's ratio to base;
# the goal is within 15%); the JSON results and a tarball of the logs go to $OUT (4 files).
set -u
OUT=${OUT:-.bench}
MODEL=${MODEL:-random:llama-3-8b}
SERVER_ARGS=${SERVER_ARGS:---dtype bfloat16}
PROMPTS=${PROMPTS:-1000} WARM=${WARM:-200} CLIENTS=${CLIENTS:-4}
VOCAB=${VOCAB:-128000} STEP=${STEP:-1000}
PORT=${PORT:-8100} START_S=${START_S:-300} BENCH_S=${BENCH_S:-240} STOP_S=${STOP_S:-60}
RANK=16 ADAPTERS=4
LOGS=${LOGS:-/tmp/h200_lora}  # logs, adapters and results before they are copied to $OUT
URL=http://127.0.0.1:$PORT
SAFETENSORS_WHEEL=safetensors==0.8.0  # the version `make install` puts on the development machine

if [ "${1:-}" = fetch ]; then  # here: the safetensors wheel into .whl, from the image build's cache if it has it
    mkdir -p .whl
    cached=$(ls "${LOCKSTEP_CACHE:-$HOME/.cache/lockstep}"/images/wheels/safetensors-"${SAFETENSORS_WHEEL#*==}"-*.whl \
        2>/dev/null | head -1)
    if [ -n "$cached" ]; then
        cp "$cached" .whl/
    else
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$SAFETENSORS_WHEEL" || exit 1
    fi
    ls -l .whl/safetensors-*
    exit 0
fi

mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD:$PWD/engine:$PWD/gateway:${PYTHONPATH:-} PYTHONUNBUFFERED=1
install_wheels() {
    python3 -c "import fastapi, uvicorn, safetensors" 2>/dev/null && return  # the H200 image lacks them
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    python3 -c "import fastapi, uvicorn, safetensors" || {
        echo "== .whl lacks a wheel: run benchmarks/fetch_gpu_wheels.sh and '$0 fetch' here first" >&2
        exit 1
    }
}

server_pid=
group_alive() {  # PGID: true while a process of that group runs (zombies aside)
    local pgid=$1 stat fields
    for stat in /proc/[0-9]*/stat; do
        { read -r fields <"$stat"; } 2>/dev/null || continue  # a process may exit meanwhile
        fields=(${fields##*) })  # state ppid pgrp ...
        [ "${fields[2]}" = "$pgid" ] && [ "${fields[0]}" != Z ] && return 0
    done
    return 1
}
stop_server() {  # SIGTERM to the API server, which stops its engine core; SIGKILL to what is left after STOP_S
    [ -n "$server_pid" ] || return 0
    kill -TERM "$server_pid" 2>/dev/null
    local started=$SECONDS
    while group_alive "$server_pid" && [ $((SECONDS - started)) -lt "$STOP_S" ]; do sleep 1; done
    if group_alive "$server_pid"; then
        echo "== server $server_pid: processes left after $STOP_S s, SIGKILL"
        kill -KILL -- "-$server_pid" 2>/dev/null
    fi
    wait "$server_pid" 2>/dev/null
    echo "== server stopped after $((SECONDS - started)) s"
    server_pid=
}
finish() {
    stop_server
    # the logs, not the adapters' weights
    tar -czf "$OUT/logs.tgz" --exclude=adapters -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null
}
trap finish EXIT

start_server() {  # NAME FLAGS...: start it in a process group of its own, wait for /health (bounded)
    local name=$1
    shift
    if curl -sf -o /dev/null --max-time 2 "$URL/health"; then
        echo "== $name: something already answers on port $PORT; not starting"
        return 1
    fi
    # shellcheck disable=SC2086  # SERVER_ARGS is a list of flags
    setsid python3 -m lockstep.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" $SERVER_ARGS "$@" \
        >"$LOGS/$name.server.log" 2>&1 &
    server_pid=$!
    local started=$SECONDS deadline=$((SECONDS + START_S))
    until curl -sf -o /dev/null --max-time 2 "$URL/health"; do
        if ! kill -0 "$server_pid" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
            echo "== $name server not up (exited or over $START_S s):"
            tail -20 "$LOGS/$name.server.log"
            stop_server
            return 1
        fi
        sleep 1
    done
    echo "== $name server up after $((SECONDS - started)) s"
}

vocab_index=0
bench() {  # LABEL NUM_PROMPTS [--lora-modules NAME...]: one rate-inf run, its JSON as $OUT/LABEL.json
    local label=$1 count=$2 vocab=$((VOCAB - vocab_index * STEP))
    shift 2
    vocab_index=$((vocab_index + 1))
    rm -f "$LOGS/$label.json" "$OUT/$label.json"  # a run that writes none leaves none, not an older one
    local started=$SECONDS
    timeout "$BENCH_S" python3 -m lockstep.cli bench serve --base-url "$URL" --num-prompts "$count" \
        --request-rate inf --num-client-processes "$CLIENTS" --vocab-size "$vocab" --metric-percentiles 50,99 \
        --result-json "$LOGS/$label.json" "$@" >"$LOGS/$label.log" 2>&1
    echo "== $label exit $? after $((SECONDS - started)) s"
    case $label in warm*) ;; *) cp "$LOGS/$label.json" "$OUT/" 2>/dev/null ;; esac
}

run_base() {
    start_server base || return
    bench warm_base "$WARM"
    bench base "$PROMPTS"
    stop_server
}

run_lora() {
    local modules names
    modules=$(timeout 300 python3 benchmarks/make_lora_adapters.py --model "$MODEL" --rank "$RANK" \
        --count "$ADAPTERS" --targets all --out "$LOGS/adapters" 2>"$LOGS/adapters.log") || {
        echo "== make_lora_adapters failed:"; tail -20 "$LOGS/adapters.log"; return
    }
    names=$(for module in $modules; do printf '%s ' "${module%%=*}"; done)
    echo "== adapters: $modules"
    # shellcheck disable=SC2086  # one word per module
    start_server lora --enable-lora --max-loras "$ADAPTERS" --max-lora-rank "$RANK" --lora-modules $modules || return
    # shellcheck disable=SC2086
    bench warm_lora "$WARM" --lora-modules "$MODEL" $names  # the base model and each adapter, in turn
    bench lora_base "$PROMPTS"
    # shellcheck disable=SC2086
    bench lora "$PROMPTS" --lora-modules $names
    stop_server
}

case "${1:-all}" in
all) install_wheels; run_base; run_lora ;;
base) install_wheels; run_base ;;
lora) install_wheels; run_lora ;;
table) trap - EXIT ;;  # only the table, from the JSON in $OUT
*) echo "usage: $0 [all|base|lora|table|fetch]" >&2; exit 2 ;;
esac

python3 - "$OUT" "$MODEL" <<'EOF'
import json, os, sys
out, model = sys.argv[1:]
runs = {}
for name in ("base", "lora_base", "lora"):
    path = os.path.join(out, name + ".json")
    runs[name] = json.load(open(path)) if os.path.exists(path) else None
base = runs["base"]
model = next((r["model_id"] for r in runs.values() if r), model)
print(f"LoRA cost on {model}: rate inf, rank-16 adapters on all seven targets; ratio = run / base (goal: within 15%)")
print(f"{'run':<10} {'ok/total':>9} {'req/s':>8} {'out tok/s':>10} {'TTFT p50/p99 ms':>16} {'TPOT p50 ms':>11} "
      f"{'req/s ratio':>11} {'tok/s ratio':>11} {'TPOT ratio':>10}")
for name, r in runs.items():
    if r is None:
        print(f"{name:<10} missing")
        continue
    line = (f"{name:<10} {r['completed']:>4}/{r['completed'] + r['failed']:<4} {r['request_throughput']:>8.2f} "
            f"{r['output_throughput']:>10.0f} {r['median_ttft_ms']:>7.0f}/{r['p99_ttft_ms']:<8.0f} "
            f"{r['median_tpot_ms']:>11.2f}")
    if base and name != "base":
        ratios = (r["request_throughput"] / base["request_throughput"], r["output_throughput"] / base["output_throughput"],
                  r["median_tpot_ms"] / base["median_tpot_ms"] if base["median_tpot_ms"] else float("nan"))
        ok = ratios[0] >= 0.85 and ratios[1] >= 0.85
        line += f" {ratios[0]:>11.3f} {ratios[1]:>11.3f} {ratios[2]:>10.3f} {'within 15%' if ok else 'OVER 15%'}"
    print(line)
    if r.get("lora_requests"):
        print("           per adapter (completed/sent): " + ", ".join(
            f"{n} {r['lora_completed'][n]}/{sent}" for n, sent in r["lora_requests"].items()))
    if r["failed"]:
        print(f"           {r['failed']} failed, e.g. {r['errors'][0][:200] if r['errors'] else ''}")
EOF
