"""kvtide reads vLLM's scheduler stats strictly: the installed vLLM has every field, and a rename fails loudly."""

from __future__ import annotations

import pytest

from kvtide.deployments.engine import stats as engine_stats
from kvtide.deployments.engine.stats import EngineLoad, check_stat_fields, load_logger_factory


def test_installed_vllm_has_every_stat_field_kvtide_reads():
    """SchedulerStats / IterationStats of the installed vLLM carry the fields the load logger reads."""
    check_stat_fields()


def test_a_renamed_field_is_an_error_naming_it(monkeypatch):
    """A field vLLM no longer has stops the replica at start, naming it, instead of reading zeros."""
    monkeypatch.setattr(engine_stats, "SCHEDULER_STATS_FIELDS", ("kv_cache_usage", "num_running_requests"))
    with pytest.raises(RuntimeError, match="SchedulerStats.num_running_requests"):
        load_logger_factory(EngineLoad())


def test_load_logger_copies_the_latest_scheduler_view():
    """One record() with real vLLM stats objects lands in EngineLoad; preemptions accumulate."""
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    load = EngineLoad()
    logger = load_logger_factory(load)(None, 0)
    iteration = IterationStats()
    iteration.num_preempted_reqs = 2
    logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5), iteration)
    logger.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.25), iteration)
    assert (load.num_running, load.num_waiting, load.kv_usage_perc, load.num_preemptions_total) == (1, 0, 0.25, 4)


def test_load_logger_keeps_the_finished_requests_durations():
    """Each finished request's end-to-end seconds (vLLM's e2e_latency) reach the durations the router is sent."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats

    load = EngineLoad()
    logger = load_logger_factory(load)(None, 0)
    iteration = IterationStats()
    iteration.finished_requests = [FinishedRequestStats(FinishReason.LENGTH, e2e_latency=seconds)
                                   for seconds in (0.4, 0.1, 0.3, 0.2)]
    logger.record(None, iteration)
    assert load.recent_durations.quantiles() == (0.1, 0.2, 0.3, 0.4)
