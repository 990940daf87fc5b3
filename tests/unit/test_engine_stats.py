"""kvtide reads vLLM's scheduler stats strictly: the installed vLLM has every field, and a rename fails loudly."""

from __future__ import annotations

from types import SimpleNamespace

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


def test_installed_vllm_has_the_cpu_tier_fields():
    """A replica with a CPU KV tier also reads SchedulerStats' connector prefix hits and transfer payload."""
    check_stat_fields(kv_tier=True)


def test_tier_fields_are_required_only_of_a_replica_with_a_tier(monkeypatch):
    """A vLLM without the tier fields still runs replicas without a tier; one with a tier fails at start, naming them."""
    monkeypatch.setattr(engine_stats, "TIER_SCHEDULER_STATS_FIELDS", ("kv_connector_transfer_stats",))
    load_logger_factory(EngineLoad())
    with pytest.raises(RuntimeError, match="SchedulerStats.kv_connector_transfer_stats"):
        load_logger_factory(EngineLoad(), kv_tier=True)


def test_payload_names_are_the_offloading_connectors_own():
    """kv_tier_stats reads the counters vLLM's OffloadingConnector reports, by their names in the installed vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import _TransferMetricName

    from kvtide.deployments.engine import kv_tier_stats

    assert (kv_tier_stats.ONLOAD_BYTES, kv_tier_stats.ONLOAD_TIME_S) == (_TransferMetricName.LOAD_BYTES,
                                                                         _TransferMetricName.LOAD_TIME)
    assert (kv_tier_stats.OFFLOAD_BYTES, kv_tier_stats.OFFLOAD_TIME_S) == (_TransferMetricName.STORE_BYTES,
                                                                           _TransferMetricName.STORE_TIME)


def test_load_logger_sums_the_cpu_tiers_hits_and_transfers():
    """Connector prefix hits are CPU-tier hit tokens; each record's OffloadingConnectorStats adds bytes and an onload rate."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (OffloadingConnectorStats,
                                                                                 _TransferMetricName)
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

    from kvtide.deployments.engine.kv_tier_stats import OnloadRate, TransferTotals

    load = EngineLoad(onload_rate=OnloadRate(min_bytes=1))
    logger = load_logger_factory(load, kv_tier=True)(None, 0)
    for _ in range(2):
        step = OffloadingConnectorStats()
        step.increase_counter(_TransferMetricName.LOAD_BYTES, 1 << 20)
        step.increase_counter(_TransferMetricName.LOAD_TIME, 0.001)
        step.increase_counter(_TransferMetricName.STORE_BYTES, 2 << 20)
        step.increase_counter(_TransferMetricName.STORE_TIME, 0.002)
        step.observe_histogram(_TransferMetricName.LOAD_SIZE, 1 << 20)
        logger.record(SchedulerStats(prefix_cache_stats=PrefixCacheStats(hits=64),
                                     connector_prefix_cache_stats=PrefixCacheStats(hits=32),
                                     kv_connector_stats=step.data), None)
    logger.record(SchedulerStats(prefix_cache_stats=PrefixCacheStats(hits=16)), None)  # a step without a connector
    assert (load.prefix_hit_tokens_total, load.cpu_hit_tokens_total) == (144, 64)
    assert load.transfers_total == TransferTotals(2 << 20, pytest.approx(0.002), 4 << 20, pytest.approx(0.004))
    assert load.onload_rate.bytes_per_s() == pytest.approx((2 << 20) / 0.002)


def test_engine_kv_bytes_per_token_reads_vllms_resolved_configs():
    """K and V of every attention layer, KV head and worker, at the KV cache's dtype ("auto": the model's)."""
    import torch
    from vllm.config import ModelConfig

    from kvtide.deployments.engine.stats import engine_kv_bytes_per_token

    for name in ("get_num_layers_by_block_type", "get_num_kv_heads", "get_head_size", "use_mla"):
        assert hasattr(ModelConfig, name), f"vLLM's ModelConfig lacks {name}: update engine_kv_bytes_per_token"
    model = SimpleNamespace(dtype=torch.bfloat16, use_mla=False, get_head_size=lambda: 64,
                            get_num_layers_by_block_type=lambda parallel, kind: 6,
                            get_num_kv_heads=lambda parallel: 1)
    config = SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(world_size=2),
                             cache_config=SimpleNamespace(cache_dtype="auto"))
    assert engine_kv_bytes_per_token(config) == 2 * 6 * 1 * 64 * 2 * 2
    config.cache_config.cache_dtype = "fp8"
    assert engine_kv_bytes_per_token(config) == 2 * 6 * 1 * 64 * 1 * 2
    config.cache_config.cache_dtype = "no-such-dtype"
    assert engine_kv_bytes_per_token(config) is None
