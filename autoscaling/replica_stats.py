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
    kvtide_recent_hit_tokens       prompt tokens served from the prefix cache within the last
                                   cache_value_window_s: the cache's worth for a cache-aware
                                   scale-down (`RecentTokens`; a window of the replica's own, as
                                   Ray keeps raw samples for look_back_s only)
    kvtide_recent_exclusive_hit_tokens  of those, the ones served from blocks no other replica
                                   held when the request was routed (routing.trust's prediction)

The `kvtide_` prefix keeps them apart from Ray's own key in the same report
(`running_requests`).
"""

from __future__ import annotations

KV_USAGE_KEY = "kvtide_kv_usage_perc"
NUM_WAITING_KEY = "kvtide_num_waiting"
NUM_RUNNING_KEY = "kvtide_num_running"
NUM_PREEMPTIONS_TOTAL_KEY = "kvtide_num_preemptions_total"
RECENT_HIT_TOKENS_KEY = "kvtide_recent_hit_tokens"
RECENT_EXCLUSIVE_HIT_TOKENS_KEY = "kvtide_recent_exclusive_hit_tokens"
METRIC_KEYS = (KV_USAGE_KEY, NUM_WAITING_KEY, NUM_RUNNING_KEY, NUM_PREEMPTIONS_TOTAL_KEY, RECENT_HIT_TOKENS_KEY,
               RECENT_EXCLUSIVE_HIT_TOKENS_KEY)


def replica_autoscaling_stats(
    kv_usage_perc: float, num_waiting: int, num_running: int, num_preemptions_total: int,
    recent_hit_tokens: float = 0.0, recent_exclusive_hit_tokens: float = 0.0,
) -> dict[str, float]:
    """What an engine replica's `record_autoscaling_stats()` returns (keys in the module docstring)."""
    return {
        KV_USAGE_KEY: min(max(float(kv_usage_perc), 0.0), 1.0),
        NUM_WAITING_KEY: float(max(num_waiting, 0)),
        NUM_RUNNING_KEY: float(max(num_running, 0)),
        NUM_PREEMPTIONS_TOTAL_KEY: float(max(num_preemptions_total, 0)),
        RECENT_HIT_TOKENS_KEY: float(max(recent_hit_tokens, 0.0)),
        RECENT_EXCLUSIVE_HIT_TOKENS_KEY: float(max(recent_exclusive_hit_tokens, 0.0)),
    }


class RecentTokens:
    """Tokens counted within a trailing window: a monotone total sampled now and then, differenced.

    `observe(now_s, total)` records the running total; `within(now_s)` is its increase over the
    last `window_s` (from the oldest sample still inside it). A total that went down (the engine
    restarted its count) starts the window afresh.
    """

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: list[tuple[float, float]] = []

    def observe(self, now_s: float, total: float) -> None:
        if self._samples and total < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((now_s, total))
        while len(self._samples) > 1 and self._samples[1][0] <= now_s - self.window_s:
            self._samples.pop(0)

    def within(self, now_s: float) -> float:
        if not self._samples:
            return 0.0
        return self._samples[-1][1] - self._samples[0][1]
