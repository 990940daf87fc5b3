"""Step-load trace against the same cluster config: kvtide's KV policy vs Ray's queue-length policy.

    .venv/bin/python -m kvtide.benchmarks.autoscale --out-dir benchmarks/results/autoscale-cpu
    .venv/bin/python -m kvtide.benchmarks.autoscale --config config/presets/gpu-demo.yaml \\
        --set replicas.num_replicas=null --set replicas.min_replicas=1 --set replicas.max_replicas=4 \\
        --hardware "NVIDIA H200 x2" --out-dir benchmarks/results/autoscale-h200

Variants (one local cluster each, started and stopped in turn, same config otherwise):
- kv-standby    kv with one standby engine (autoscaling.standby_replicas=1): a scale-up wakes it
- kv            autoscaling.policy=kv, warm start on (kvtide's default): a scale-up starts a replica
- kv-cold       autoscaling.policy=kv, warm start off (isolates the warm start)
- queue_length  Ray Serve's request-count policy (target_ongoing_requests from --queue-target-ongoing)
- fixed-max     no autoscaling: the fleet fixed at the config's max_replicas from the start,
                what a team without an autoscaler provisions (the latency floor and the cost ceiling)

Config: `--config` (default: the CPU demo config, which then gets CPU_OVERRIDES), then
TRACE_OVERRIDES (the short autoscaling windows this trace needs), then every `--set`, then
the variant's own overrides. The config must autoscale (replicas.min_replicas/max_replicas).

Trace: `low` → `high` → `low` open-loop phases. Two request streams share the trace:
- load:   unique long prompts with long outputs (streamed, ignore_eos), the KV-filling traffic;
          its TTFT is the time to the first streamed token;
- probes: one hot-group request (a shared system prompt + a short question, one output
          token) every `probe_interval_s`. One output token makes the probe's end-to-end
          latency its time to first token, and the non-streamed response names the replica
          that served it (x-kvtide-replica), so the first probes a NEW replica serves are
          known: their TTFT is the warm-vs-cold figure.

Sampled every second: serve.status() (RUNNING and target engine replicas), the live engine
replica ids (Serve's named replica actors), and the cluster's Prometheus text for
`ray_vllm_kv_cache_usage_perc` per `ReplicaId` (Ray exports it every --metrics-interval-ms)
and each replica's start-up by phase (`ray_kvtide_engine_start_phase_seconds`; details
"start_phases_s" and "new_replica_start_phases_s").

Reported per variant (`autoscale.json` → "variants", exactly these keys):
- step_to_decision_s          load step → first sample whose target replicas, standbys not
                              counted (the roles the autoscaler publishes), exceed those at the
                              step (null: no scale-up, or fixed-max)
  (details: "saturation_onset_s", the step → the first probe that waited, TTFT > 5× the low
  phase's median and > 0.1 s, where KV saturation shows to a client; and
  "saturation_to_decision_s", onset → decision: what the ≤ 5 s target counts)
- step_to_serving_s           load step → first sample in which a replica that served nothing
                              before the step runs requests (vLLM's running-requests gauge per
                              replica; without it: more RUNNING replicas than at the step)
- decision_to_serving_s       the gap between the two: a woken standby's wake and warm-up, or a
                              new replica's start, model load and warm-up
- new_replica_hot_ttft_p50_ms TTFT p50 (ms) of the first `--hot-probes` (20) probes served by the
                              new replica: the first replica that serves a probe sent after the
                              step and was not live (nor serving probes) before it (null: none)
- replica_seconds             ∫ RUNNING engine replicas dt over the trace
- slo_violations              load and probe requests that did not get a first token within
                              `--slo-ttft-s` (default 1.0 s): TTFT > SLO, or failed, or
                              finished without a token (failures count here and under errors)
- errors                      failed load and probe requests
Elsewhere in the JSON: "hardware", "command", "config", "slo_ttft_s", "hot_probes", "trace",
"details" (per variant: probe TTFT by phase, max replicas, request counts, error kinds,
the new replica's id and TTFTs), "timeline" (per variant: the samples and probes the plot shows)
and "failed" (variants that did not run, with why). report.md has the table and
timeline.png (per variant over time: replicas taking traffic, mean KV usage over the live
replicas, probe TTFT). The files are rewritten after every variant.
Bounded: every phase has a fixed duration; every request a timeout; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import httpx

from kvtide.benchmarks.report import DEFAULT_SLO_TTFT_S, percentile
from kvtide.deployments.engine.start_phases import PHASES

VARIANT_NAMES = ("kv-standby", "kv", "kv-cold", "queue_length", "fixed-max")
VARIANT_KEYS = ("variant", "step_to_decision_s", "decision_to_serving_s", "step_to_serving_s",
                "new_replica_hot_ttft_p50_ms", "replica_seconds", "slo_violations", "errors")
# The CPU demo config sized for this trace on a 2-core machine (only without --config).
CPU_OVERRIDES = [
    "metrics.port=8680", "replicas.num_replicas=null", "replicas.min_replicas=1", "replicas.max_replicas=2",
    "engine.max_model_len=2048", "engine.kv_cache_memory_bytes=16777216",
]
# Autoscaling windows short enough for a few-minute trace (any config; --set overrides them).
# max_step stays the config's (2): the law sizes a step for the queue, as queue_length does.
TRACE_OVERRIDES = [
    "autoscaling.look_back_s=4", "autoscaling.upscale_delay_s=4", "autoscaling.downscale_delay_s=20",
]
KV_METRIC = "ray_vllm_kv_cache_usage_perc"
RUNNING_REQUESTS_METRIC = "ray_vllm_num_requests_running"
START_PHASE_METRIC = "ray_kvtide_engine_start_phase_seconds"
DEFAULT_HOT_PROBES = 20
WORDS = "red green blue cyan magenta yellow black white orange purple brown pink gray olive navy teal".split()


def variant_overrides(variant: str, max_replicas: int, queue_target_ongoing: float = 2.0) -> list[str]:
    """The config overrides that make `variant` out of the shared config (applied last)."""
    if variant == "kv-standby":
        return ["autoscaling.policy=kv", "autoscaling.warm_start.enabled=true", "autoscaling.standby_replicas=1"]
    if variant == "kv":
        return ["autoscaling.policy=kv", "autoscaling.warm_start.enabled=true"]
    if variant == "kv-cold":
        return ["autoscaling.policy=kv", "autoscaling.warm_start.enabled=false"]
    if variant == "queue_length":
        return ["autoscaling.policy=queue_length", f"autoscaling.target_ongoing_requests={queue_target_ongoing:g}"]
    if variant == "fixed-max":
        return ["replicas.min_replicas=null", "replicas.max_replicas=null", f"replicas.num_replicas={max_replicas}"]
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANT_NAMES}")


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

    @property
    def total_s(self) -> float:
        return self.low_s + self.high_s + self.tail_s

    def phase_at(self, t_s: float) -> str:
        if t_s < self.low_s:
            return "low"
        return "high" if t_s < self.low_s + self.high_s else "tail"


@dataclass
class Probe:
    sent_s: float
    latency_s: float | None  # None: failed
    replica: str
    phase: str
    error: str = ""


@dataclass
class Load:
    sent_s: float
    ok: bool
    ttft_s: float | None  # None: failed, or finished without a token
    error: str = ""


@dataclass
class Sample:
    """One second's look at the cluster (t from the trace start)."""

    t_s: float
    running: int
    target: int
    live: tuple[str, ...] = ()  # live engine replica ids (unknown: empty)
    kv: dict[str, float] = field(default_factory=dict)  # KV usage 0..1 per ReplicaId, as last exported
    standby: tuple[str, ...] = ()  # replicas the autoscaler keeps out of routing (standby, retiring)
    running_reqs: dict[str, float] = field(default_factory=dict)  # requests running per ReplicaId


