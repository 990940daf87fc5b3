"""The KV tiers' Prometheus series: created at zero per replica and per router, then following the stats by tier.

No Ray instance is started: Ray's metric classes are swapped for recorders where a test reads
what was exported, and the router runs with stand-in replicas as in test_routing_adapter.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest
from ray.util import metrics as ray_metrics

from kvtide.deployments.engine import stats as engine_stats
from kvtide.deployments.engine.kv_tier_stats import TransferTotals
from kvtide.deployments.messages import RoutingKey
from kvtide.deployments.routing import ray_router
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.policy import RoutingDecision
from kvtide.deployments.routing.ray_router import PrefixAwareRouter, counter_at_zero, matched_tokens_by_tier

BS = 4
PROMPT = tuple(block_hashes(list(range(32)), BS))  # 8 blocks
DEPLOYMENT = DeploymentID(name="Engine", app_name="app")


class RecordedMetric:
    """A Ray Counter/Gauge stand-in keeping every call, keyed by its tags."""

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = (), **_) -> None:
        self.name = name
        self.tag_keys = tag_keys
        self.values: dict[tuple, float] = {}

    def _key(self, tags: dict[str, str]) -> tuple:
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        return tuple(tags[key] for key in self.tag_keys)

    def _record(self, value: float, tags: dict[str, str]) -> None:
        self.values[self._key(tags)] = self.values.get(self._key(tags), 0) + value

    def inc(self, value: float, tags: dict[str, str]) -> None:
        assert value > 0, "Ray's Counter.inc refuses increments of 0"
        self._record(value, tags)

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.values[self._key(tags)] = value

    def observe(self, value: float, tags: dict[str, str]) -> None:
        pass


@pytest.fixture
def recorded(monkeypatch):
    """Ray's metric classes replaced by RecordedMetric in the engine's stats and the router's adapter."""
    fake = SimpleNamespace(Counter=RecordedMetric, Gauge=RecordedMetric, Histogram=RecordedMetric)
    monkeypatch.setattr(engine_stats, "metrics", fake)
    monkeypatch.setattr(ray_router, "metrics", fake)


def test_rays_counter_records_through_the_method_counter_at_zero_uses():
    """counter_at_zero relies on Ray's Counter recording through `_record` (what `inc` calls once it checked the value)."""
    counter = ray_metrics.Counter("kvtide_test_tier_counter", "test", tag_keys=("tier",))
    assert callable(getattr(counter, "_record", None))
    counter_at_zero(counter, {"tier": "cpu"})  # outside Ray: accepted, nothing exported


def test_a_replica_exports_every_tier_series_at_zero_from_its_start(recorded):
    """Without a CPU tier (or before any hit) each series exists for the replica: blocks, hits, bytes, onload rate."""
    tiers = engine_stats.KvTierMetrics("m", "replica-1")
    tiers.export(engine_stats.EngineLoad(), num_gpu_blocks=0, num_cpu_blocks=0, onload_tokens_per_s=0.0)
    assert tiers.hit_tokens.values == {("m", "replica-1", "gpu"): 0, ("m", "replica-1", "cpu"): 0}
    assert tiers.transfer_bytes.values == {("m", "replica-1", "offload"): 0, ("m", "replica-1", "onload"): 0}
    assert tiers.cached_blocks.values == {("m", "replica-1", "gpu"): 0, ("m", "replica-1", "cpu"): 0}
    assert tiers.onload_tokens_per_s.values == {("m", "replica-1"): 0.0}


def test_a_replica_exports_the_stat_loggers_totals_by_tier_and_direction(recorded):
    """Counters rise by what the totals rose since the last export; gauges take the latest blocks and rate."""
    tiers = engine_stats.KvTierMetrics("m", "r")
    load = engine_stats.EngineLoad(prefix_hit_tokens_total=320, cpu_hit_tokens_total=64,
                                   transfers_total=TransferTotals(onload_bytes=4096, onload_s=0.001,
                                                                  offload_bytes=8192, offload_s=0.002))
    tiers.export(load, num_gpu_blocks=12, num_cpu_blocks=40, onload_tokens_per_s=5e5)
    load.cpu_hit_tokens_total += 32
    tiers.export(load, num_gpu_blocks=10, num_cpu_blocks=41, onload_tokens_per_s=6e5)
    assert tiers.hit_tokens.values == {("m", "r", "gpu"): 320, ("m", "r", "cpu"): 96}
    assert tiers.transfer_bytes.values == {("m", "r", "offload"): 8192, ("m", "r", "onload"): 4096}
    assert tiers.cached_blocks.values == {("m", "r", "gpu"): 10, ("m", "r", "cpu"): 41}
    assert tiers.onload_tokens_per_s.values == {("m", "r"): 6e5}


def test_matched_tokens_split_into_gpu_and_cpu_parts():
    """The CPU part is the decision's cpu_matched_tokens (never more than the match), the rest GPU; empty parts dropped."""
    assert matched_tokens_by_tier(128, 0) == {"gpu": 128}
    assert matched_tokens_by_tier(128, 96) == {"gpu": 32, "cpu": 96}
    assert matched_tokens_by_tier(128, 128) == {"cpu": 128}
    assert matched_tokens_by_tier(64, 100) == {"cpu": 64}
    assert matched_tokens_by_tier(0, 0) == {}


class FakeReplica:
    """The attributes of a RunningReplica the router reads."""

    def __init__(self, unique_id: str) -> None:
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.routing_stats: dict = {}
        self.max_ongoing_requests = 100


def test_the_router_counts_matched_tokens_by_tier_from_zero(recorded):
    """Both tiers' series exist once the router starts; each decision adds its GPU and CPU matched tokens."""
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BS, seed=0)
    counter = router._metrics.matched_tokens_by_tier
    assert counter.values == {("prefix_aware", "gpu"): 0, ("prefix_aware", "cpu"): 0}
    decisions = iter([RoutingDecision(["a"], "cache_hit", 32, cpu_matched_tokens=24),
                      RoutingDecision(["a"], "cache_hit", 16)])
    router._state.rank = lambda *args, **kwargs: next(decisions)
    replica = FakeReplica("a")

    async def route_twice() -> None:
        for _ in range(2):
            await router.choose_replicas([replica], PendingRequest(args=[RoutingKey(block_hashes=PROMPT)], kwargs={},
                                                                   metadata=None))

    asyncio.run(route_twice())
    assert counter.values == {("prefix_aware", "gpu"): 8 + 16, ("prefix_aware", "cpu"): 24}
