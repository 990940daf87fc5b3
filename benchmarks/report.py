"""One benchmark run → one JSON object; pure functions, unit-tested.

The run JSON has exactly these keys (`RUN_KEYS`), whatever server was measured:

    workload, policy                      what ran (policy null when unknown, e.g. bare vLLM)
    offered_rate_per_s, concurrency       the load: open-loop Poisson rate, or closed-loop
                                          requests in flight (the other one null)
    num_requests, num_errors              finished requests (ok + failed), failed ones
    duration_s                            first send → last response
    requests_per_s, output_tokens_per_s   successful requests / output tokens per second
    slo_ttft_s                            the TTFT objective goodput counts against (seconds)
    goodput_requests_per_s                successful requests whose TTFT was within slo_ttft_s,
                                          per second of the run (a success that streamed no
                                          token has no TTFT and misses it)
    ttft_s, itl_s, e2e_s                  {p50, p90, p99, mean} in seconds, null fields if no samples
    prefix_cache_hit_rate                 engine prefix-cache hits / queries over the run (tokens)
    oracle_hit_rate                       the hit rate of one infinite fleet-wide cache on the
                                          requests sent (workloads.oracle_hit_rate): the ceiling
    requests_per_replica                  {replica id: requests finished there over the run}
    imbalance                             max / mean of requests_per_replica over the whole fleet
                                          (a replica that served nothing counts as 0: it may
                                          report no series at all)

The last three come from the server's Prometheus text, read before and after the run;
the deltas exclude whatever ran earlier. Series names, both spellings accepted:

    served through Ray's metrics agent        bare `vllm serve`
    ray_vllm_prefix_cache_hits_total          vllm:prefix_cache_hits_total
    ray_vllm_prefix_cache_queries_total       vllm:prefix_cache_queries_total
    ray_vllm_request_success_total            vllm:request_success_total

The file `kvtide bench run` writes, and each run `kvtide bench compare` records, adds one key
after these: `provenance` (benchmarks.protocol.provenance: commit, versions, GPU, command).

Under Ray, vLLM's stat logger tags every series with `ReplicaId` (the Serve replica's
unique id), which is what `requests_per_replica` groups by; a bare server has one
engine and reports under the key "vllm". A fleet of independent bare servers (the
`bare` baseline) is scraped server by server and merged (`merge_server_samples`):
cache counters summed, each server's requests under its own name.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

RUN_KEYS = (
    "workload", "policy", "offered_rate_per_s", "concurrency", "num_requests", "num_errors", "duration_s", "requests_per_s", "output_tokens_per_s",
    "slo_ttft_s", "goodput_requests_per_s", "ttft_s", "itl_s", "e2e_s", "prefix_cache_hit_rate",
    "oracle_hit_rate", "requests_per_replica", "imbalance",
)
STAT_KEYS = ("p50", "p90", "p99", "mean")
# A chat user notices a first token later than about a second; override per run (--slo-ttft-s).
DEFAULT_SLO_TTFT_S = 1.0

PREFIX_HITS = ("ray_vllm_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
PREFIX_QUERIES = ("ray_vllm_prefix_cache_queries_total", "vllm:prefix_cache_queries_total")
REQUEST_SUCCESS = ("ray_vllm_request_success_total", "vllm:request_success_total")
# Labels that name one engine, most specific first; a series with none of them is "vllm".
REPLICA_LABELS = ("ReplicaId", "replica")
BARE_SERVER_KEY = "vllm"


@dataclass(frozen=True)
class RequestResult:
    """One request as the load generator saw it (times in seconds, relative to the run start)."""

    ok: bool
    start_s: float
    e2e_s: float
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    num_output_tokens: int = 0
    error: str | None = None
    group: str = ""


@dataclass(frozen=True)
class MetricsSample:
    """The counters a run needs, read from one scrape of a metrics endpoint."""

    prefix_cache_hits: float = 0.0
    prefix_cache_queries: float = 0.0
    requests_by_replica: Mapping[str, float] = field(default_factory=dict)


# ---- statistics ------------------------------------------------------------------------

def percentile(samples: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile p={p} must be within 0..100")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(samples: Sequence[float]) -> dict[str, float | None]:
    """{p50, p90, p99, mean}; every field null when there are no samples."""
    if not samples:
        return {k: None for k in STAT_KEYS}
    return {"p50": percentile(samples, 50), "p90": percentile(samples, 90), "p99": percentile(samples, 99),
            "mean": sum(samples) / len(samples)}


def imbalance(requests_per_replica: Mapping[str, float], num_replicas: int | None = None) -> float | None:
    """max / mean of the per-replica counts (1.0 is perfectly even); null if there are none.

    The mean is over `num_replicas` when the fleet is larger than the replicas that reported:
    a replica that served nothing has no series, and leaving it out read an all-on-one-replica
    run as perfectly even (1.00, benchmarks/results/h200-session-2026-12-01d).
    """
    if not requests_per_replica:
        return None
    mean = sum(requests_per_replica.values()) / max(len(requests_per_replica), num_replicas or 0)
    return max(requests_per_replica.values()) / mean if mean > 0 else None


# ---- Prometheus text ---------------------------------------------------------------------

def parse_metrics(text: str) -> MetricsSample:
    """Sum the prefix-cache counters and group request successes by replica, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    by_replica: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name in PREFIX_HITS:
                hits += sample.value
            elif name in PREFIX_QUERIES:
                queries += sample.value
            elif name in REQUEST_SUCCESS:
                by_replica[_replica_of(sample.labels)] += sample.value
    return MetricsSample(hits, queries, dict(by_replica))


