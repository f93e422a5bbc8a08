#!/usr/bin/env bash
# Run here (with network) before benchmarks/gpu_check.sh goes to a GPU machine that has no package registry:
# downloads into .whl/ the Python 3.12 wheels that atrctl needs beyond that machine's image (torch 2.11,
# transformers 5.17, no datasets or math-verify), at the versions this checkout's .venv holds.  Seen on an
# H200 image on 2026-12-04: transformers >= 5.24 pulls huggingface_hub 2.x (httpx2, httpcore2, truststore)
# and kernels (tomlkit); the image's own huggingface_hub 1.x and regex are too old for it.
#   benchmarks/gpu_wheels.sh && echo /.whl/ >> .git/info/exclude     # then carry .whl to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(transformers huggingface_hub httpx2 httpcore2 truststore kernels tomlkit datasets dill multiprocess
          math-verify latex2sympy2_extended antlr4-python3-runtime regex click idna anyio h11)
pins=()
for name in "${packages[@]}"; do
    version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
    [ -n "$version" ] || { echo "gpu_wheels.sh: $name is not in .venv: install the project first (README)" >&2; exit 2; }
    pins+=("$name==$version")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${pins[@]}"
du -sh .whl
