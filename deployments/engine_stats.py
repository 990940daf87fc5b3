"""The engine's own load, read from vLLM's stat-logger stream inside the replica process.

Why a stat logger: vLLM's scheduler stats (KV usage, running/waiting, preemptions) reach
the AsyncLLM front end through its stat-logger interface; a tiny logger that keeps the
latest values lets the replica answer Ray Serve's `record_autoscaling_stats` (and the
router's stats) without scraping Prometheus or calling into the engine core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vllm.v1.metrics.loggers import StatLoggerBase


@dataclass
class EngineLoad:
    """Latest scheduler view of one engine; written by vLLM's output loop, read by the replica."""

    kv_usage_perc: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions_total: int = 0


class _LoadLogger(StatLoggerBase):
    def __init__(self, load: EngineLoad, vllm_config, engine_index: int = 0):
        self.load = load

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        # getattr: these stats classes are not a stable vLLM interface (the `gpu` extra spans
        # several vLLM releases), and an exception here would break vLLM's output loop.
        if scheduler_stats is not None:
            self.load.kv_usage_perc = float(getattr(scheduler_stats, "kv_cache_usage", 0.0))
            self.load.num_running = int(getattr(scheduler_stats, "num_running_reqs", 0))
            self.load.num_waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
        if iteration_stats is not None:
            self.load.num_preemptions_total += int(getattr(iteration_stats, "num_preempted_reqs", 0))

    def log_engine_initialized(self):
        pass


def load_logger_factory(load: EngineLoad) -> Callable[..., StatLoggerBase]:
    """A per-engine stat-logger factory writing into `load` (vLLM calls it with (config, index))."""
    return lambda vllm_config, engine_index=0: _LoadLogger(load, vllm_config, engine_index)
