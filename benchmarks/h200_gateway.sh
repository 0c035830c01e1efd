#!/usr/bin/env bash
# The gateway in front of one default engine on one H200 (kind nvidia-h200), against the same engine
# direct: a 1000-request burst (rate inf) and Poisson 25 req/s (600 requests; BURST, RATE, POISSON), sharegpt-synth,
# streamed, ignore_eos, `lockstep bench serve` as the client. Every run sends prompt ids of its own
# (--vocab-size differs per run: the same lengths, other ids), so no run hits another's prefix cache.
# The gateway's CPU seconds per run come from /proc (the gateway and its workers).
#
#   bash benchmarks/fetch_gpu_wheels.sh        # here, once: the serve wheels into .whl/ (+ httptools)
#   bash benchmarks/h200_gateway.sh            # there, carrying .whl; WORKERS=N for --workers N
#
# The table goes to stdout; JSON results and logs to $OUT.
set -u
OUT=${OUT:-.bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/engine:$PWD/gateway:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if ! python3 -c "import fastapi, uvicorn, httptools" 2>/dev/null; then  # the H200 image lacks them
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
MODEL=${MODEL:-random:llama-3-8b}
WORKERS=${WORKERS:-1}
BURST=${BURST:-1000} POISSON=${POISSON:-600} RATE=${RATE:-25}
VOCAB=${VOCAB:-128000} STEP=${STEP:-1000}  # prompt ids below VOCAB, VOCAB-STEP, ... (one range per run)
ENGINE=http://127.0.0.1:8100
GATEWAY=http://127.0.0.1:8000

python3 -m lockstep.cli serve "$MODEL" --port 8100 >"$OUT/engine.log" 2>&1 &
engine_pid=$!
python3 -m lockstep.cli gateway --engine "$ENGINE" --port 8000 --workers "$WORKERS" >"$OUT/gateway.log" 2>&1 &
gateway_pid=$!
trap 'kill $gateway_pid $engine_pid 2>/dev/null; wait 2>/dev/null' EXIT

wait_for() {  # URL, seconds: until it answers 200
    local deadline=$((SECONDS + $2))
    until curl -sf -o /dev/null --max-time 2 "$1"; do
        if [ $SECONDS -ge $deadline ]; then echo "== $1 not up after $2 s" >&2; tail -20 "$OUT/engine.log"; exit 1; fi
        sleep 1
    done
}
wait_for "$ENGINE/health" 240
echo "== engine up after $SECONDS s"
deadline=$((SECONDS + 30))
until curl -sf --max-time 2 "$GATEWAY/v1/models" | grep -q '"id"'; do
    if [ $SECONDS -ge $deadline ]; then echo "== gateway lists no model" >&2; tail -20 "$OUT/gateway.log"; exit 1; fi
    sleep 0.5
done

gateway_cpu() {  # CPU seconds of the gateway process tree
    python3 - "$gateway_pid" <<'EOF'
import os, sys
root = int(sys.argv[1])
tick = os.sysconf("SC_CLK_TCK")
children = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    children.setdefault(int(fields[1]), []).append((int(pid), int(fields[11]) + int(fields[12])))
total, todo = 0, [root]
try:
    fields = open(f"/proc/{root}/stat").read().rsplit(")", 1)[1].split()
    total = int(fields[11]) + int(fields[12])
except OSError:
    pass
while todo:
    for pid, ticks in children.get(todo.pop(), []):
        total += ticks
        todo.append(pid)
print(total / tick)
EOF
}

run() {  # label, base URL, rate, num prompts, vocab size
    local before after
    before=$(gateway_cpu)
    timeout 240 python3 -m lockstep.cli bench serve --base-url "$2" --request-rate "$3" --num-prompts "$4" \
        --vocab-size "$5" --result-json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
    echo "== $1 exit $?"
    after=$(gateway_cpu)
    python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$before" "$after" >"$OUT/$1.cpu"
}
run direct_burst "$ENGINE" inf "$BURST" "$VOCAB"
run gateway_burst "$GATEWAY" inf "$BURST" $((VOCAB - STEP))
run direct_poisson "$ENGINE" "$RATE" "$POISSON" $((VOCAB - 2 * STEP))
run gateway_poisson "$GATEWAY" "$RATE" "$POISSON" $((VOCAB - 3 * STEP))

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
print(f"{'run':<18} {'ok/total':>9} {'req/s':>7} {'out tok/s':>9} {'TTFT p50/p99 ms':>16} {'ITL max ms':>10} {'gw CPU s':>8}")
for name in ("direct_burst", "gateway_burst", "direct_poisson", "gateway_poisson"):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        print(f"{name:<18} missing"); continue
    r = json.load(open(path))
    cpu = open(os.path.join(out, name + ".cpu")).read().strip() if name.startswith("gateway") else "-"
    itls = [g for per in r.get("itls", []) for g in per] if isinstance(r.get("itls"), list) else []
    itl_max = max(itls) * 1000 if itls else r.get("max_itl_ms", float("nan"))
    total = r["completed"] + r["failed"]
    print(f"{name:<18} {r['completed']:>4}/{total:<4} {r['request_throughput']:>7.2f} {r['output_throughput']:>9.0f} "
          f"{r['median_ttft_ms']:>7.0f}/{r['p99_ttft_ms']:<8.0f} {itl_max:>10.0f} {cpu:>8}")
EOF
