"""kvtide's autoscaler on the simulated fleet: the Ray policy's own tick, fed a simulated Serve context.

What decides is `autoscaling.ray_policy.policy_tick`, the function `KvPolicy` calls on every
controller tick (reconcile roles → law_context → the KV control law → assign roles with each
replica's cache worth), unmodified. This module only plays the parts of Ray Serve around it:

    metrics   every `sample_period_s` each started replica records what `record_autoscaling_stats`
              returns (replica_stats.replica_autoscaling_stats: KV usage, waiting, running,
              preemptions, recent hit tokens and recent exclusive hit tokens); the context holds
              the means over `look_back_s` (`aggregated_metrics`) and the samples themselves
              (`raw_metrics`), as Ray's controller does (push delay not modelled)
    target    Serve's target is what the policy returned; the fleet starts replicas up to it (a
              cold start lasts `cold_start_s`) and stops the surplus: replicas still starting
              first, then the newest (Ray 2.60's choice on one node)
    roles     with standby roles (`manages_roles`) only active replicas take traffic; a demoted
              replica drains, then sleeps (vLLM sleep level 1 frees its KV, so its cache is lost);
              a woken one serves again `wake_s` later; a retired one drains and stops

The defaults of `cold_start_s` and `wake_s` are the 8B shape's on one H200
(benchmarks/results/h200-standby-2026-12-04c: decision → serving 99.6 s cold, 2.2 s from standby).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping, NamedTuple

from kvtide.autoscaling.ray_policy import Tick, policy_tick
from kvtide.autoscaling.replica_stats import METRIC_KEYS, RecentTokens, replica_autoscaling_stats
from kvtide.config import AutoscalingSettings


@dataclass(frozen=True)
class AutoscaleConfig:
    """The autoscaled fleet: the law's settings, Serve's bounds, and how long replicas take to serve."""

    settings: AutoscalingSettings
    min_replicas: int
    max_replicas: int
    initial_replicas: int
    cold_start_s: float = 99.6
    wake_s: float = 2.2
    tick_s: float = 0.5  # Ray's controller ticks every 0.1 s; the law's timers are seconds long

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min ({self.min_replicas}) <= initial ({self.initial_replicas}) "
                             f"<= max ({self.max_replicas}) replicas")

    @property
    def sample_period_s(self) -> float:
        """How often a replica's stats are sampled: min(look_back × 0.2, push interval), as Ray 2.60 does."""
        return min(self.settings.look_back_s * 0.2, self.settings.metrics_push_interval_s)


@dataclass(frozen=True)
class SimReplicaID:
    """What Ray's ReplicaID is to the policy: hashable, with a `unique_id`."""

    unique_id: str


class TimeStampedValue(NamedTuple):
    timestamp: float
    value: float


@dataclass
class ReplicaMetrics:
    """One replica's sampled autoscaling stats within the look-back window, and its hit-token totals."""

    window: RecentTokens
    exclusive_window: RecentTokens
    samples: deque = field(default_factory=deque)  # (t, stats dict), oldest first


class Autoscaler:
    """Ray Serve's side of the policy call: metric samples in, `policy_tick` once per tick, the target out."""

    def __init__(self, config: AutoscaleConfig):
        self.config = config
        self.tunables = config.settings
        self.target = config.initial_replicas
        self.policy_state: dict[str, Any] = {}
        self.metrics: dict[str, ReplicaMetrics] = {}
        self.next_sample_s = 0.0

    def sample(self, now_s: float, stats: Mapping[str, Mapping[str, float]]) -> None:
        """Record each started replica's stats (replica id → kv_usage, num_waiting, num_running,
        num_preemptions_total, hit_tokens_total, exclusive_hit_tokens_total) and forget the ones gone."""
        window_s = self.tunables.cache_value_window_s
        for gone in set(self.metrics) - set(stats):
            del self.metrics[gone]
        for replica_id, s in stats.items():
            m = self.metrics.get(replica_id)
            if m is None:
                m = self.metrics[replica_id] = ReplicaMetrics(RecentTokens(window_s), RecentTokens(window_s))
            m.window.observe(now_s, s["hit_tokens_total"])
            m.exclusive_window.observe(now_s, s["exclusive_hit_tokens_total"])
            m.samples.append((now_s, replica_autoscaling_stats(
                s["kv_usage"], int(s["num_waiting"]), int(s["num_running"]), int(s["num_preemptions_total"]),
                m.window.within(now_s), m.exclusive_window.within(now_s))))
            while m.samples and m.samples[0][0] < now_s - self.tunables.look_back_s:
                m.samples.popleft()

    def context(self, now_s: float, running: list[str]) -> SimpleNamespace:
        """The `AutoscalingContext` fields the policy reads, for the replicas Serve runs now."""
        ids = {rid: SimReplicaID(rid) for rid in running}
        aggregated: dict[str, dict[SimReplicaID, float]] = {key: {} for key in METRIC_KEYS}
        raw: dict[str, dict[SimReplicaID, list[TimeStampedValue]]] = {key: {} for key in METRIC_KEYS}
        for rid, replica_id in ids.items():
            m = self.metrics.get(rid)
            if m is None or not m.samples:
                continue  # not reported yet: Ray leaves it out of the metrics
            for key in METRIC_KEYS:
                values = [TimeStampedValue(t, s[key]) for t, s in m.samples]
                raw[key][replica_id] = values
                aggregated[key][replica_id] = sum(v.value for v in values) / len(values)
        return SimpleNamespace(
            current_time=now_s, config=SimpleNamespace(look_back_period_s=self.tunables.look_back_s),
            policy_state=self.policy_state, running_replicas=list(ids.values()),
            current_num_replicas=len(running), target_num_replicas=self.target,
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            aggregated_metrics=aggregated, raw_metrics=raw, deployment_name="engine", app_name="kvtide")

    def tick(self, now_s: float, running: list[str]) -> Tick:
        """One controller tick: the policy's own function on the context; Serve's target kept in bounds."""
        tick = policy_tick(self.context(now_s, running), self.tunables)
        self.policy_state = dict(tick.policy_state)
        self.target = min(max(tick.target, self.config.min_replicas), self.config.max_replicas)
        return tick


