"""The CPU KV tier's numbers (kv_tier_stats, pure): transfers read from vLLM's payload, onload rate, tokens per second."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtide.deployments.engine.kv_tier_stats import (GIB, OFFLOAD_BYTES, OFFLOAD_TIME_S, ONLOAD_BYTES, ONLOAD_TIME_S,
                                                     CounterDeltas, OnloadRate, TransferTotals,
                                                     configured_load_gib_per_s, kv_bytes_per_token,
                                                     onload_tokens_per_s, tier_configured, transfer_totals)

MIB = 1 << 20


def payload(onload_bytes: int = 0, onload_s: float = 0.0, offload_bytes: int = 0, offload_s: float = 0.0) -> dict:
    """An OffloadingConnectorStats payload as vLLM builds it for one step (unlabelled counters under `()`)."""
    counters = {ONLOAD_BYTES: onload_bytes, ONLOAD_TIME_S: onload_s, OFFLOAD_BYTES: offload_bytes,
                OFFLOAD_TIME_S: offload_s}
    present = {name: value for name, value in counters.items() if value}
    return {"types": {name: "counter" for name in present}, "data": {name: {(): value} for name, value in present.items()}}


def test_transfer_totals_reads_both_directions_of_one_payload():
    """Load counters are the onload, store counters the offload; a histogram beside them is ignored."""
    one = payload(onload_bytes=4 * MIB, onload_s=0.002, offload_bytes=8 * MIB, offload_s=0.004)
    one["types"]["vllm:kv_offload_load_size"] = "histogram"
    one["data"]["vllm:kv_offload_load_size"] = {(): [4 * MIB]}
    assert transfer_totals(one) == TransferTotals(4 * MIB, 0.002, 8 * MIB, 0.004)


def test_transfer_totals_finds_the_payload_under_a_multi_connector():
    """A MultiConnector's payload nests each connector's: a dict (vLLM 0.32) or a stats object with `data` (0.26)."""
    nested = {"OffloadingConnector": payload(onload_bytes=MIB, onload_s=0.001),
              "Other": SimpleNamespace(data=payload(offload_bytes=2 * MIB, offload_s=0.003))}
    assert transfer_totals(nested) == TransferTotals(MIB, 0.001, 2 * MIB, 0.003)


@pytest.mark.parametrize("stats", [None, {}, {"types": {}, "data": {}}, {"num_failed_transfers": 3}],
                         ids=["none", "empty", "no-counters", "another-connector"])
def test_transfer_totals_is_zero_where_nothing_was_offloaded(stats):
    """No payload, an empty one or another connector's stats read as nothing moved."""
    assert transfer_totals(stats) == TransferTotals()


def test_onload_rate_is_not_measured_until_enough_bytes_were_loaded():
    """A few small loads are latency, not bandwidth: no rate below min_bytes, then bytes over seconds."""
    rate = OnloadRate(min_bytes=8 * MIB)
    rate.observe(4 * MIB, 0.001)
    assert rate.bytes_per_s() is None
    rate.observe(4 * MIB, 0.001)
    assert rate.bytes_per_s() == pytest.approx(8 * MIB / 0.002)


def test_onload_rate_counts_the_workers_loading_side_by_side():
    """vLLM sums seconds over the workers, which load their shards at once: the engine's rate is workers times more."""
    rate = OnloadRate(num_workers=4, min_bytes=1)
    rate.observe(8 * MIB, 0.004)  # four workers, 2 MiB in 1 ms each
    assert rate.bytes_per_s() == pytest.approx(8 * MIB / 0.001)


def test_onload_rate_follows_its_recent_window_and_skips_empty_records():
    """Old records leave the window; a record without bytes or without time changes nothing."""
    rate = OnloadRate(window=2, min_bytes=1)
    rate.observe(MIB, 1.0)
    rate.observe(MIB, 0.001)
    rate.observe(MIB, 0.001)
    rate.observe(0, 0.5)
    rate.observe(MIB, 0.0)
    assert rate.bytes_per_s() == pytest.approx(2 * MIB / 0.002)


def test_onload_tokens_per_s_prefers_the_measured_rate_to_the_configured_one():
    """Measured bytes/s over KV bytes per token; else the configured GiB/s; 0.0 when neither or the KV size is unknown."""
    assert onload_tokens_per_s(2 * GIB, 20.0, 1024) == pytest.approx(2 * GIB / 1024)
    assert onload_tokens_per_s(None, 20.0, 1024) == pytest.approx(20 * GIB / 1024)
    assert onload_tokens_per_s(None, None, 1024) == 0.0
    assert onload_tokens_per_s(2 * GIB, 20.0, None) == 0.0
    assert onload_tokens_per_s(2 * GIB, 20.0, 0) == 0.0


def test_a_tier_is_configured_only_with_a_size():
    """engine.kv_offload absent (an older config), or with no size: no tier and no configured bandwidth."""
    assert not tier_configured(None)
    assert not tier_configured(SimpleNamespace(size_gib=None, load_gib_per_s=20.0))
    assert configured_load_gib_per_s(SimpleNamespace(size_gib=None, load_gib_per_s=20.0)) is None
    tier = SimpleNamespace(size_gib=64.0, load_gib_per_s=20.0)
    assert tier_configured(tier) and configured_load_gib_per_s(tier) == 20.0
    assert configured_load_gib_per_s(SimpleNamespace(size_gib=64.0)) is None


def test_kv_bytes_per_token_is_every_workers_shard_of_one_token():
    """K and V per layer and head; split heads add up to the model's, replicated heads (tp > kv heads) count per worker."""
    llama_70b = dict(num_layers=80, head_size=128, elem_bytes=2, use_mla=False)
    assert kv_bytes_per_token(num_kv_heads=8, num_workers=1, **llama_70b) == 327_680
    assert kv_bytes_per_token(num_kv_heads=4, num_workers=2, **llama_70b) == 327_680
    assert kv_bytes_per_token(num_kv_heads=1, num_workers=16, **llama_70b) == 2 * 327_680
    # MLA keeps one latent vector per layer, the same on every worker.
    assert kv_bytes_per_token(num_layers=61, num_kv_heads=1, head_size=576, elem_bytes=2, use_mla=True,
                              num_workers=8) == 61 * 576 * 2 * 8


def test_counter_deltas_turn_running_totals_into_positive_steps():
    """Each call gives what each total rose by since the last; unchanged totals give nothing; a drop restarts there."""
    deltas = CounterDeltas()
    assert deltas.steps({"gpu": 0, "cpu": 0}) == {}
    assert deltas.steps({"gpu": 100, "cpu": 0}) == {"gpu": 100}
    assert deltas.steps({"gpu": 100, "cpu": 32}) == {"cpu": 32}
    assert deltas.steps({"gpu": 40, "cpu": 32}) == {}
    assert deltas.steps({"gpu": 50, "cpu": 32}) == {"gpu": 10}