def _replica_of(labels: Mapping[str, str]) -> str:
    for key in REPLICA_LABELS:
        if labels.get(key):
            return labels[key]
    return BARE_SERVER_KEY


def merge_server_samples(samples: Mapping[str, MetricsSample]) -> MetricsSample:
    """Independent servers' samples (keyed by server name) as one: cache counters summed, requests per server.

    A bare server's series carry no replica label, so each one's requests (under whatever
    keys its own text gave) are filed under the name it was scraped as.
    """
    return MetricsSample(sum(s.prefix_cache_hits for s in samples.values()),
                         sum(s.prefix_cache_queries for s in samples.values()),
                         {name: sum(s.requests_by_replica.values()) for name, s in samples.items()})


def metrics_delta(before: MetricsSample | None, after: MetricsSample | None) -> MetricsSample | None:
    """after − before; a replica absent before (started during the run) counts from zero."""
    if before is None or after is None:
        return None
    replicas = set(before.requests_by_replica) | set(after.requests_by_replica)
    by_replica = {r: after.requests_by_replica.get(r, 0.0) - before.requests_by_replica.get(r, 0.0)
                  for r in sorted(replicas)}
    return MetricsSample(after.prefix_cache_hits - before.prefix_cache_hits,
                         after.prefix_cache_queries - before.prefix_cache_queries,
                         {r: n for r, n in by_replica.items() if n > 0})


# ---- the run JSON ----------------------------------------------------------------------------

def goodput_count(results: Iterable[RequestResult], slo_ttft_s: float) -> int:
    """Successful requests whose first token came within `slo_ttft_s` (inclusive)."""
    return sum(1 for r in results if r.ok and r.ttft_s is not None and r.ttft_s <= slo_ttft_s)


def build_run_report(*, workload: str, policy: str | None, results: Iterable[RequestResult], duration_s: float,
                     metrics: MetricsSample | None, slo_ttft_s: float = DEFAULT_SLO_TTFT_S,
                     offered_rate_per_s: float | None = None, concurrency: int | None = None,
                     oracle_hit_rate: float | None = None, num_replicas: int | None = None) -> dict[str, Any]:
    """The run JSON (exactly `RUN_KEYS`) from per-request results and the metrics delta (None: no metrics URL).

    `num_replicas`: the fleet's size, for `imbalance` (None: the replicas that reported).
    """
    results = list(results)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    per_replica: dict[str, int] = {}
    hit_rate = None
    if metrics is not None:
        per_replica = {r: int(round(n)) for r, n in metrics.requests_by_replica.items()}
        if metrics.prefix_cache_queries > 0:
            hit_rate = metrics.prefix_cache_hits / metrics.prefix_cache_queries
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    report = {
        "workload": workload,
        "policy": policy,
        "offered_rate_per_s": offered_rate_per_s,
        "concurrency": concurrency,
        "num_requests": len(results),
        "num_errors": len(results) - len(ok),
        "duration_s": duration_s,
        "requests_per_s": rate(len(ok)),
        "output_tokens_per_s": rate(sum(r.num_output_tokens for r in ok)),
        "slo_ttft_s": slo_ttft_s,
        "goodput_requests_per_s": rate(goodput_count(ok, slo_ttft_s)),
        "ttft_s": summarize(ttfts),
        "itl_s": summarize(itls),
        "e2e_s": summarize([r.e2e_s for r in ok]),
        "prefix_cache_hit_rate": hit_rate,
        "oracle_hit_rate": oracle_hit_rate,
        "requests_per_replica": per_replica,
        "imbalance": imbalance(per_replica, num_replicas),
    }
    assert tuple(report) == RUN_KEYS
    return report


