"""Does Ray's worker preload take vLLM's import off a new engine replica's start?

    python -m kvtide.benchmarks.worker_preload --out-dir DIR [--num-cpus 16] [--idle-s 30]

Ray can import modules in every worker process before it runs anything
(`preload_python_modules`; `RAY_preload_python_modules` on a node). That shortens a replica's
start only if the replica lands on a worker that was started, and imported vLLM, before the
replica was asked for: an idle worker in Ray's pool. This runs, once without and once with
the preload, a Serve deployment placed as kvtide's engine replica is (a placement-group
bundle, one CPU) whose constructor imports what the engine replica's `import` phase
imports, lets the cluster idle, then makes Serve scale it 1 → 2 and reads the new replica's
phases: `process` (its worker process start → constructor) and `import`.

If a new replica always gets a fresh worker, the preload only moves the import from
`import` into `process` (and every other Ray worker of the node pays it too).
Writes DIR/worker_preload.json and DIR/report.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

# What EngineReplica.__init__ imports in its `import` phase (deployments/engine/replica.py).
ENGINE_IMPORTS = ("vllm", "vllm.v1.engine.async_llm")
VARIANTS = ("no_preload", "preload")
SCALE_UP_TIMEOUT_S = 300.0
# How long each scale-up request holds its replica: past Serve's autoscaling decision and
# the new replica's start on a loaded 2-core machine.
HOLD_S = 60.0


def summarize(variant: str, first: dict[str, float], new: dict[str, float], idle_workers: int) -> dict[str, Any]:
    """One variant's row: both replicas' phases and the new replica's process + import.

    That sum is what vLLM's import costs a new replica from its worker's start: the preload
    shortens a start only if it lowers the sum (the import ran before Serve asked for the
    replica), not if it moves time from `import` into `process`.
    """
    return {"variant": variant, "first_replica": first, "new_replica": new,
            "new_replica_process_plus_import_s": round(new["process"] + new["import"], 2),
            "idle_workers_before_scale_up": idle_workers}


def markdown(rows: list[dict[str, Any]], command: str, hardware: str) -> str:
    lines = ["# Ray worker preload and a new replica's start", "",
             f"Hardware: {hardware}. Command:", "", f"    {command}", "",
             "A Serve deployment placed as kvtide's engine replica (placement-group bundle, 1 CPU) whose "
             f"constructor imports {', '.join(ENGINE_IMPORTS)} (the engine replica's `import` phase), "
             "scaled 1 → 2 after the cluster idled. `process`: the replica's worker process start → its "
             "constructor; `import`: the constructor's imports.", "",
             "| variant | idle Ray workers before the scale-up | first replica process / import (s) | "
             "new replica process / import (s) | new replica process + import (s) | Serve controller / proxy RSS (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        first, new, rss = r["first_replica"], r["new_replica"], r.get("serve_workers_rss_mib", {})
        lines.append(f"| {r['variant']} | {r['idle_workers_before_scale_up']} | "
                     f"{first['process']:.2f} / {first['import']:.2f} | {new['process']:.2f} / {new['import']:.2f} | "
                     f"{r['new_replica_process_plus_import_s']:.2f} | "
                     f"{rss.get('ServeController', '–')} / {rss.get('ProxyActor', '–')} |")
    by = {r["variant"]: r for r in rows}
    if set(VARIANTS) <= by.keys():
        ratio = by["preload"]["new_replica_process_plus_import_s"] / by["no_preload"]["new_replica_process_plus_import_s"]
        lines += ["", f"New replica's process + import with the preload: {ratio:.2f}× without it."]
    return "\n".join(lines) + "\n"


def _idle_workers() -> int:
    import psutil

    count = 0
    for proc in psutil.process_iter(["cmdline"]):
        try:
            count += "ray::IDLE" in " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
    return count


def _other_workers_rss_mib() -> dict[str, int]:
    """Resident MiB of Serve's own Ray workers (controller, proxy): what the preload adds to every worker."""
    import psutil

    rss: dict[str, int] = {}
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        title = " ".join(proc.info["cmdline"] or [])
        for name in ("ServeController", "ProxyActor"):
            if title.startswith(f"ray::{name}"):
                rss[name] = proc.info["memory_info"].rss >> 20
    return rss


def run_variant(variant: str, num_cpus: int, idle_s: float) -> dict[str, Any]:
    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, placement_group_bundles=[{"CPU": 1}],
                      max_ongoing_requests=1,
                      autoscaling_config={"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
                                          "target_ongoing_requests": 1, "upscale_delay_s": 0,
                                          "downscale_delay_s": 600, "look_back_period_s": 11})
    class ImportingReplica:
        def __init__(self) -> None:
            import importlib

            import psutil

            constructor_s = time.time()
            for module in ENGINE_IMPORTS:
                importlib.import_module(module)
            self.phases = {"process": round(constructor_s - psutil.Process().create_time(), 2),
                           "import": round(time.time() - constructor_s, 2), "pid": os.getpid()}

        async def __call__(self, hold_s: float = 0.0) -> dict[str, float]:
            await asyncio.sleep(hold_s)
            return self.phases

    system_config = {"preload_python_modules": list(ENGINE_IMPORTS)} if variant == "preload" else {}
    ray.init(num_cpus=num_cpus, include_dashboard=False, _system_config=system_config)
    try:
        handle = serve.run(ImportingReplica.bind(), name="preload_probe")
        first = handle.remote().result()
        time.sleep(idle_s)  # the scenario: a cluster that has served a while, then scales
        idle, other_rss = _idle_workers(), _other_workers_rss_mib()
        holds = [handle.remote(HOLD_S) for _ in range(3)]  # over target: Serve adds the second replica
        deadline = time.monotonic() + SCALE_UP_TIMEOUT_S
        new = None
        while new is None and time.monotonic() < deadline:
            seen = handle.remote().result()
            if seen["pid"] != first["pid"]:
                new = seen
        for hold in holds:
            hold.cancel()
        if new is None:
            raise RuntimeError(f"{variant}: no second replica within {SCALE_UP_TIMEOUT_S:.0f} s")
        return summarize(variant, first, new, idle) | {"serve_workers_rss_mib": other_rss}
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--num-cpus", type=int, default=16, help="the node's Ray CPUs (Ray pre-starts as many workers)")
    parser.add_argument("--idle-s", type=float, default=30.0, help="seconds the cluster idles before the scale-up")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = [run_variant(v, args.num_cpus, args.idle_s) for v in VARIANTS]
    command = "python -m kvtide.benchmarks.worker_preload " + shlex.join(argv if argv is not None else sys.argv[1:])
    hardware = f"CPU, {platform.machine()}, {os.cpu_count()} cores"
    (args.out_dir / "worker_preload.json").write_text(json.dumps({"hardware": hardware, "command": command,
                                                                   "variants": rows}, indent=2) + "\n")
    (args.out_dir / "report.md").write_text(markdown(rows, command, hardware))
    print(markdown(rows, command, hardware))
    return 0


if __name__ == "__main__":
    sys.exit(main())
