"""What an engine replica reports to the autoscaler: the keys of `record_autoscaling_stats()`.

The boundary between the engine (kvtide.deployments.engine.replica, which reports) and the Ray
policy adapter (kvtide.autoscaling.ray_policy, which reads `ctx.aggregated_metrics` /
`ctx.raw_metrics` by these keys). Pure: no Ray, no vLLM, so the engine imports it without
pulling in the adapter.

    kvtide_kv_usage_perc           share of KV blocks in use, 0..1 (vLLM's kv_cache_usage)
    kvtide_num_waiting             requests waiting in the scheduler queue now
    kvtide_num_running             requests the engine is running now
    kvtide_num_preemptions_total   preemptions since the engine started (monotone counter;
                                   the adapter differences it over the raw window)

The `kvtide_` prefix keeps them apart from Ray's own key in the same report
(`running_requests`).
"""

from __future__ import annotations

KV_USAGE_KEY = "kvtide_kv_usage_perc"
NUM_WAITING_KEY = "kvtide_num_waiting"
NUM_RUNNING_KEY = "kvtide_num_running"
NUM_PREEMPTIONS_TOTAL_KEY = "kvtide_num_preemptions_total"
METRIC_KEYS = (KV_USAGE_KEY, NUM_WAITING_KEY, NUM_RUNNING_KEY, NUM_PREEMPTIONS_TOTAL_KEY)


def replica_autoscaling_stats(
    kv_usage_perc: float, num_waiting: int, num_running: int, num_preemptions_total: int
) -> dict[str, float]:
    """What an engine replica's `record_autoscaling_stats()` returns (keys in the module docstring)."""
    return {
        KV_USAGE_KEY: min(max(float(kv_usage_perc), 0.0), 1.0),
        NUM_WAITING_KEY: float(max(num_waiting, 0)),
        NUM_RUNNING_KEY: float(max(num_running, 0)),
        NUM_PREEMPTIONS_TOTAL_KEY: float(max(num_preemptions_total, 0)),
    }