# ---- side-by-side comparison ---------------------------------------------------------------

def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "–"
    return f"{value / base:.2f}×"


# Preferred baselines, in order: no kvtide at all, then kvtide's load-only routing.
BASELINES = ("bare", "pow2")


def pick_baseline(names: Sequence[str], baseline: str | None = None) -> str:
    """`baseline` if it ran, else the first of `BASELINES` that ran, else the first run."""
    for name in ((baseline,) if baseline else ()) + BASELINES:
        if name in names:
            return name
    return names[0]


def _point_lines(results: Mapping[str, Mapping[str, Any]], base_name: str) -> list[str]:
    """The two tables of one workload and load: absolute figures, then ratios against `base_name`."""
    base = results[base_name]
    first = next(iter(results.values()))
    # .get: run JSONs written before goodput existed render with "–" there.
    slo = first.get("slo_ttft_s")  # one compare runs every policy under the same SLO
    goodput_head = f"goodput (req/s, TTFT ≤ {_fmt(slo, 2)} s)"
    lines = [f"| policy | req/s | {goodput_head} | output tok/s | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) "
             "| ITL mean (s) | ITL p99 (s) | e2e p50 (s) | prefix-cache hit rate | oracle hit rate | imbalance "
             "| errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {_fmt(r['requests_per_s'], 2)} | {_fmt(r.get('goodput_requests_per_s'), 2)} "
            f"| {_fmt(r['output_tokens_per_s'], 1)} | {_fmt(r['ttft_s']['p50'])} | {_fmt(r['ttft_s']['p90'])} "
            f"| {_fmt(r['ttft_s']['p99'])} | {_fmt(r['itl_s']['mean'], 4)} | {_fmt(r['itl_s']['p99'], 4)} "
            f"| {_fmt(r['e2e_s']['p50'])} | {_fmt(r['prefix_cache_hit_rate'])} | {_fmt(r.get('oracle_hit_rate'))} "
            f"| {_fmt(r['imbalance'], 2)} | {r['num_errors']}/{r['num_requests']} |")
    lines += ["", f"Ratios vs `{base_name}`:", "",
              "| policy | TTFT p50 | TTFT p99 | output tok/s | goodput | hit rate |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {_ratio(r['ttft_s']['p50'], base['ttft_s']['p50'])} "
            f"| {_ratio(r['ttft_s']['p99'], base['ttft_s']['p99'])} "
            f"| {_ratio(r['output_tokens_per_s'], base['output_tokens_per_s'])} "
            f"| {_ratio(r.get('goodput_requests_per_s'), base.get('goodput_requests_per_s'))} "
            f"| {_ratio(r['prefix_cache_hit_rate'], base['prefix_cache_hit_rate'])} |")
    return lines


