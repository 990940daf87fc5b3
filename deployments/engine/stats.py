"""The engine's own load, read from vLLM's stat-logger stream inside the replica process.

Why a stat logger: vLLM's scheduler stats (KV usage, running/waiting, preemptions) reach
the AsyncLLM front end through its stat-logger interface; a tiny logger that keeps the
latest values lets the replica answer Ray Serve's `record_autoscaling_stats` (and the
router's stats) without scraping Prometheus or calling into the engine core.

Strict reads: these stats classes are not a stable vLLM interface (the `gpu` extra spans
several releases). A renamed field must fail loudly, not turn the router's load and the
autoscaler's input into silent zeros: `check_stat_fields()` runs when the replica starts
(and in a unit test against the installed vLLM), and `record` reads attributes directly.

This module imports vLLM: the engine replica imports it inside its constructor, so the
Ray Serve import path (kvtide.cluster.app) stays free of vLLM.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

from kvtide.deployments.metric_sampling import SampledObserver
from kvtide.deployments.routing.pick_load import RecentDurations

# The vLLM fields `_LoadLogger.record` reads, by class.
SCHEDULER_STATS_FIELDS = ("kv_cache_usage", "num_running_reqs", "num_waiting_reqs", "prefix_cache_stats")
ITERATION_STATS_FIELDS = ("num_preempted_reqs", "finished_requests")
FINISHED_REQUEST_FIELDS = ("e2e_latency",)


@dataclass
class EngineLoad:
    """Latest scheduler view of one engine; written by vLLM's output loop, read by the replica."""

    kv_usage_perc: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions_total: int = 0
    prefix_hit_tokens_total: int = 0  # prompt tokens served from the prefix cache since start
    # End-to-end seconds of the last finished requests: a pick-only router counts its picks
    # as load for about as long as this engine's requests take (deployments.routing.pick_load).
    recent_durations: RecentDurations = field(default_factory=RecentDurations)


def check_stat_fields() -> None:
    """Raise if the installed vLLM's stats classes lack a field kvtide reads."""
    scheduler_fields = {f.name for f in dataclasses.fields(SchedulerStats)}
    # IterationStats is a plain class whose fields are set in __init__.
    iteration_fields = set(vars(IterationStats()))
    missing = [f"SchedulerStats.{name}" for name in SCHEDULER_STATS_FIELDS if name not in scheduler_fields]
    missing += [f"IterationStats.{name}" for name in ITERATION_STATS_FIELDS if name not in iteration_fields]
    finished_fields = {f.name for f in dataclasses.fields(FinishedRequestStats)}
    missing += [f"FinishedRequestStats.{name}" for name in FINISHED_REQUEST_FIELDS if name not in finished_fields]
    if missing:
        raise RuntimeError(
            f"this vLLM's stats lack {', '.join(missing)}: kvtide's router load and autoscaler input read them; "
            "update kvtide.deployments.engine.stats for this vLLM release")


class _LoadLogger(StatLoggerBase):
    def __init__(self, load: EngineLoad, vllm_config, engine_index: int = 0):
        self.load = load

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is not None:
            self.load.kv_usage_perc = float(scheduler_stats.kv_cache_usage)
            self.load.num_running = int(scheduler_stats.num_running_reqs)
            self.load.num_waiting = int(scheduler_stats.num_waiting_reqs)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.load.prefix_hit_tokens_total += int(prefix.hits)
        if iteration_stats is not None:
            self.load.num_preemptions_total += int(iteration_stats.num_preempted_reqs)
            for finished in iteration_stats.finished_requests:
                self.load.recent_durations.observe(finished.e2e_latency)

    def log_engine_initialized(self):
        pass


def kept_ray_stat_logger(kept: list) -> type:
    """vLLM's Ray Prometheus stat logger, each instance appended to `kept`.

    Its inter-token-latency histogram (observed per token) keeps a rate-capped sample.

    Why kept: vLLM sets its gauges (KV usage, running, waiting) only when its output loop records
    stats, i.e. while requests run; an idle engine's series go missing from the scrape
    ("No data" on an idle fleet). Holding the loggers lets the replica re-record its last
    scheduler view (`refresh_gauges`) from the moment it is ready and while it is idle.
    """
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    class KeptRayPrometheusStatLogger(RayPrometheusStatLogger):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # Per token: sampled, see kvtide.deployments.metric_sampling.
            self.histogram_inter_token_latency = {
                engine_idx: SampledObserver(histogram, time.monotonic)
                for engine_idx, histogram in self.histogram_inter_token_latency.items()}
            kept.append(self)

    return KeptRayPrometheusStatLogger


def refresh_gauges(loggers: list, load: EngineLoad) -> None:
    """Record `load` (the engine's latest scheduler view) on vLLM's Prometheus loggers."""
    stats = SchedulerStats(num_running_reqs=load.num_running, num_waiting_reqs=load.num_waiting,
                           kv_cache_usage=load.kv_usage_perc)
    for stat_logger in loggers:
        for engine_idx in getattr(stat_logger, "engine_indexes", [0]):
            stat_logger.record(stats, None, engine_idx=engine_idx)


def load_logger_factory(load: EngineLoad) -> Callable[..., StatLoggerBase]:
    """A per-engine stat-logger factory writing into `load` (vLLM calls it with (config, index))."""
    check_stat_fields()
    return lambda vllm_config, engine_index=0: _LoadLogger(load, vllm_config, engine_index)
