"""Step-load trace against the same cluster config: kvtide's KV policy vs Ray's queue-length policy.

    .venv/bin/python -m kvtide.benchmarks.autoscale --out benchmarks/results/autoscale.md

Variants (one local cluster each, started and stopped in turn, same config otherwise):
- kv            autoscaling.policy=kv, warm start on (kvtide's default)
- kv-cold       autoscaling.policy=kv, warm start off (isolates the warm start)
- queue_length  Ray Serve's default request-count policy

Trace: `low` → `high` → `low` open-loop phases. Two request streams share the trace:
- load:   unique long prompts with long outputs, the KV-filling traffic;
- probes: one hot-group request (a shared ~1,000-token system prompt + a short question,
          one output token) every `probe_interval_s`. One output token makes the probe's
          end-to-end latency its time to first token, and the non-streamed response names
          the replica that served it (x-kvtide-replica), so the first probes a NEW replica
          serves are known: their TTFT is the warm-vs-cold figure.

Reported per variant: replica-seconds (∫ RUNNING engine replicas dt, from serve.status()
polled every second), probe TTFT p50/p99 per phase, time from the load step to the
scale decision and to the added replica serving (their difference is the new replica's
start, model load and warm-up), and TTFT of the new replica's first 3 probes.
Bounded: every phase has a fixed duration; every request a timeout; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtide.benchmarks.report import percentile

VARIANTS = {
    "kv": ["autoscaling.policy=kv", "autoscaling.warm_start.enabled=true"],
    "kv-cold": ["autoscaling.policy=kv", "autoscaling.warm_start.enabled=false"],
    "queue_length": ["autoscaling.policy=queue_length", "autoscaling.target_ongoing_requests=2"],
}
WORDS = "red green blue cyan magenta yellow black white orange purple brown pink gray olive navy teal".split()


@dataclass
class Trace:
    """Phase lengths (s) and load rates (req/s)."""

    low_s: float = 20.0
    high_s: float = 80.0
    tail_s: float = 60.0
    low_rate: float = 0.3
    high_rate: float = 2.5
    probe_interval_s: float = 0.5
    load_prompt_words: int = 600
    load_output_tokens: int = 160
    hot_prefix_words: int = 500

    def phase_at(self, t_s: float) -> str:
        if t_s < self.low_s:
            return "low"
        return "high" if t_s < self.low_s + self.high_s else "tail"


@dataclass
class Probe:
    sent_s: float
    latency_s: float | None
    replica: str
    phase: str


@dataclass
class RunResult:
    variant: str
    probes: list[Probe] = field(default_factory=list)
    replicas: list[tuple[float, int, int]] = field(default_factory=list)  # (t_s, running, target)
    load_errors: int = 0
    load_sent: int = 0


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _poll_replicas(app: str) -> tuple[int, int]:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "Engine" not in status.deployments:
        return 0, 0
    dep = status.deployments["Engine"]
    running = dep.replica_states.get("RUNNING", 0)
    target = sum(dep.replica_states.values())
    return running, target


async def _drive(base_url: str, model: str, trace: Trace, result: RunResult, app: str, seed: int) -> None:
    rng = random.Random(seed)
    hot = _words(random.Random(seed + 1), trace.hot_prefix_words)
    total_s = trace.low_s + trace.high_s + trace.tail_s
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        start = time.monotonic()
        tasks: list[asyncio.Task] = []

        async def load_one(i: int) -> None:
            result.load_sent += 1
            try:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": _words(random.Random(seed * 7919 + i), trace.load_prompt_words),
                    "max_tokens": trace.load_output_tokens})
                result.load_errors += r.status_code != 200
            except httpx.HTTPError:
                result.load_errors += 1

        async def probe_one(i: int) -> None:
            t = time.monotonic() - start
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": f"{hot} question {i}?", "max_tokens": 1})
                ok = r.status_code == 200
                result.probes.append(Probe(t, time.perf_counter() - t0 if ok else None,
                                           r.headers.get("x-kvtide-replica", ""), trace.phase_at(t)))
            except httpx.HTTPError:
                result.probes.append(Probe(t, None, "", trace.phase_at(t)))

        async def arrivals() -> None:
            i = 0
            while (t := time.monotonic() - start) < total_s:
                rate = trace.high_rate if trace.phase_at(t) == "high" else trace.low_rate
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals: pacing, not synchronisation
                tasks.append(asyncio.create_task(load_one(i)))
                i += 1

        async def probes() -> None:
            i = 0
            while time.monotonic() - start < total_s:
                tasks.append(asyncio.create_task(probe_one(i)))
                i += 1
                await asyncio.sleep(trace.probe_interval_s)

        async def watch() -> None:
            while (t := time.monotonic() - start) < total_s:
                running, target = await asyncio.to_thread(_poll_replicas, app)
                result.replicas.append((t, running, target))
                await asyncio.sleep(1.0)

        await asyncio.gather(arrivals(), probes(), watch())
        await asyncio.gather(*tasks)


def summarize_run(result: RunResult, trace: Trace) -> dict[str, Any]:
    step_s = trace.low_s
    replica_s = sum(running * 1.0 for _, running, _ in result.replicas)
    decision_s = next((t - step_s for t, _, target in result.replicas if t >= step_s and target >= 2), None)
    serving_s = next((t - step_s for t, running, _ in result.replicas if t >= step_s and running >= 2), None)
    first_replica = next((p.replica for p in result.probes if p.replica), "")
    new_first = [p.latency_s for p in sorted(result.probes, key=lambda p: p.sent_s)
                 if p.replica and p.replica != first_replica and p.latency_s is not None][:3]
    phases: dict[str, dict[str, float | None]] = {}
    for phase in ("low", "high", "tail"):
        lat = [p.latency_s for p in result.probes if p.phase == phase and p.latency_s is not None]
        phases[phase] = {"p50": percentile(lat, 50) if lat else None, "p99": percentile(lat, 99) if lat else None,
                         "n": len(lat)}
    return {
        "variant": result.variant, "replica_seconds": replica_s, "max_replicas_seen": max(
            (r for _, r, _ in result.replicas), default=0),
        "scale_decision_after_step_s": decision_s, "added_replica_serving_after_step_s": serving_s,
        "new_replica_first_probe_ttft_s": new_first, "probe_ttft_by_phase_s": phases,
        "load_sent": result.load_sent, "load_errors": result.load_errors,
        "probe_errors": sum(p.latency_s is None for p in result.probes),
    }


def run_variant(variant: str, base_overrides: list[str], trace: Trace, port: int, seed: int) -> dict[str, Any]:
    from kvtide.cluster import local
    from kvtide.config import load_config
    from kvtide.cluster.cli import default_config_path

    config = load_config(default_config_path(), [*base_overrides, *VARIANTS[variant], f"http.port={port}"])
    print(f"autoscale: {variant}: starting ...", flush=True)
    cluster = local.start(config)
    try:
        result = RunResult(variant)
        asyncio.run(_drive(cluster.base_url, cluster.model_name, trace, result, local.APP_NAME, seed))
    finally:
        local.stop()
    summary = summarize_run(result, trace)
    print(f"autoscale: {variant}: {summary}", flush=True)
    return summary


def _f(value: Any, scale: float = 1.0, digits: int = 0) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def markdown(summaries: list[dict[str, Any]], trace: Trace, command: str, overrides: list[str]) -> str:
    lines = [
        "# Autoscaling on a step load: KV policy vs Ray's queue-length policy", "",
        "Command:", "", f"    {command}", "",
        f"Cluster: the CPU demo config with {', '.join(f'`{o}`' for o in overrides)}.",
        f"Trace: {trace.low_s:.0f} s at {trace.low_rate} req/s → {trace.high_s:.0f} s at {trace.high_rate} req/s → "
        f"{trace.tail_s:.0f} s at {trace.low_rate} req/s of KV-filling requests (~{trace.load_prompt_words} words, "
        f"{trace.load_output_tokens} output tokens), plus a hot-prefix probe (1 output token) every "
        f"{trace.probe_interval_s} s whose latency is its TTFT.", "",
        "| variant | replica-seconds | max replicas | step → decision (s) | step → new replica serving (s) "
        "| new replica's first probes TTFT (ms) | TTFT p50/p99 low (ms) | high (ms) | tail (ms) | errors |",
        "|---|---:|---:|---:|---:|---|---|---|---|---:|",
    ]
    for s in summaries:
        ph = s["probe_ttft_by_phase_s"]
        first = ", ".join(_f(v, 1000) for v in s["new_replica_first_probe_ttft_s"]) or "–"
        lines.append(
            f"| {s['variant']} | {s['replica_seconds']:.0f} | {s['max_replicas_seen']} "
            f"| {_f(s['scale_decision_after_step_s'])} | {_f(s['added_replica_serving_after_step_s'])} | {first} | "
            + " | ".join(f"{_f(ph[p]['p50'], 1000)}/{_f(ph[p]['p99'], 1000)}" for p in ("low", "high", "tail"))
            + f" | {s['load_errors'] + s['probe_errors']} |")
    lines += ["", "The gap between decision and serving is the new replica's start: Ray scheduling, vLLM engine "
              "start and model load, and (kv) the warm-up prefill.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="kv,kv-cold,queue_length")
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--low-s", type=float, default=Trace.low_s)
    parser.add_argument("--high-s", type=float, default=Trace.high_s)
    parser.add_argument("--tail-s", type=float, default=Trace.tail_s)
    parser.add_argument("--high-rate", type=float, default=Trace.high_rate)
    parser.add_argument("--out", help="Markdown report path")
    args = parser.parse_args(argv)
    trace = Trace(low_s=args.low_s, high_s=args.high_s, tail_s=args.tail_s, high_rate=args.high_rate)
    overrides = [
        "metrics.port=8680", "replicas.num_replicas=null", "replicas.min_replicas=1", "replicas.max_replicas=2",
        "engine.max_model_len=2048", "engine.kv_cache_memory_bytes=16777216",
        "autoscaling.look_back_s=4", "autoscaling.upscale_delay_s=4", "autoscaling.downscale_delay_s=20",
        "autoscaling.max_step=1",
    ]
    summaries = [run_variant(v, overrides, trace, args.port, args.seed) for v in args.variants.split(",")]
    report = markdown(summaries, trace, "python -m kvtide.benchmarks.autoscale " + " ".join(argv or sys.argv[1:]), overrides)
    print(report)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
