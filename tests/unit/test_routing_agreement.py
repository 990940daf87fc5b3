"""Routers agreeing without shared state: rendezvous hashing, and two router states making the same picks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvtide.config import RoutingConfig
from kvtide.deployments.routing import rendezvous
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.policy import RouterState
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot

BS = 16
IDS = [f"SERVE_REPLICA::app#Engine#{i:03d}" for i in range(6)]


# ---- rendezvous --------------------------------------------------------------------------------


def test_hashes_are_pinned_across_processes_and_versions():
    """Golden values: every router process (any PYTHONHASHSEED, any host) computes the same weights."""
    assert rendezvous.hash_str("replica-a") == 15596872698780470842
    assert rendezvous.mix64(1) == 6238072747940578789
    assert rendezvous.weights(12345, ["a"])["a"] == 10352985741645596261
    assert rendezvous.top(12345, ["a", "b", "c", "d"], 4) == ["c", "b", "a", "d"]


def test_top_does_not_depend_on_the_order_of_replica_ids():
    """The same ids in any order give the same ranking."""
    shuffled = IDS[:]
    random.Random(3).shuffle(shuffled)
    assert rendezvous.top(777, IDS, 6) == rendezvous.top(777, shuffled, 6)


def test_first_choices_are_spread_evenly():
    """Over many keys each replica is the first choice about 1/N of the time."""
    wins = Counter(rendezvous.top(key, IDS, 1)[0] for key in range(6000))
    assert set(wins) == set(IDS) and min(wins.values()) > 800 and max(wins.values()) < 1200


def test_adding_a_replica_moves_only_the_keys_it_wins():
    """A new replica takes about 1/N of the first choices; every other key keeps its replica."""
    new = "SERVE_REPLICA::app#Engine#new"
    moved = 0
    for key in range(3000):
        before, after = rendezvous.top(key, IDS, 1)[0], rendezvous.top(key, IDS + [new], 1)[0]
        assert after in (before, new)
        moved += after == new
    assert 300 < moved < 560  # 1/7 of 3,000 ≈ 429


# ---- two router states -------------------------------------------------------------------------


def _prompts() -> list[tuple[list[int], str | None]]:
    """Requests: three shared system prompts (one hot) with per-user tails, some with a session key."""
    rng = random.Random(11)
    systems = [list(range(s * 1000, s * 1000 + 12 * BS)) for s in range(3)]
    out = []
    for i in range(300):
        system = systems[0] if rng.random() < 0.7 else systems[rng.randrange(1, 3)]
        tail = [rng.randrange(30_000) for _ in range(rng.randrange(0, 6) * BS)]
        session = f"user-{rng.randrange(20)}" if rng.random() < 0.5 else None
        out.append((block_hashes(system + tail, BS), session))
    return out


def _digests(held: dict[str, set[int]], sequence: int) -> list[CacheDigest]:
    return [CacheDigest.from_hashes(rid, 1, sequence, blocks) for rid, blocks in held.items()]


def test_two_routers_fed_the_same_digests_make_the_same_picks():
    """Separate states and different rngs, same digests, snapshots and traffic: identical rankings."""
    tunables = RoutingConfig()
    first, second = RouterState(tunables, BS), RouterState(tunables, BS)
    rng_first, rng_second = random.Random(1), random.Random(2)
    loads = random.Random(5)
    held: dict[str, set[int]] = {rid: set() for rid in IDS}
    now_s = 0.0
    hot = 0
    for i, (hashes, session) in enumerate(_prompts()):
        if i % 25 == 0:  # a stats period: both routers get the same digests
            for digest in _digests(held, i + 1):
                first.apply_digest(digest)
                second.apply_digest(digest)
        snapshots = [ReplicaSnapshot(rid, loads.randrange(0, 10)) for rid in IDS]
        a = first.rank(hashes, snapshots, rng_first, now_s=now_s, session_key=session)
        b = second.rank(hashes, snapshots, rng_second, now_s=now_s, session_key=session)
        assert a == b, f"request {i}"
        hot += a.prefix_replicas > 1
        for state in (first, second):
            state.on_routed(a.ranked[0], hashes, now_s, session)
        held[a.ranked[0]].update(hashes)
        now_s += 0.05
    assert hot > 0  # the hot system prompt was replicated along the way, and still agreed


@pytest.mark.parametrize("loads", [[0] * 6, [3, 3, 1, 1, 3, 3]])
def test_two_routers_place_a_new_prefix_on_the_same_replica(loads):
    """With no cache anywhere and tied loads, routers that never talked pick the same replica for a prefix."""
    hashes = block_hashes(list(range(40 * BS)), BS)
    snapshots = [ReplicaSnapshot(rid, n) for rid, n in zip(IDS, loads)]
    picks = {RouterState(RoutingConfig(), BS).rank(hashes, snapshots, random.Random(seed), now_s=0.0).ranked[0]
             for seed in range(8)}
    assert len(picks) == 1