@dataclass
class RunResult:
    variant: str
    probes: list[Probe] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    # {ReplicaId: {phase: seconds}}: each engine replica's start-up as it exported it
    start_phases: dict[str, dict[str, float]] = field(default_factory=dict)


# ---- pure: parsing, selection, summaries -----------------------------------------------------

def kv_usage_by_replica(text: str, metric: str = KV_METRIC) -> dict[str, float]:
    """{ReplicaId: KV usage} from Prometheus text (max over a replica's series; no label: key "")."""
    import re

    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(metric) or line[len(metric):len(metric) + 1] not in ("{", " "):
            continue
        m = re.search(r'ReplicaId="([^"]*)"', line)
        try:
            value = float(line.rsplit("}", 1)[-1].split()[0]) if "}" in line else float(line.split()[1])
        except (IndexError, ValueError):
            continue
        key = m.group(1) if m else ""
        out[key] = max(out.get(key, value), value)
    return out


def start_phases_by_replica(text: str, metric: str = START_PHASE_METRIC,
                            kv_metric: str = KV_METRIC) -> dict[str, dict[str, float]]:
    """{ReplicaId: {phase: seconds}} from Prometheus text: kvtide's start-up gauge per phase.

    The gauge is a plain Ray metric, labelled by the Ray worker (WorkerId), not the replica;
    the replica's vLLM KV gauge carries both, so it maps one to the other (an unmapped
    worker keeps its WorkerId as the key).
    """
    import re

    def labels(line: str) -> dict[str, str]:
        return dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))

    replica_of: dict[str, str] = {}
    phases: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith(kv_metric + "{"):
            tags = labels(line)
            if "WorkerId" in tags and "ReplicaId" in tags:
                replica_of[tags["WorkerId"]] = tags["ReplicaId"]
        elif line.startswith(metric + "{"):
            tags = labels(line)
            try:
                value = float(line.rsplit("}", 1)[-1].split()[0])
            except (IndexError, ValueError):
                continue
            if "phase" in tags:
                phases.setdefault(tags.get("WorkerId", ""), {})[tags["phase"]] = value
    order = {phase: i for i, phase in enumerate(PHASES)}  # the phases in the order a start runs them
    return {replica_of.get(worker, worker): dict(sorted(by_phase.items(), key=lambda kv: order.get(kv[0], len(order))))
            for worker, by_phase in phases.items()}


