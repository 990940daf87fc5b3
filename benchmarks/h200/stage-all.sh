#!/bin/bash
# Stage everything a GPU session carries, on a fresh checkout (.gpu/ is git-ignored and lost
# between sessions): ../shared/gpu's vLLM 0.26 set, re-split into parts that fit one device call
# beside the tracked tree (a call carries at most 64 MiB; the tree is ~16 MB), the vLLM 0.29 set
# (stage-vllm029.sh) and kvtide's wheel (stage-kvtide.sh). ~2 min from the local package cache.
# Then: one device call per .gpu/cN (cp .gpu/cN/part-* /tmp/wc/) and per .gpu/nN
# (cp .gpu/nN/npart-* /tmp/wn/), then `run.sh start` carrying .gpu/extra and .gpu/kvtide.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash ../shared/gpu/stage-wheels.sh
tree_mb=$(( $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) / 1000000 ))
part_mb=$(( 63 - tree_mb ))  # MB (10^6): 64 MiB is 67.1 MB; keep ~4 MB spare
cat $(ls -d .gpu/c[0-9]* | sort -V | sed 's|$|/part-*|') > .gpu/wheels.tar
rm -rf .gpu/c[0-9]*
split -b "${part_mb}MB" -d -a 2 .gpu/wheels.tar .gpu/part- && rm .gpu/wheels.tar
for p in .gpu/part-*; do i=$((10#${p##*-})); mkdir -p ".gpu/c$i" && mv "$p" ".gpu/c$i/"; done
PART_MB=$part_mb bash benchmarks/h200/stage-vllm029.sh
bash benchmarks/h200/stage-kvtide.sh
echo "staged with ${part_mb} MB parts: $(ls -d .gpu/c[0-9]* | wc -l) x cN, $(ls -d .gpu/n[0-9]* | wc -l) x nN"
