"""The engine's own load, read from vLLM's stat-logger stream inside the replica process.

Why a stat logger: vLLM's scheduler stats (KV usage, running/waiting, preemptions) reach
the AsyncLLM front end through its stat-logger interface; a tiny logger that keeps the
latest values lets the replica answer Ray Serve's `record_autoscaling_stats` (and the
router's stats) without scraping Prometheus or calling into the engine core.

Strict reads: these stats classes are not a stable vLLM interface (the `gpu` extra spans
several releases). A renamed field must fail loudly, not turn the router's load and the
autoscaler's input into silent zeros: `check_stat_fields()` runs when the replica starts
(and in a unit test against the installed vLLM), and `record` reads attributes directly.

The CPU KV tier (`engine.kv_offload`, vLLM's OffloadingConnector) adds two optional reads:
the connector's prefix hits (tokens loaded from the tier) and its transfer stats (bytes each
way, `deployments.engine.kv_tier_stats`). They are required only of a replica with a tier
(`check_stat_fields(kv_tier=True)`); without one they are absent or None and read as zero.
`KvTierMetrics` exports the tier's series for every replica, tier or not, so dashboards
show zeros rather than "No data" where no tier runs (on CPU vLLM cannot offload at all).

This module imports vLLM: the engine replica imports it inside its constructor, so the
Ray Serve import path (kvtide.cluster.app) stays free of vLLM.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from ray.util import metrics
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

from kvtide.deployments.engine.kv_tier_stats import (DIRECTIONS, TIERS, CounterDeltas, OnloadRate, TransferTotals,
                                                     kv_bytes_per_token, transfer_totals)
from kvtide.deployments.logs import replica_logger
from kvtide.deployments.metric_sampling import SampledObserver
from kvtide.deployments.routing.pick_load import RecentDurations
from kvtide.deployments.routing.ray_router import counter_at_zero

logger = replica_logger("engine")

# The vLLM fields `_LoadLogger.record` reads, by class.
SCHEDULER_STATS_FIELDS = ("kv_cache_usage", "num_running_reqs", "num_waiting_reqs", "prefix_cache_stats")
ITERATION_STATS_FIELDS = ("num_preempted_reqs", "finished_requests")
FINISHED_REQUEST_FIELDS = ("e2e_latency",)
# Read only where the replica has a CPU KV tier (both in vLLM 0.26 and 0.32): the connector's prefix
# hits (tokens it loaded) and its per-step transfer payload.
TIER_SCHEDULER_STATS_FIELDS = ("connector_prefix_cache_stats", "kv_connector_stats")


@dataclass
class EngineLoad:
    """Latest scheduler view of one engine; written by vLLM's output loop, read by the replica."""

    kv_usage_perc: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions_total: int = 0
    prefix_hit_tokens_total: int = 0  # prompt tokens served from the (GPU) prefix cache since start
    cpu_hit_tokens_total: int = 0  # prompt tokens loaded from the CPU KV tier since start (the connector's hits)
    transfers_total: TransferTotals = field(default_factory=TransferTotals)  # KV moved each way since start
    # The engine's recent CPU → GPU bandwidth (its worker count is set once the engine runs).
    onload_rate: OnloadRate = field(default_factory=OnloadRate)
    # End-to-end seconds of the last finished requests: a pick-only router counts its picks
    # as load for about as long as this engine's requests take (deployments.routing.pick_load).
    recent_durations: RecentDurations = field(default_factory=RecentDurations)


def check_stat_fields(kv_tier: bool = False) -> None:
    """Raise if the installed vLLM's stats classes lack a field kvtide reads (`kv_tier`: the CPU tier's too)."""
    scheduler_fields = {f.name for f in dataclasses.fields(SchedulerStats)}
    required = SCHEDULER_STATS_FIELDS + (TIER_SCHEDULER_STATS_FIELDS if kv_tier else ())
    # IterationStats is a plain class whose fields are set in __init__.
    iteration_fields = set(vars(IterationStats()))
    missing = [f"SchedulerStats.{name}" for name in required if name not in scheduler_fields]
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
            self._record_tier(scheduler_stats)
        if iteration_stats is not None:
            self.load.num_preemptions_total += int(iteration_stats.num_preempted_reqs)
            for finished in iteration_stats.finished_requests:
                self.load.recent_durations.observe(finished.e2e_latency)

    def _record_tier(self, scheduler_stats) -> None:
        # Optional (see check_stat_fields): a vLLM without these fields has no tier to report.
        connector_prefix = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
        if connector_prefix is not None:
            # kvtide configures one connector, the CPU offloading one: its hits are the CPU tier's.
            self.load.cpu_hit_tokens_total += int(connector_prefix.hits)
        moved = transfer_totals(getattr(scheduler_stats, "kv_connector_stats", None))
        if moved != TransferTotals():
            self.load.transfers_total += moved
            self.load.onload_rate.observe(moved.onload_bytes, moved.onload_s)

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