def kv_mean(kv: Mapping[str, float], live: Iterable[str]) -> float | None:
    """Mean KV usage over the live replicas that report one (all reporting if the live set is unknown).

    A stopped replica's last exported value can linger in the scrape; the live set drops it.
    """
    live = set(live)
    values = [v for r, v in kv.items() if not live or r in live]
    return sum(values) / len(values) if values else None


def replica_seconds(samples: Sequence[Sample], end_s: float | None = None) -> float:
    """∫ running replicas dt: each sample holds until the next one (the last until `end_s`)."""
    total = 0.0
    for i, s in enumerate(samples):
        nxt = samples[i + 1].t_s if i + 1 < len(samples) else max(end_s if end_s is not None else s.t_s, s.t_s)
        total += s.running * (nxt - s.t_s)
    return total


def serving_before(samples: Sequence[Sample], step_s: float) -> set[str]:
    """Replicas that took requests before the step: live and not standby, or seen running requests."""
    old: set[str] = set()
    for s in samples:
        if s.t_s < step_s:
            old |= set(s.live) - set(s.standby)
            old |= {r for r, n in s.running_reqs.items() if n > 0}
    return old


def scale_times(samples: Sequence[Sample], step_s: float) -> tuple[float | None, float | None]:
    """(step → decision, step → serving) in seconds; None if never.

    Decision: the first sample at/after the step whose target replicas less its standbys exceed
    the count at the step (the last sample before it). Serving: the first sample at/after the
    step in which a replica that did not serve before the step runs requests; where no sample
    carries running-request counts, the first with more RUNNING replicas than at the step.
    """
    before = [s for s in samples if s.t_s < step_s]
    after = [s for s in samples if s.t_s >= step_s]
    if not after:
        return None, None
    base = before[-1] if before else after[0]
    decision = next((s.t_s - step_s for s in after if s.target - len(s.standby) > base.target - len(base.standby)),
                    None)
    if any(s.running_reqs for s in samples):
        old = serving_before(samples, step_s)
        serving = next((s.t_s - step_s for s in after
                        if any(n > 0 and r not in old for r, n in s.running_reqs.items())), None)
    else:
        serving = next((s.t_s - step_s for s in after if s.running > base.running), None)
    return decision, serving


# A probe "waited" when its TTFT is this many times the low phase's median (and at least
# SATURATION_MIN_WAIT_S): the client-side sign that the engine has stopped admitting at once.
SATURATION_FACTOR = 5.0
SATURATION_MIN_WAIT_S = 0.1


def saturation_onset(probes: Sequence[Probe], step_s: float, low_p50_s: float | None) -> float | None:
    """Seconds after the step of the first probe sent at/after it that waited (None: none did).

    The issue's decision target counts from when KV saturation begins, which the step only
    starts: the engine fills its KV cache and begins to queue some seconds later. A hot
    probe's TTFT is ~one short prefill until then, so the first probe well above the low
    phase's median marks the onset as a client sees it. A failed probe counts as waiting.
    """
    bar_s = max(SATURATION_FACTOR * (low_p50_s or 0.0), SATURATION_MIN_WAIT_S)
    waited = (p.sent_s - step_s for p in sorted(probes, key=lambda p: p.sent_s)
              if p.sent_s >= step_s and (p.latency_s is None or p.latency_s > bar_s))
    return next(waited, None)


def new_replica_probes(probes: Sequence[Probe], samples: Sequence[Sample], step_s: float,
                       n: int = DEFAULT_HOT_PROBES) -> tuple[str, list[float]]:
    """The new replica and the TTFTs of the first `n` probes it served (in send order).

    Old replicas: those live in a sample before the step, or serving a probe sent before it.
    The new one: the first replica, in send order, to serve a probe sent at/after the step
    that is not old. ("", []) when no probe reached a new replica.
    """
    old = serving_before(samples, step_s)
    old |= {p.replica for p in probes if p.sent_s < step_s and p.replica}
    ordered = sorted((p for p in probes if p.replica and p.latency_s is not None), key=lambda p: p.sent_s)
    new = next((p.replica for p in ordered if p.sent_s >= step_s and p.replica not in old), "")
    if not new:
        return "", []
    return new, [p.latency_s for p in ordered if p.replica == new][:n]  # type: ignore[misc]


