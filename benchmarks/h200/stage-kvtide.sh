#!/bin/bash
# Build kvtide's wheel into .gpu/kvtide (git-ignored) for the device machine, which has no
# editable install: run.sh unpacks it onto PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu/kvtide && mkdir -p .gpu/kvtide
src=$(mktemp -d)
git ls-files -z | xargs -0 -I{} cp --parents {} "$src"
python3 -m pip wheel --quiet --no-deps --wheel-dir .gpu/kvtide "$src"
rm -rf "$src"
# The device copy has no .git: run.sh exports this as KVTIDE_COMMIT for the results' provenance.
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!benchmarks/results' || echo -dirty)" > .gpu/kvtide/COMMIT
# The shared Mooncake trace (../shared does not travel to the device): run.sh's trace stage reads it here.
cp ../shared/traces/mooncake-synthetic.jsonl .gpu/kvtide/
ls .gpu/kvtide
