#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels `lockstep serve` needs on the H200 machine and that its
# image lacks (the image has torch, triton, numpy, httpx, h11, anyio, click, jinja2, prometheus-client,
# psutil, matplotlib, annotated-doc; KINDS.md lists them). llguidance (guided decoding) and gguf (GGUF
# models) stay behind: the benchmark sends no grammars and loads a random: model. The versions are the ones `make install`
# put on the development machine. benchmarks/h200_session.sh installs them there with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# Run from the repository root: bash benchmarks/fetch_gpu_wheels.sh
set -eu
WHEELS=(
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.5
    typing_extensions==4.16.0 opentelemetry-api==1.45.2  # fastapi imports opentelemetry at import time
    httptools==0.9.0  # the engine's and the gateway's HTTP/1.1 parser, the gateway's client to the engines
    uvloop==0.23.0    # uvicorn's event loop (loop="auto" takes it when installed)
    py-spy==0.4.3     # sampling profiles of the served processes (benchmarks/spy_summary.py)
)
mkdir -p .whl
for wheel in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$wheel"
done
ls -l .whl
du -sh .whl