def count_slo_violations(loads: Iterable[Load], probes: Iterable[Probe], slo_ttft_s: float) -> int:
    """Load and probe requests without a first token within `slo_ttft_s` (late, failed, or tokenless)."""
    late_loads = sum(1 for r in loads if not r.ok or r.ttft_s is None or r.ttft_s > slo_ttft_s)
    late_probes = sum(1 for p in probes if p.latency_s is None or p.latency_s > slo_ttft_s)
    return late_loads + late_probes


def summarize_run(result: RunResult, trace: Trace, *, slo_ttft_s: float = DEFAULT_SLO_TTFT_S,
                  hot_probes: int = DEFAULT_HOT_PROBES, autoscaled: bool = True) -> dict[str, Any]:
    """(the variant's JSON object with exactly VARIANT_KEYS, its details) from one run's records."""
    step_s = trace.low_s
    decision_s, serving_s = scale_times(result.samples, step_s) if autoscaled else (None, None)
    new_id, new_ttfts = new_replica_probes(result.probes, result.samples, step_s, hot_probes) if autoscaled else ("", [])
    errors = sum(not r.ok for r in result.loads) + sum(p.latency_s is None for p in result.probes)
    row = {
        "variant": result.variant,
        "step_to_decision_s": decision_s,
        "decision_to_serving_s": (serving_s - decision_s if serving_s is not None and decision_s is not None
                                  and serving_s >= decision_s else None),
        "step_to_serving_s": serving_s,
        "new_replica_hot_ttft_p50_ms": percentile(new_ttfts, 50) * 1000 if new_ttfts else None,
        "replica_seconds": replica_seconds(result.samples, trace.total_s),
        "slo_violations": count_slo_violations(result.loads, result.probes, slo_ttft_s),
        "errors": errors,
    }
    phases: dict[str, dict[str, float | None]] = {}
    for phase in ("low", "high", "tail"):
        lat = [p.latency_s for p in result.probes if p.phase == phase and p.latency_s is not None]
        phases[phase] = {"p50": percentile(lat, 50) if lat else None, "p99": percentile(lat, 99) if lat else None,
                         "n": len(lat)}
    onset_s = saturation_onset(result.probes, step_s, phases["low"]["p50"]) if autoscaled else None
    details = {
        "max_replicas_seen": max((s.running for s in result.samples), default=0),
        "saturation_onset_s": onset_s,
        "saturation_to_decision_s": (decision_s - onset_s
                                     if decision_s is not None and onset_s is not None else None),
        # Where the new replica's start went (process, import, engine, warm_start), and every replica's.
        "new_replica_start_phases_s": result.start_phases.get(new_id) if new_id else None,
        "start_phases_s": result.start_phases,
        "new_replica": new_id, "new_replica_hot_ttft_s": new_ttfts,
        "probe_ttft_by_phase_s": phases,
        "load_sent": len(result.loads), "load_errors": sum(not r.ok for r in result.loads),
        "probes_sent": len(result.probes), "probe_errors": sum(p.latency_s is None for p in result.probes),
        "requests": len(result.loads) + len(result.probes),
        "error_kinds": error_kinds([*result.loads, *result.probes]),
    }
    return {"row": row, "details": details}


def error_kinds(requests: Iterable[Load | Probe], width: int = 60) -> dict[str, int]:
    """{error message cut to `width` chars: count} over failed requests, most frequent first."""
    counts = Counter(r.error[:width] or "unknown" for r in requests
                     if (not r.ok if isinstance(r, Load) else r.latency_s is None))
    return dict(counts.most_common())


def timeline(result: RunResult) -> dict[str, Any]:
    """What the plot shows, as plain lists: replicas and mean KV per sample, probe TTFT per send."""
    return {
        "t_s": [s.t_s for s in result.samples],
        "running": [s.running for s in result.samples],
        "target": [s.target for s in result.samples],
        "standby": [len(s.standby) for s in result.samples],
        "kv_mean": [kv_mean(s.kv, s.live) for s in result.samples],
        "probe_sent_s": [p.sent_s for p in result.probes],
        "probe_ttft_s": [p.latency_s for p in result.probes],
        "probe_replica": [p.replica for p in result.probes],
    }


def results_json(*, hardware: str, variants: Sequence[Mapping[str, Any]], **extras: Any) -> dict[str, Any]:
    """autoscale.json: "hardware", "variants" (objects with exactly VARIANT_KEYS), then `extras`."""
    rows = []
    for v in variants:
        missing = set(VARIANT_KEYS) - set(v)
        if missing:
            raise ValueError(f"variant object lacks {sorted(missing)}")
        rows.append({k: v[k] for k in VARIANT_KEYS})
    return {"hardware": hardware, "variants": rows, **extras}


# ---- live: one cluster per variant --------------------------------------------------------------

