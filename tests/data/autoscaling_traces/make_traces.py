"""Generate the autoscaling replay traces in this folder (seeded: the same files every run).

    .venv/bin/python tests/data/autoscaling_traces/make_traces.py           # rewrite the traces
    .venv/bin/python tests/data/autoscaling_traces/make_traces.py --check   # exit 1 if a file is stale

These are SYNTHETIC traces shaped after what a vLLM fleet reports, not recordings: the
repository holds no KV time series (benchmarks/results/autoscale.md keeps only summary
figures, and benchmarks/autoscale.py records replica counts and probe latencies, not
engine stats). The shapes follow vLLM's behaviour: `kv_cache_usage` climbs while
requests are admitted and sits just under 1.0 when the cache is full (the scheduler
keeps a few blocks free), requests then wait in the scheduler queue, and decode growth
past a full cache preempts running requests.

One JSON file per trace: `meta` (name, what it models, the tick, the marks the unit
tests measure from) and one row per tick, one line each:

    t_s, num_running_replicas, kv_usage_perc, num_waiting, num_preemptions

- `kv_usage_perc`   mean over the fleet's replicas of the share of KV blocks in use, 0..1
- `num_waiting`     requests waiting in the engines' queues, summed over the fleet
- `num_preemptions` preemptions during this tick, summed over the fleet (a delta)

The fleet size is fixed (the trace is the load as that fleet saw it); a replay that
scales spreads the same KV load over its own replica count (tests/unit/test_autoscaling_law.py).

Traces:
- step.json          low load (KV ~0.3) → a saturating step at t=60 s: KV climbs to 0.98
                     in 4 s, then requests wait and get preempted; the load leaves at t=240 s.
- noisy_steady.json  KV wandering 0.55..0.8 (a slow swing plus autocorrelated noise), no trend.
- slow_ramp.json     KV flat at 0.4, then +1 %/s from t=30 s until it saturates at 0.98.
- burst.json         KV ~0.5 with one 3 s burst to 0.95 (a few requests wait) at t=120 s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
TICK_S = 1.0  # the Serve controller sees a new stats sample about every push interval (1-2 s)
SEED = 13  # issue #13
COLUMNS = ["t_s", "num_running_replicas", "kv_usage_perc", "num_waiting", "num_preemptions"]
FULL_KV_PERC = 0.98  # where vLLM's kv_cache_usage sits when the cache is full

Row = list[float]


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's sampler: small means only (preemptions per tick)."""
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def step(rng: random.Random) -> tuple[dict, list[Row]]:
    replicas, rows, waiting = 2, [], 0.0
    for i in range(600):
        t = i * TICK_S
        if t < 60:
            kv, waiting, preempted = 0.3 + rng.gauss(0, 0.01), 0.0, 0
        elif t < 64:
            kv, preempted = 0.3 + (FULL_KV_PERC - 0.3) * (t - 60 + 1) / 4, 0
        elif t < 240:
            kv = FULL_KV_PERC + rng.gauss(0, 0.004)
            waiting = min(waiting + 1.5, 24.0) + rng.choice((-1, 0, 1)) if t >= 65 else 0.0
            preempted = _poisson(rng, 0.6) if t >= 66 else 0
        else:
            kv, waiting, preempted = 0.25 + rng.gauss(0, 0.01), max(waiting - 6.0, 0.0), 0
        rows.append([t, replicas, round(_clip(kv, 0.0, 1.0), 4), max(round(waiting), 0), preempted])
    meta = {"saturation_start_s": 60.0, "load_end_s": 240.0}
    return meta, rows


def noisy_steady(rng: random.Random) -> tuple[dict, list[Row]]:
    replicas, rows, wander = 2, [], 0.0
    tau_s, wander_sd = 10.0, 0.03  # Ornstein-Uhlenbeck: requests come and go over ~10 s
    for i in range(900):
        t = i * TICK_S
        wander += -wander / tau_s * TICK_S + wander_sd * math.sqrt(2 * TICK_S / tau_s) * rng.gauss(0, 1)
        swing = 0.07 * math.sin(2 * math.pi * t / 90.0)
        kv = _clip(0.675 + swing + wander + rng.gauss(0, 0.01), 0.55, 0.80)
        waiting = 1 if rng.random() < 0.05 else 0  # the odd request waits one tick
        rows.append([t, replicas, round(kv, 4), waiting, 0])
    return {"kv_range": [0.55, 0.80]}, rows


def slow_ramp(rng: random.Random) -> tuple[dict, list[Row]]:
    replicas, rows, waiting = 2, [], 0.0
    for i in range(300):
        t = i * TICK_S
        kv = 0.4 if t < 30 else min(0.4 + 0.01 * (t - 30), FULL_KV_PERC)
        saturated = kv >= FULL_KV_PERC
        waiting = min(waiting + 1.0, 20.0) if saturated else 0.0
        preempted = _poisson(rng, 0.3) if saturated else 0
        rows.append([t, replicas, round(_clip(kv + rng.gauss(0, 0.005), 0.0, 1.0), 4), round(waiting), preempted])
    return {"ramp_start_s": 30.0, "ramp_perc_per_s": 0.01}, rows


def burst(rng: random.Random) -> tuple[dict, list[Row]]:
    replicas, rows = 2, []
    shape = {120: (0.80, 0), 121: (0.95, 3), 122: (0.90, 2)}  # up, peak, leaving: 3 s above 0.5
    for i in range(600):
        t = i * TICK_S
        kv, waiting = shape.get(int(t), (0.5 + rng.gauss(0, 0.01), 0))
        rows.append([t, replicas, round(_clip(kv, 0.0, 1.0), 4), waiting, 0])
    return {"burst_start_s": 120.0, "burst_end_s": 123.0}, rows


TRACES: dict[str, tuple[str, Callable[[random.Random], tuple[dict, list[Row]]]]] = {
    "step": ("Low load, then a saturating step at t=60 s; the load leaves at t=240 s.", step),
    "noisy_steady": ("KV wandering 0.55..0.8 with noise and no trend.", noisy_steady),
    "slow_ramp": ("KV +1 %/s from t=30 s until the cache is full.", slow_ramp),
    "burst": ("A 3 s burst to KV 0.95 on a steady 0.5.", burst),
}


def render(name: str) -> str:
    description, make = TRACES[name]
    meta, rows = make(random.Random(f"{SEED}:{name}"))
    head = {"name": name, "description": description, "synthetic": True, "tick_s": TICK_S, **meta}
    lines = ",\n".join("    " + json.dumps(row) for row in rows)
    return (f'{{\n  "meta": {json.dumps(head)},\n  "columns": {json.dumps(COLUMNS)},\n'
            f'  "rows": [\n{lines}\n  ]\n}}\n')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed trace differs")
    args = parser.parse_args(argv)
    stale = []
    for name in TRACES:
        path, text = HERE / f"{name}.json", render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run {Path(__file__).name} and commit the result", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
