#!/usr/bin/env bash
# The fused layer, the prefill profile and the attention backends on one H200 (kind nvidia-h200):
#
#   bash benchmarks/h200_device_path.sh quick     # one short call: the fused kernels' GPU tests, decode_profile.py
#                                                 #   (llama-3-8b and smollm2-135m) and prefill_profile.py
#
# or two calls back to back on one machine (the first unpacks the CUDA 13 build of the CuTe DSL for the second):
#
#   bash benchmarks/h200_device_path.sh profiles  # carrying .whl/cu13: decode_profile.py (random:llama-3-8b
#                                                 #   at batch 64/128/256, random:smollm2-135m likewise) and
#                                                 #   prefill_profile.py (chunks of 512/2048/8192, 2048 + 256 decode)
#   bash benchmarks/h200_device_path.sh flash     # carrying .whl/fa: flash-attn-4 and the rest of its wheels
#                                                 #   installed; the GPU test files, then attention_backends.py
#
# The wheels (never committed; .whl/ is git-ignored), fetched here with pip download for CPython 3.12
# manylinux x86_64: flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1 with -libs-base and -libs-core,
# apache-tvm-ffi, torch-c-dlpack-ext and quack-kernels into .whl/fa; nvidia-cutlass-dsl-libs-cu13 4.8.1
# (92 MB, over one call's 64 MiB) unzipped and repacked as .whl/cu13/cu13.tar.xz (62 MB):
#   mkdir -p /tmp/cu13 && unzip -q nvidia_cutlass_dsl_libs_cu13-4.8.1-*.whl -d /tmp/cu13
#   tar -C /tmp/cu13 -cf - . | xz -9 > .whl/cu13/cu13.tar.xz
# The wheels share top folders, so they are unzipped into one directory (pip --target skips a folder that
# exists), and nvidia_cutlass_dsl/dsl_packages goes on PYTHONPATH (pip --target ignores the .pth that adds it).
set -u
OUT=${OUT:-.bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/engine:${PYTHONPATH:-} PYTHONUNBUFFERED=1
SITE=/tmp/fa_site

case "${1:-}" in
quick)
    # one short call, no flash-attn: the fused kernels' GPU tests, then both decode profiles and the prefill profile
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
    timeout 50 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused.py \
        tests/engine/test_decode_graphs.py -k "gpu or cuda" >"$OUT/tests.log" 2>&1
    echo "== tests exit $?"
    tail -n 4 "$OUT/tests.log"
    timeout 100 python3 benchmarks/decode_profile.py 2>"$OUT/decode_profile.log" >"$OUT/decode_llama.md"
    echo "== decode_profile llama-3-8b exit $?"
    timeout 55 python3 benchmarks/prefill_profile.py 2>"$OUT/prefill_profile.log" >"$OUT/prefill.md"
    echo "== prefill_profile exit $?"
    OUT=/tmp/small timeout 35 python3 benchmarks/decode_profile.py --model random:smollm2-135m \
        2>"$OUT/decode_smollm2.log" >"$OUT/decode_smollm2.md"
    echo "== decode_profile smollm2-135m exit $?"
    cat "$OUT/decode_llama.md" "$OUT/prefill.md" "$OUT/decode_smollm2.md"
    ;;
profiles)
    mkdir -p $SITE && (tar -C $SITE -xJf .whl/cu13/cu13.tar.xz && echo "== cu13 unpacked") &
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
    timeout 150 python3 benchmarks/decode_profile.py 2>"$OUT/decode_profile.log" >"$OUT/decode_llama.md"
    echo "== decode_profile llama-3-8b exit $?"
    cp "$OUT/decode_profile.txt" "$OUT/decode_llama.txt" 2>/dev/null
    OUT=/tmp/small timeout 60 python3 benchmarks/decode_profile.py --model random:smollm2-135m \
        2>"$OUT/decode_smollm2.log" >"$OUT/decode_smollm2.md"
    echo "== decode_profile smollm2-135m exit $?"
    timeout 100 python3 benchmarks/prefill_profile.py 2>"$OUT/prefill_profile.log" >"$OUT/prefill.md"
    echo "== prefill_profile exit $?"
    rm -f "$OUT/decode_profile.txt"
    wait
    cat "$OUT/decode_llama.md" "$OUT/decode_smollm2.md" "$OUT/prefill.md"
    ;;
flash)
    # $SITE holds the cu13 libraries if the first call ran on this machine; without them flash-attn fails to
    # import and its tests and variants are skipped
    mkdir -p $SITE && for wheel in .whl/fa/*.whl; do python3 -m zipfile -e "$wheel" $SITE; done
    export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
    python3 -c "import flash_attn.cute; print('== flash_attn.cute imports')" 2>&1 | tail -3
    timeout 130 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused.py \
        tests/kernels/test_attention_backends.py tests/engine/test_decode_graphs.py \
        tests/kernels/test_triton_attention.py -k "not test_decode_gpu or 256" >"$OUT/tests.log" 2>&1
    echo "== tests exit $?"
    tail -n 25 "$OUT/tests.log"
    timeout 140 python3 benchmarks/attention_backends.py --budget 120 2>"$OUT/attention_backends.log" \
        | tee "$OUT/attention_backends.md"
    echo "== attention_backends exit ${PIPESTATUS[0]}"
    ;;
*)
    echo "usage: $0 profiles|flash" >&2
    exit 2
    ;;
esac