def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _poll_standby(app: str) -> tuple[str, ...]:
    """The replicas the autoscaler keeps out of routing (standby, retiring), from its published roles."""
    from kvtide.autoscaling import roles_channel
    from kvtide.deployments.names import ENGINE_DEPLOYMENT

    try:
        document = roles_channel.read(app, ENGINE_DEPLOYMENT)
    except Exception:  # no roles (queue_length, or the GCS busy): none kept aside
        return ()
    kept_aside = roles_channel.decode(document)
    return tuple(sorted(kept_aside["standby"] | kept_aside["retiring"]))


def _poll_replicas(app: str) -> tuple[int, int, tuple[str, ...]]:
    """(RUNNING engine replicas, target = all not STOPPING, live engine replica ids)."""
    import ray
    from ray import serve
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX
    from ray.serve._private.constants import SERVE_NAMESPACE

    from kvtide.deployments.names import ENGINE_DEPLOYMENT

    status = serve.status().applications.get(app)
    if status is None or ENGINE_DEPLOYMENT not in status.deployments:
        return 0, 0, ()
    states = {str(getattr(k, "value", k)): v for k, v in status.deployments[ENGINE_DEPLOYMENT].replica_states.items()}
    running = states.get("RUNNING", 0)
    target = sum(v for k, v in states.items() if k != "STOPPING")
    prefix = f"{REPLICA_ID_FULL_ID_STR_PREFIX}{app}#{ENGINE_DEPLOYMENT}#"
    try:
        live = tuple(sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix)))
    except Exception:  # the ids only refine the KV mean and the old-replica set
        live = ()
    return running, target, live


async def preflight(client: httpx.AsyncClient, model: str, prompt: str) -> None:
    """One probe before the trace: a probe the server rejects (e.g. a hot prefix longer than
    max_model_len) would turn every probe into an error, so the variant fails at once, saying why."""
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
    if 400 <= r.status_code < 500:
        raise ValueError(f"the hot-prefix probe is rejected (HTTP {r.status_code}): {r.text[:300]}")


async def _drive(base_url: str, metrics_url: str, model: str, trace: Trace, result: RunResult, app: str,
                 seed: int) -> None:
    from kvtide.benchmarks.loadgen import send_one
    from kvtide.benchmarks.workloads import BenchRequest

    rng = random.Random(seed)
    hot = _words(random.Random(seed + 1), trace.hot_prefix_words)
    from kvtide.benchmarks.loadgen import client_limits

    limits = client_limits(None)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        await preflight(client, model, f"{hot} question -1?")
        start = time.monotonic()
        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []

        async def load_one(i: int) -> None:
            prompt = _words(random.Random(seed * 7919 + i), trace.load_prompt_words)
            req = BenchRequest(({"role": "user", "content": prompt},), trace.load_output_tokens, f"load-{i}")
            r = await send_one(client, f"{base_url}/v1/completions", req, model, "completions", t0)
            result.loads.append(Load(r.start_s, r.ok, r.ttft_s if r.ok else None, r.error or ""))

        async def probe_one(i: int) -> None:
            t = time.monotonic() - start
            t1 = time.perf_counter()
            try:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": f"{hot} question {i}?", "max_tokens": 1})
                ok = r.status_code == 200
                result.probes.append(Probe(t, time.perf_counter() - t1 if ok else None,
                                           r.headers.get("x-kvtide-replica", "") if ok else "", trace.phase_at(t),
                                           "" if ok else f"HTTP {r.status_code}: {r.text[:200]}"))
            except httpx.HTTPError as exc:
                result.probes.append(Probe(t, None, "", trace.phase_at(t), f"{type(exc).__name__}: {exc}"[:200]))

        async def arrivals() -> None:
            i = 0
            while (t := time.monotonic() - start) < trace.total_s:
                rate = trace.high_rate if trace.phase_at(t) == "high" else trace.low_rate
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals: pacing, not synchronisation
                tasks.append(asyncio.create_task(load_one(i)))
                i += 1

        async def probes() -> None:
            i = 0
            while time.monotonic() - start < trace.total_s:
                tasks.append(asyncio.create_task(probe_one(i)))
                i += 1
                await asyncio.sleep(trace.probe_interval_s)

        async def watch() -> None:
            async with httpx.AsyncClient(timeout=5) as scraper:
                while (t := time.monotonic() - start) < trace.total_s:
                    running, target, live = await asyncio.to_thread(_poll_replicas, app)
                    standby = await asyncio.to_thread(_poll_standby, app)
                    try:
                        text = (await scraper.get(metrics_url)).text
                    except httpx.HTTPError:
                        text = ""
                    kv = kv_usage_by_replica(text)
                    result.start_phases.update(start_phases_by_replica(text))
                    result.samples.append(Sample(t, running, target, live, kv, standby,
                                                 kv_usage_by_replica(text, RUNNING_REQUESTS_METRIC)))
                    await asyncio.sleep(1.0)  # a sampling period, not synchronisation

        await asyncio.gather(arrivals(), probes(), watch())
        await asyncio.gather(*tasks)