def step_items(items: list, at_s: float, for_s: float, factor: float) -> list:
    """A traffic step: the trace's arrivals from `at_s` on come `factor` times as fast for `for_s` seconds (the
    trace's next for_s × factor seconds, compressed), then at the trace's pace again. Same requests, same order."""
    if factor <= 0 or for_s < 0:
        raise ValueError(f"a step needs factor > 0 and for_s >= 0, got {factor} and {for_s}")
    from dataclasses import replace

    at_ms, span_ms = at_s * 1000.0, for_s * factor * 1000.0
    out = []
    for item in items:
        t = item.timestamp_ms
        if t >= at_ms + span_ms:
            t -= span_ms - span_ms / factor
        elif t >= at_ms:
            t = at_ms + (t - at_ms) / factor
        out.append(replace(item, timestamp_ms=t))
    return out


LEFT_ROUTING = ("demoted", "stopping")
SCALE_DOWN_WINDOW_S = 120.0


def window_stats(requests: Any, start_s: float, end_s: float, slo_ttft_s: float) -> dict[str, Any]:
    """Requests arriving in [start_s, end_s): how many, TTFT p90, SLO violations and hit rate (cached / prompt
    tokens, from each request's last admission)."""
    from kvtide.simulator.report import percentile

    inside = [r for r in requests if start_s <= r.arrival_s < end_s and r.first_token_s is not None]
    ttfts = [r.first_token_s - r.arrival_s for r in inside]
    prompt = sum(r.prompt_tokens for r in inside)
    return {"requests": len(inside), "ttft_p90_s": percentile(ttfts, 90),
            "slo_violations": sum(1 for t in ttfts if t > slo_ttft_s),
            "hit_rate": sum(r.cached_tokens for r in inside) / prompt if prompt else None}


def episode_summary(result: Any, windows_s: Mapping[str, tuple[float, float]], slo_ttft_s: float,
                    tick_s: float, scale_down_window_s: float = SCALE_DOWN_WINDOW_S) -> dict[str, Any]:
    """An autoscaled run's numbers: replica-seconds (standbys and starting replicas included, as they hold their
    GPU), the largest fleet, SLO violations, TTFT p90 and hit rate by window of arrival, the scaling events, and
    around the first scale-down (a replica demoted or stopping): the same over `scale_down_window_s` before and
    after it, with the share of the hit tokens the replica that left had served in the window before."""
    counts = result.replica_counts
    window = {name: window_stats(result.requests, start_s, end_s, slo_ttft_s)
              for name, (start_s, end_s) in windows_s.items()}
    done = [r for r in result.requests if r.first_token_s is not None]
    scale_down = None
    first = next(((t, rid) for t, verb, rid in result.scaling_events if verb in LEFT_ROUTING), None)
    if first is not None:
        at_s, left = first
        before = [r for r in done if at_s - scale_down_window_s <= r.arrival_s < at_s]
        hits_before = sum(r.cached_tokens for r in before)
        scale_down = {"at_s": at_s, "left": left,
                      "before": window_stats(result.requests, at_s - scale_down_window_s, at_s, slo_ttft_s),
                      "after": window_stats(result.requests, at_s, at_s + scale_down_window_s, slo_ttft_s),
                      "left_share_of_hits_before": (sum(r.cached_tokens for r in before
                                                        if result.replica_of.get(r.request_id) == left) / hits_before
                                                    if hits_before else None)}
    return {
        "replica_seconds": sum(active + standbys + starting for _, active, standbys, starting in counts) * tick_s,
        "max_replicas": max((active + standbys + starting for _, active, standbys, starting in counts), default=0),
        "max_active": max((active for _, active, _, _ in counts), default=0),
        "slo_violations": sum(1 for r in done if r.first_token_s - r.arrival_s > slo_ttft_s),
        "num_requests": len(result.requests),
        "hit_rate": result.prefix_hits_tokens / result.prefix_queries_tokens if result.prefix_queries_tokens else None,
        "windows": window,
        "scale_down": scale_down,
        "events": [[round(t, 3), verb, rid] for t, verb, rid in result.scaling_events],
        "replica_counts": [[round(t, 3), active, standbys, starting] for t, active, standbys, starting in counts],
    }
