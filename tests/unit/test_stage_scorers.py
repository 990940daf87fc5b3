"""Scorer stage: matches by tier, the costs in prefill-token equivalents, replication credit, session."""

from __future__ import annotations

import pytest

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.replication import PrefixDemand, group_key
from kvtide.deployments.routing.sessions import SessionTable
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot
from kvtide.deployments.routing.stages import scorers

BS = 16
HASHES = block_hashes(list(range(10 * BS)), BS)  # 10 blocks
TUNE = RoutingConfig()


@pytest.mark.parametrize("prefill, onload, weight", [
    (10_000.0, 100_000.0, 0.1),
    (10_000.0, 5_000.0, 1.0),  # a slow link: no better than a recompute
    (1.0, 1e9, scorers.MIN_CPU_BLOCK_WEIGHT),  # never free
    (0.0, 100_000.0, 1.0),  # prefill rate not measured yet
    (10_000.0, 0.0, 1.0),  # no tier, or onload rate unknown
])
def test_cpu_block_weight_is_prefill_over_onload_rate_within_its_bounds(prefill, onload, weight):
    """A CPU-tier block costs its load time relative to its prefill time, in [floor, 1]."""
    assert scorers.cpu_block_weight(prefill, onload) == pytest.approx(weight)


def test_match_cpu_continues_each_replicas_gpu_match_and_is_none_without_a_tier():
    """The CPU run starts where the GPU match ends; an empty CPU index answers None (no tier work)."""
    cpu = PrefixIndex(10.0)
    assert scorers.match_cpu(HASHES, ["a", "b"], [0, 0], cpu) is None
    cpu.apply_digest(CacheDigest.from_hashes("a", 1, 1, HASHES))
    cpu.apply_digest(CacheDigest.from_hashes("b", 1, 1, HASHES[5:]))
    assert scorers.match_cpu(HASHES, ["a", "b", "c"], [3, 5, 0], cpu) == [7, 5, 0]
    assert scorers.match_cpu(HASHES, ["a", "b"], [3, 4], cpu) == [7, 0]


@pytest.mark.parametrize("cached, gpu, cpu, weight, cost", [
    # new_prefill = uncached_weight 2 × 16 = 32 tokens per block; a loaded block 16 × weight
    (0, 0, None, 1.0, 320.0),
    (10, 10, None, 1.0, 0.0),
    (4, 4, 6, 0.25, 0.0 + 6 * 16 * 0.25),
    (0, 0, 10, 0.5, 10 * 8.0),
    (6, 4, 4, 0.5, 2 * 8.0 + 2 * 32.0),  # credit covers 6; CPU run reaches 8: 2 loaded, 2 recomputed
    (8, 4, 2, 0.5, 2 * 32.0),  # the credit covers the whole CPU run: nothing loaded
])
def test_prefix_cost_recomputes_the_uncached_and_loads_the_cpu_tier(cached, gpu, cpu, weight, cost):
    """Cost table: GPU blocks (or credit) cost 0, CPU-tier blocks their load, the rest a weighted recompute."""
    snap = ReplicaSnapshot("r", 0, cpu_block_weight=weight)
    got = scorers.prefix_cost(10, [cached], [gpu], None if cpu is None else [cpu], [snap], BS, TUNE)
    assert got == [pytest.approx(cost)]


def test_queue_cost_is_pending_prefill_plus_a_requests_worth_per_queued_request():
    """Work ahead in tokens: pending + tokens_per_queued_request × queued."""
    assert scorers.queue_cost([0, 2, 1], [0, 100, 5000], TUNE) == [0.0, 612.0, 5256.0]


def test_match_gpu_reads_the_callers_match_or_the_index():
    """Per candidate in order, 0 for replicas the match does not name."""
    index = PrefixIndex(10.0)
    index.apply_digest(CacheDigest.from_hashes("b", 1, 1, HASHES[:4]))
    assert scorers.match_gpu(HASHES, ["a", "b"], index, 0.0) == [0, 4]
    assert scorers.match_gpu(HASHES, ["a", "b"], index, 0.0, {"a": 9}) == [9, 0]
    assert scorers.match_gpu((), ["a", "b"], index, 0.0) == [0, 0]


def test_a_hot_group_is_credited_on_its_rendezvous_members_and_a_cold_one_is_not():
    """Replication credit: k ≥ 2 members credited up to the shared prefix someone holds; a cold group: nobody."""
    ids = [f"r{i}" for i in range(8)]
    snaps = [ReplicaSnapshot(rid, 10) for rid in ids]
    group = group_key(HASHES, 8)
    demand = PrefixDemand(half_life_s=10.0)
    assert scorers.replication_credit(group, HASHES, ids, 10, demand, snaps, TUNE) == scorers.NOT_HOT
    for t in range(50):
        demand.observe(group, HASHES, float(t) / 100)
    members, credit, k = scorers.replication_credit(group, HASHES, ids, 6, demand, snaps, TUNE)
    assert k >= 2 and len(members) == k and credit == 6
    assert scorers.credited([0] * 8, ids, members, credit) == [6 if rid in members else 0 for rid in ids]


def test_the_session_scorer_names_the_last_turns_replica_while_it_sticks():
    """Session memory within session_ttl_s; none without a key or a table."""
    table = SessionTable(ttl_s=60.0)
    table.remember("s1", "b", 0.0)
    assert scorers.session_replica(table, "s1", 30.0) == "b"
    assert scorers.session_replica(table, "s1", 61.0) is None
    assert scorers.session_replica(table, None, 0.0) is None
    assert scorers.session_replica(None, "s1", 0.0) is None