def load_variant_config(config_path: str | None, overrides: Sequence[str], variant: str, port: int,
                        queue_target_ongoing: float) -> Any:
    from kvtide.config import default_config_path, load_config

    path = config_path or default_config_path()
    shared = load_config(path, list(overrides))
    if not shared.replicas.autoscaling:
        raise SystemExit("autoscale: the config must autoscale: set replicas.num_replicas=null and "
                         "replicas.min_replicas / replicas.max_replicas")
    return load_config(path, [*overrides, *variant_overrides(variant, shared.replicas.max_replicas,
                                                             queue_target_ongoing), f"http.port={port}"])


def run_variant(variant: str, config: Any, trace: Trace, seed: int, metrics_interval_ms: int) -> RunResult:
    from kvtide.cluster import local

    print(f"autoscale: {variant}: starting ...", flush=True)
    cluster = local.start(config, metrics_report_interval_ms=metrics_interval_ms)
    try:
        result = RunResult(variant)
        asyncio.run(_drive(cluster.base_url, cluster.metrics_url, cluster.model_name, trace, result,
                           local.APP_NAME, seed))
    finally:
        local.stop()
    return result


def warm_caches(config: Any, metrics_interval_ms: int) -> None:
    """Start `config` once and stop it, unmeasured: the variants after it find vLLM's caches warm.

    On a fresh GPU machine the first engines compile (torch.compile, Triton's kernel warm-up)
    and the later ones load: an H200 run's first variant paid 12 s of engine init for each new
    replica against 4 s in the next variant, which decided its start-up gap, not its law.
    """
    from kvtide.cluster import local

    print("autoscale: warming vLLM's compile caches (one unmeasured start) ...", flush=True)
    local.start(config, metrics_report_interval_ms=metrics_interval_ms)
    local.stop()


# ---- report ---------------------------------------------------------------------------------