def load_logger_factory(load: EngineLoad, kv_tier: bool = False) -> Callable[..., StatLoggerBase]:
    """A per-engine stat-logger factory writing into `load` (vLLM calls it with (config, index)).

    `kv_tier`: the replica has a CPU KV tier, so the tier's stats fields are required too."""
    check_stat_fields(kv_tier)
    return lambda vllm_config, engine_index=0: _LoadLogger(load, vllm_config, engine_index)


def engine_num_workers(vllm_config) -> int:
    """The engine's workers (tensor × pipeline parallel): each holds, stores and loads its own KV shard."""
    return int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)


def engine_kv_bytes_per_token(vllm_config) -> int | None:
    """One token's KV in bytes over all the engine's workers, from vLLM's resolved model and cache
    configs; None where this vLLM or this model's shape does not say (onload tokens/s: not known)."""
    try:
        from vllm.utils.torch_utils import get_dtype_size, get_kv_cache_torch_dtype

        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        dtype = get_kv_cache_torch_dtype(vllm_config.cache_config.cache_dtype, model.dtype)
        return kv_bytes_per_token(num_layers=model.get_num_layers_by_block_type(parallel, "attention"),
                                  num_kv_heads=model.get_num_kv_heads(parallel), head_size=model.get_head_size(),
                                  elem_bytes=get_dtype_size(dtype), use_mla=bool(model.use_mla),
                                  num_workers=engine_num_workers(vllm_config)) or None
    except Exception as exc:  # a shape this vLLM computes otherwise (hybrid, new attention kinds)
        logger.warning("KV bytes per token not known (%s: %s): onload tokens/s reads 0 unless measured",
                       type(exc).__name__, exc)
        return None


class KvTierMetrics:
    """This replica's KV tiers as Prometheus series, per replica (`ReplicaId`, vLLM's label and value).

    Every series exists from the replica's start, at zero where nothing happened (counters
    are created at 0; Ray's `inc` refuses 0): a fleet without a CPU tier shows zeros. The
    counters follow EngineLoad's running totals (`export`, called with the gauges' refresh).
    """

    def __init__(self, model: str, replica_id: str) -> None:
        self._tags = {"model": model, "ReplicaId": replica_id}
        keys = ("model", "ReplicaId")
        self.cached_blocks = metrics.Gauge(
            "kvtide_engine_cached_blocks", "Full KV blocks this replica holds in its prefix cache, by tier (gpu, "
            "cpu: vLLM's KV offloading), as its cache digest advertises them.", tag_keys=(*keys, "tier"))
        self.hit_tokens = metrics.Counter(
            "kvtide_engine_prefix_hit_tokens", "Prompt tokens served from cached KV, by tier: gpu (vLLM's prefix "
            "cache) or cpu (loaded from the CPU KV tier).", tag_keys=(*keys, "tier"))
        self.transfer_bytes = metrics.Counter(
            "kvtide_engine_kv_transfer_bytes", "KV bytes moved between GPU and the CPU tier, by direction: "
            "offload (GPU to CPU) or onload (CPU to GPU).", tag_keys=(*keys, "direction"))
        self.onload_tokens_per_s = metrics.Gauge(
            "kvtide_engine_onload_tokens_per_second", "Prompt tokens' KV per second this replica loads from its CPU "
            "tier (measured, else configured; 0: no tier or not known), as reported to the routers.", tag_keys=keys)
        self._deltas = CounterDeltas()
        for tier in TIERS:
            counter_at_zero(self.hit_tokens, {**self._tags, "tier": tier})
        for direction in DIRECTIONS:
            counter_at_zero(self.transfer_bytes, {**self._tags, "direction": direction})

    def export(self, load: EngineLoad, num_gpu_blocks: int, num_cpu_blocks: int, onload_tokens_per_s: float) -> None:
        """Set the gauges (Ray drops a gauge not set for a while: call it periodically) and add the counters' steps."""
        for tier, num_blocks in zip(TIERS, (num_gpu_blocks, num_cpu_blocks)):
            self.cached_blocks.set(num_blocks, {**self._tags, "tier": tier})
        self.onload_tokens_per_s.set(onload_tokens_per_s, self._tags)
        moved = load.transfers_total
        totals = {("tier", "gpu"): load.prefix_hit_tokens_total, ("tier", "cpu"): load.cpu_hit_tokens_total,
                  ("direction", "offload"): moved.offload_bytes, ("direction", "onload"): moved.onload_bytes}
        for (label, value), step in self._deltas.steps(totals).items():
            counter = self.hit_tokens if label == "tier" else self.transfer_bytes
            counter.inc(step, {**self._tags, label: value})
