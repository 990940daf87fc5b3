#!/bin/bash
# Stage vLLM 0.29.0 + torch 2.13.0 (requirements-vllm029.txt) for the H200 device, beside the
# vLLM 0.26 set of ../shared/gpu/stage-wheels.sh, as .gpu/n0 ... .gpu/nK (parts of PART_MB MB, default 47,
# one device call per part, copied to /tmp/wn: a device call carries at most 64 MiB with the working
# tree, ~16 MB since the committed results grew; stage-all.sh sizes them). run.sh installs them into /tmp/site2, first on
# PYTHONPATH, when VLLM029=1: every server of a run (kvtide, bare vLLM, Ray Serve LLM) then uses
# the same vLLM.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=benchmarks/h200
rm -rf .gpu/n* .gpu/wheels029 && mkdir -p .gpu/wheels029
platforms=""
for n in 17 24 27 28 31 34 35 39; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
python3 -m pip download --no-deps -q -d .gpu/wheels029 -r "$here/requirements-vllm029.txt" \
  --python-version 3.12 --implementation cp --only-binary=:all: $platforms --platform manylinux2014_x86_64
tar cf .gpu/wheels029.tar -C .gpu/wheels029 . && rm -rf .gpu/wheels029
split -b "${PART_MB:-47}MB" -d -a 2 .gpu/wheels029.tar .gpu/npart- && rm .gpu/wheels029.tar
for p in .gpu/npart-*; do i=$((10#${p##*-})); mkdir -p ".gpu/n$i" && mv "$p" ".gpu/n$i/"; done
echo "staged: $(ls -d .gpu/n* | wc -l) chunks .gpu/nN; carry each in its own device call:"
echo "  mkdir -p /tmp/wn && cp .gpu/nN/npart-* /tmp/wn/"
