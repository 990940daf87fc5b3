#!/bin/bash
# A/B, run from the repo root of a checkout that has the change (and .venv):
#   bash benchmarks/results/overhead-cpu-peer-asgi/ab.sh
# The routing peer as FastAPI (old: 3c181fc) vs a bare ASGI callable (new), one kvtide serve
# each, alternating; each prints the idle consult and `ttft_paths` (full, consult, replica).
set -u
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
git show 3c181fc:deployments/router_peer.py > "$work/peer_old.py"
cp deployments/router_peer.py "$work/peer_new.py"
for v in new old new old; do
  cp "$work/peer_$v.py" deployments/router_peer.py
  .venv/bin/kvtide serve --replicas 1 > "$work/serve_$v.log" 2>&1 &
  for _ in $(seq 1 90); do grep -q "kvtide: ready" "$work/serve_$v.log" && break; sleep 2; done
  (cd "$work" && echo "$v $("$OLDPWD/.venv/bin/python" "$here/consult.py" 305 480)")
  (cd "$work" && "$OLDPWD/.venv/bin/python" -m kvtide.benchmarks.ttft_paths kvtide -n 30 | sed "s/^/$v /")
  pid=$(pgrep -f "bin/kvtide serve" | head -1); kill -INT "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 1; done; sleep 3
done
cp "$work/peer_new.py" deployments/router_peer.py