def _header(command: str | None, hardware: str | None) -> list[str]:
    lines = ["# Routing policy comparison", ""]
    if hardware:
        lines += [f"Hardware: {hardware}.", ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    return lines


def compare_markdown(results: Mapping[str, Mapping[str, Any]], *, baseline: str | None = None,
                     command: str | None = None, notes: Sequence[str] = (), hardware: str | None = None) -> str:
    """A Markdown report of run JSONs keyed by policy, with ratios against the baseline (`pick_baseline`)."""
    if not results:
        return "# Routing policy comparison\n\nNo runs.\n"
    base_name = pick_baseline(list(results), baseline)
    first = next(iter(results.values()))
    lines = _header(command, hardware)
    lines += [f"Workload: `{first['workload']}`. Ratios are against `{base_name}`; "
              "lower is better for latencies, higher for throughput, goodput and hit rate.", ""]
    lines += _point_lines(results, base_name)
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    lines += ["", "Plots: `ttft_cdf.png`, `hit_rate.png`, `throughput.png`.", ""]
    return "\n".join(lines)


# What a repeated comparison reports the spread of, per policy and point: (label, getter).
SPREAD_METRICS: tuple[tuple[str, Any], ...] = (
    ("goodput_requests_per_s", lambda r: r.get("goodput_requests_per_s")),
    ("ttft_p50_s", lambda r: r["ttft_s"]["p50"]),
    ("ttft_p90_s", lambda r: r["ttft_s"]["p90"]),
    ("itl_mean_s", lambda r: r["itl_s"]["mean"]),
    ("output_tokens_per_s", lambda r: r["output_tokens_per_s"]),
    ("prefix_cache_hit_rate", lambda r: r["prefix_cache_hit_rate"]),
)


def aggregate_repeats(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One policy's runs of one point (repeats) → the median run, with every repeat's key metrics under "repeats".

    The median run is a real run (the one with the median goodput; ties by TTFT p90), not a
    mix of medians, so its tables stay self-consistent; "repeats" holds each metric's values
    in run order, which the report shows as median [min–max].
    """
    if len(runs) == 1:
        return dict(runs[0])
    ranked = sorted(runs, key=lambda r: (r.get("goodput_requests_per_s") or 0.0, -(r["ttft_s"]["p90"] or 0.0)))
    median = dict(ranked[(len(ranked) - 1) // 2])
    median["repeats"] = {"n": len(runs), **{name: [get(r) for r in runs] for name, get in SPREAD_METRICS}}
    return median


def spread_markdown(points: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """Median [min–max] over repeats of each policy's key metrics, per point ("" if nothing was repeated)."""
    lines: list[str] = []
    for label, runs in points.items():
        repeated = {p: r["repeats"] for p, r in runs.items() if "repeats" in r}
        if not repeated:
            continue
        lines += [f"## {label}: spread over repeats", "",
                  "| policy | runs | " + " | ".join(name for name, _ in SPREAD_METRICS) + " |",
                  "|---|---:|" + "---:|" * len(SPREAD_METRICS)]
        for policy, reps in repeated.items():
            cells = []
            for name, _ in SPREAD_METRICS:
                values = [v for v in reps[name] if v is not None]
                cells.append(f"{_fmt(statistics.median(values))} [{_fmt(min(values))}–{_fmt(max(values))}]"
                             if values else "–")
            lines.append(f"| {policy} | {reps['n']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def load_label(report: Mapping[str, Any]) -> str:
    """How a run was loaded, as a short label: "rate 40 req/s" or "concurrency 16"."""
    if report.get("offered_rate_per_s") is not None:
        return f"rate {report['offered_rate_per_s']:g} req/s"
    return f"concurrency {report.get('concurrency')}"


def sweep_markdown(points: Mapping[str, Mapping[str, Mapping[str, Any]]], *, baseline: str | None = None,
                   command: str | None = None, notes: Sequence[str] = (), hardware: str | None = None) -> str:
    """A report of a sweep: {point label: {policy: run JSON}}, each point one workload at one load.

    First, per workload, goodput and TTFT p90 of every policy at every load (the curve that
    shows where each policy saturates); then every point's full tables.
    """
    if not points:
        return "# Routing policy comparison\n\nNo runs.\n"
    lines = _header(command, hardware)
    policies = list(dict.fromkeys(p for runs in points.values() for p in runs))
    by_workload: dict[str, list[Mapping[str, Mapping[str, Any]]]] = defaultdict(list)
    for runs in points.values():
        by_workload[next(iter(runs.values()))["workload"]].append(runs)
    for workload, rows in by_workload.items():
        slo = next(iter(rows[0].values())).get("slo_ttft_s")
        for title, cell in ((f"goodput, req/s with TTFT ≤ {_fmt(slo, 2)} s", lambda r: _fmt(r.get("goodput_requests_per_s"), 2)),
                            ("TTFT p90, s", lambda r: _fmt(r["ttft_s"]["p90"])),
                            ("prefix-cache hit rate (oracle)",
                             lambda r: f"{_fmt(r['prefix_cache_hit_rate'], 2)} ({_fmt(r.get('oracle_hit_rate'), 2)})")):
            lines += [f"## `{workload}`: {title}", "", "| load | " + " | ".join(policies) + " |",
                      "|---|" + "---:|" * len(policies)]
            for runs in rows:
                load = load_label(next(iter(runs.values())))
                lines.append(f"| {load} | " + " | ".join(cell(runs[p]) if p in runs else "–" for p in policies) + " |")
            lines.append("")
    for label, runs in points.items():
        base_name = pick_baseline(list(runs), baseline)
        lines += [f"## {label}", "", f"Ratios are against `{base_name}`.", ""]
        lines += _point_lines(runs, base_name) + [""]
    if notes:
        lines += [*[f"- {note}" for note in notes], ""]
    return "\n".join(lines)