def _f(value: Any, scale: float = 1.0, digits: int = 0) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def markdown(rows: Sequence[Mapping[str, Any]], details: Mapping[str, Mapping[str, Any]], trace: Trace, *,
             command: str, hardware: str, config_desc: str, slo_ttft_s: float = DEFAULT_SLO_TTFT_S,
             hot_probes: int = DEFAULT_HOT_PROBES, failed: Mapping[str, str] | None = None,
             plot: str | None = None) -> str:
    lines = [
        "# Autoscaling on a step load: KV policy vs Ray's queue-length policy vs a fixed max fleet", "",
        f"Hardware: {hardware}. Command:", "", f"    {command}", "",
        f"Cluster: {config_desc}.",
        f"Trace: {trace.low_s:.0f} s at {trace.low_rate} req/s → {trace.high_s:.0f} s at {trace.high_rate} req/s → "
        f"{trace.tail_s:.0f} s at {trace.low_rate} req/s of KV-filling requests (~{trace.load_prompt_words} words, "
        f"{trace.load_output_tokens} output tokens, streamed), plus a hot-prefix probe (a ~{trace.hot_prefix_words}-word shared prefix, 1 output token) every "
        f"{trace.probe_interval_s} s whose latency is its TTFT. SLO: TTFT ≤ {slo_ttft_s:g} s (load and probes; "
        "a failed request misses it).", "",
        f"| variant | replica-seconds | max replicas | step → decision (s) | saturation → decision (s) "
        "| decision → serving (s) | step → new replica serving (s) "
        f"| new replica's first {hot_probes} hot probes TTFT p50 (ms, n) | SLO violations / requests "
        "| probe TTFT p50/p99 low (ms) | high (ms) | tail (ms) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for row in rows:
        d = details.get(row["variant"], {})
        ph = d.get("probe_ttft_by_phase_s", {})
        n_new = len(d.get("new_replica_hot_ttft_s", []))
        new = "–" if row["new_replica_hot_ttft_p50_ms"] is None else f"{row['new_replica_hot_ttft_p50_ms']:.0f} ({n_new})"
        lines.append(
            f"| {row['variant']} | {row['replica_seconds']:.0f} | {d.get('max_replicas_seen', '–')} "
            f"| {_f(row['step_to_decision_s'])} | {_f(d.get('saturation_to_decision_s'))} "
            f"| {_f(row['decision_to_serving_s'], digits=1)} | {_f(row['step_to_serving_s'])} | {new} "
            f"| {row['slo_violations']} / {d.get('requests', '–')} | "
            + " | ".join(f"{_f(ph.get(p, {}).get('p50'), 1000)}/{_f(ph.get(p, {}).get('p99'), 1000)}"
                         for p in ("low", "high", "tail"))
            + f" | {row['errors']} |")
    phase_lines = [f"- {row['variant']}: " + ", ".join(f"{phase} {sec:.1f} s" for phase, sec in phases.items())
                   for row in rows if (phases := details.get(row["variant"], {}).get("new_replica_start_phases_s"))]
    if phase_lines:
        lines += ["", "The new replica's start-up by phase, as it exported it (`process` is an upper bound: "
                  "Ray may have pre-started the worker):", *phase_lines]
    lines += ["", "Saturation → decision counts from the first hot probe after the step that waited (TTFT over "
              f"{SATURATION_FACTOR:g}× the low phase's median and over {SATURATION_MIN_WAIT_S:g} s): where the "
              "engine's KV filled and it began to queue, as a client sees it.",
              "", "The gap between decision and serving is the new replica's start: Ray scheduling, engine "
              "start and model load, and (kv) the warm-up prefill; with a standby (kv-standby) it is the "
              "wake (vLLM sleep mode) and the warm-up. Replica-seconds count standbys (they hold their GPU "
              "share). fixed-max runs the max fleet throughout (no decision, no new replica).", ""]
    if plot:
        lines += [f"![timeline]({plot})", "", "Per variant over time: engine replicas taking traffic "
                  "(standbys not counted), KV-cache usage "
                  "(mean over the live replicas, as Ray last exported it), and probe TTFT (log scale). "
                  "Dashed lines: the load step up and down; dotted: the TTFT SLO.", ""]
    if failed:
        lines += ["Failed to run: " + "; ".join(f"{k}: {v}" for k, v in failed.items()), ""]
    return "\n".join(lines)


def serving_replicas(tl: Mapping[str, Any]) -> list[int]:
    """Per sample, the engines taking traffic: Ray's running replicas less the standbys (and retiring).

    Ray counts a sleeping standby as running; a plot of that would show a standby fleet at its
    full size before any scale-up. A timeline without standby counts (older runs) is all serving.
    """
    standby = tl.get("standby") or [0] * len(tl["running"])
    return [running - kept for running, kept in zip(tl["running"], standby)]


def write_timeline_plot(timelines: Mapping[str, Mapping[str, Any]], trace: Trace, path: str | Path,
                        slo_ttft_s: float | None = None) -> Path:
    """timeline.png: replicas, mean KV usage and probe TTFT over time, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name, tl in timelines.items():
        line, = axes[0].step(tl["t_s"], serving_replicas(tl), where="post", label=name)
        kv = [(t, v) for t, v in zip(tl["t_s"], tl["kv_mean"]) if v is not None]
        if kv:
            axes[1].plot([t for t, _ in kv], [v for _, v in kv], color=line.get_color(), label=name)
        probes = [(t, v) for t, v in zip(tl["probe_sent_s"], tl["probe_ttft_s"]) if v is not None]
        if probes:
            axes[2].plot([t for t, _ in probes], [v * 1000 for _, v in probes], ".", ms=3,
                         color=line.get_color(), label=name)
    for ax in axes:
        for x in (trace.low_s, trace.low_s + trace.high_s):
            ax.axvline(x, color="gray", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("serving replicas")
    axes[0].legend(loc="best", fontsize=8)
    axes[1].set_ylabel("KV usage (mean)")
    axes[1].set_ylim(0, 1.05)
    if slo_ttft_s is not None:
        axes[2].axhline(slo_ttft_s * 1000, color="red", ls=":", lw=0.8, label="SLO")
    axes[2].set_ylabel("probe TTFT (ms)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("time since trace start (s)")
    fig.suptitle("Step load: replicas, KV usage, probe TTFT")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def out_dir_of(out_dir: str | None, out: str | None) -> Path | None:
    """--out-dir, or the deprecated --out: a DIR, or a FILE.md whose stem names the directory."""
    if out_dir:
        return Path(out_dir)
    if out:
        p = Path(out)
        return p.with_suffix("") if p.suffix == ".md" else p
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", "-c", help="kvtide config YAML (default: the CPU demo config + CPU_OVERRIDES)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every variant (after the trace's own), e.g. replicas.max_replicas=4")
    parser.add_argument("--variants", default=",".join(VARIANT_NAMES), help=f"comma-separated subset of {VARIANT_NAMES}")
    parser.add_argument("--hardware", default=f"CPU, {platform.machine()}, {os.cpu_count()} cores",
                        help="what the JSON and report name as the hardware, e.g. 'NVIDIA H200 x2'")
    parser.add_argument("--slo-ttft-s", type=float, default=DEFAULT_SLO_TTFT_S,
                        help="TTFT objective; requests (load and probes) later than it, or failed, are violations")
    parser.add_argument("--hot-probes", type=int, default=DEFAULT_HOT_PROBES,
                        help="how many of the new replica's first probes its TTFT p50 covers")
    parser.add_argument("--queue-target-ongoing", type=float, default=2.0,
                        help="queue_length variant: autoscaling.target_ongoing_requests")
    parser.add_argument("--metrics-interval-ms", type=int, default=2000,
                        help="Ray's metric export period (the KV timeline's resolution; Ray's default is 10000)")
    parser.add_argument("--warm-caches", action="store_true",
                        help="start the max fleet once, unmeasured, before the variants, so none pays the "
                             "machine's first compile (GPU; the CPU demo runs eager, nothing to warm)")
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--low-s", type=float, default=Trace.low_s)
    parser.add_argument("--high-s", type=float, default=Trace.high_s)
    parser.add_argument("--tail-s", type=float, default=Trace.tail_s)
    parser.add_argument("--low-rate", type=float, default=Trace.low_rate)
    parser.add_argument("--high-rate", type=float, default=Trace.high_rate)
    parser.add_argument("--hot-prefix-words", type=int, default=Trace.hot_prefix_words,
                        help="the hot probes' shared prefix; warm start only saves what its prefill costs "
                             "(on an H200 the demo model prefills 500 words in ~1 ms)")
    parser.add_argument("--load-prompt-words", type=int, default=Trace.load_prompt_words)
    parser.add_argument("--out-dir", help="write autoscale.json, report.md and timeline.png here")
    parser.add_argument("--out", help="deprecated: DIR (as --out-dir), or FILE.md meaning the directory FILE")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANT_NAMES)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANT_NAMES}")
    trace = Trace(low_s=args.low_s, high_s=args.high_s, tail_s=args.tail_s, low_rate=args.low_rate,
                  high_rate=args.high_rate, hot_prefix_words=args.hot_prefix_words,
                  load_prompt_words=args.load_prompt_words)
    overrides = [*([] if args.config else CPU_OVERRIDES), *TRACE_OVERRIDES, *args.overrides]
    out_dir = out_dir_of(args.out_dir, args.out)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m kvtide.benchmarks.autoscale " + shlex.join(argv if argv is not None else sys.argv[1:])
    config_desc = (f"`{args.config}`" if args.config else "the CPU demo config") + (
        " with " + ", ".join(f"`{o}`" for o in overrides) if overrides else "")

    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    timelines: dict[str, Any] = {}
    failed: dict[str, str] = {}
    if args.warm_caches:
        warm_caches(load_variant_config(args.config, overrides, "fixed-max", args.port, args.queue_target_ongoing),
                    args.metrics_interval_ms)
    for variant in variants:
        try:
            config = load_variant_config(args.config, overrides, variant, args.port, args.queue_target_ongoing)
            result = run_variant(variant, config, trace, args.seed, args.metrics_interval_ms)
        except Exception as exc:  # one variant failing to start must not lose the others' numbers
            print(f"autoscale: {variant} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            failed[variant] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        summary = summarize_run(result, trace, slo_ttft_s=args.slo_ttft_s, hot_probes=args.hot_probes,
                                autoscaled=variant != "fixed-max")
        rows.append(summary["row"])
        details[variant] = summary["details"]
        timelines[variant] = timeline(result)
        print(f"autoscale: {variant}: {summary}", flush=True)
        write_outputs(out_dir, rows, details, timelines, failed, trace, args, command, config_desc, overrides)
    report = write_outputs(out_dir, rows, details, timelines, failed, trace, args, command, config_desc, overrides)
    print(report)
    return 1 if failed else 0


def write_outputs(out_dir: Path | None, rows: list[dict[str, Any]], details: dict[str, Any],
                  timelines: dict[str, Any], failed: dict[str, str], trace: Trace, args: argparse.Namespace,
                  command: str, config_desc: str, overrides: list[str]) -> str:
    """autoscale.json, timeline.png and report.md so far (after every variant: a killed run keeps the rest)."""
    plot = None
    if out_dir and timelines:
        write_timeline_plot(timelines, trace, out_dir / "timeline.png", args.slo_ttft_s)
        plot = "timeline.png"
    report = markdown(rows, details, trace, command=command, hardware=args.hardware, config_desc=config_desc,
                      slo_ttft_s=args.slo_ttft_s, hot_probes=args.hot_probes, failed=failed, plot=plot)
    if out_dir:
        path = out_dir / "autoscale.json"
        # The scale-down episode (benchmarks/scale_down.py) writes its part into the same file.
        kept = ({k: v for k, v in json.loads(path.read_text()).items() if k.startswith("scale_down")}
                if path.exists() else {})
        from kvtide.benchmarks.protocol import provenance

        data = results_json(
            hardware=args.hardware, variants=rows, command=command, provenance=provenance(shlex.split(command)),
            config={"path": args.config, "overrides": overrides, "queue_target_ongoing": args.queue_target_ongoing},
            slo_ttft_s=args.slo_ttft_s, hot_probes=args.hot_probes, trace=asdict(trace), details=details,
            timeline=timelines, failed=failed, **kept)
        path.write_text(json.dumps(data, indent=2) + "\n")
        (out_dir / "report.md").write_text(report)
    return report


if __name__ == "__main__":
    sys.exit(main())
