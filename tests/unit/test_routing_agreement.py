"""Routers agreeing without shared state: rendezvous hashing, two router states making the same picks, and the
sampled agreement check (a decision against the ranking of shared state alone)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from kvtide.config import RoutingConfig
from kvtide.deployments.messages import RoutingKey
from kvtide.deployments.routing import rendezvous
from kvtide.deployments.routing.agreement import (AGREEMENT_SAMPLE_EVERY, Agreement, AgreementSampler,
                                                  check_agreement)
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.policy import RouterState
from kvtide.deployments.routing.ray_router import PrefixAwareRouter, agreement_tags
from kvtide.deployments.routing.replication import group_key
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


# ---- the agreement check -----------------------------------------------------------------------

A, B = IDS[0], IDS[1]
PREFIX = block_hashes(list(range(40 * BS)), BS)  # 40 blocks: a cached copy is worth 5 queued requests


def _holding(*holders: str) -> RouterState:
    """A router state whose engines report `PREFIX` on `holders` (engine truth only, nothing private)."""
    state = RouterState(RoutingConfig(), BS)
    for rid in IDS[:2]:
        state.apply_digest(CacheDigest.from_hashes(rid, 1, 1, PREFIX if rid in holders else []))
    return state


def _routed_to_b(state: RouterState) -> None:
    state.index.on_routed(B, PREFIX, 0.0)  # routing history only: no digest shows it yet


def _session_on_b(state: RouterState) -> None:
    state.sessions.remember("user-1", B, 0.0)


def _hot_group(state: RouterState) -> None:
    state.demand.observe(group_key(PREFIX, state.key_blocks), PREFIX, 0.0)  # the only group: share 1


def _nothing(state: RouterState) -> None:
    pass


# (engine holders, private input set, loads of A and B, session key, the pick, agrees, reason)
CASES = {
    "no private state: agrees": ((A,), _nothing, (0, 0), None, A, True, None),
    "history pointing where engine truth does: agrees": ((B,), _routed_to_b, (0, 1), None, B, True, None),
    "history not in a digest yet moves the pick": ((), _routed_to_b, (0, 1), None, B, False, "history"),
    "a sticky session moves the pick off the cached replica": ((A,), _session_on_b, (0, 0), "user-1", B, False,
                                                                "session"),
    "a hot group's credit moves the pick to an idle member": ((A,), _hot_group, (2, 0), None, B, False,
                                                              "replication"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_agreement_check_names_the_private_input_that_moved_the_pick(case):
    """A pick equal to the shared-state ranking agrees; one moved by history, a session or replication names it."""
    holders, private, loads, session, pick, agrees, reason = case
    state = _holding(*holders)
    private(state)
    snaps = [ReplicaSnapshot(rid, n) for rid, n in zip((A, B), loads)]
    decision = state.rank(PREFIX, snaps, random.Random(0), now_s=1.0, session_key=session)
    assert decision.ranked[0] == pick
    agreement = check_agreement(state, decision, PREFIX, snaps, now_s=1.0, session_key=session)
    assert agreement is not None
    assert (agreement.agrees, agreement.reason) == (agrees, reason)
    assert (agreement.shared_choice == pick) == agrees
    assert state.rank(PREFIX, snaps, random.Random(0), now_s=1.0, session_key=session) == decision  # read only


@pytest.mark.parametrize("hashes, num_replicas", [((), 2), (PREFIX, 1)], ids=["no full block", "one candidate"])
def test_no_block_or_a_single_candidate_is_not_checked(hashes, num_replicas):
    """No prefix to agree on (no full block) or no choice (one replica): no check, no count."""
    state = _holding(A)
    snaps = [ReplicaSnapshot(rid, 0) for rid in IDS[:num_replicas]]
    decision = state.rank(hashes, snaps, random.Random(0), now_s=1.0)
    assert check_agreement(state, decision, hashes, snaps, now_s=1.0) is None
    sampler = AgreementSampler()
    assert [sampler.check(state, decision, hashes, snaps, now_s=1.0) for _ in range(20)] == [None] * 20


def test_sampler_checks_the_first_checkable_decision_then_every_nth():
    """Checks land on checkable decisions 0, N, 2N, ... whatever uncheckable ones come between."""
    state = _holding(A)
    snaps = [ReplicaSnapshot(rid, 0) for rid in (A, B)]
    decision = state.rank(PREFIX, snaps, random.Random(0), now_s=1.0)
    sampler = AgreementSampler()
    checked = []
    for i in range(3 * AGREEMENT_SAMPLE_EVERY):
        sampler.check(state, decision, (), snaps, now_s=1.0)  # a short prompt between: not counted
        if sampler.check(state, decision, PREFIX, snaps, now_s=1.0) is not None:
            checked.append(i)
    assert checked == [0, AGREEMENT_SAMPLE_EVERY, 2 * AGREEMENT_SAMPLE_EVERY]


def test_engine_only_match_leaves_out_routing_history():
    """match(engine_only=True) is engine truth alone, the same walk as the full match minus this router's history."""
    state = _holding(A)
    _routed_to_b(state)
    longer = block_hashes(list(range(41 * BS)), BS)  # PREFIX and one block more
    state.index.on_routed(A, longer, 0.0)  # A: one routed block past what its engine holds
    assert state.index.match(longer, 1.0) == {A: 41, B: 40}
    assert state.index.match(longer, 1.0, engine_only=True) == {A: 40}
    assert state.index.match(longer, 11.0) == {A: 40}  # history expired: the two answers meet


def test_two_routers_whose_checks_agree_make_the_same_pick():
    """Routers with the same digests and different traffic (two nodes): wherever both agree, they pick alike."""
    tunables = RoutingConfig()
    routers = [RouterState(tunables, BS), RouterState(tunables, BS)]
    loads = random.Random(5)
    held: dict[str, set[int]] = {rid: set() for rid in IDS}
    now_s, both_agree, disagreements = 0.0, 0, 0
    for i, (hashes, session) in enumerate(_prompts()):
        if i % 25 == 0:
            for digest in _digests(held, i + 1):
                for state in routers:
                    state.apply_digest(digest)
        snapshots = [ReplicaSnapshot(rid, loads.randrange(0, 10)) for rid in IDS]
        decisions = [state.rank(hashes, snapshots, random.Random(i), now_s=now_s, session_key=session)
                     for state in routers]
        checks = [check_agreement(state, d, hashes, snapshots, now_s=now_s, session_key=session)
                  for state, d in zip(routers, decisions)]
        if all(c is not None and c.agrees for c in checks):
            assert decisions[0].ranked[0] == decisions[1].ranked[0], f"request {i}"
            both_agree += 1
        disagreements += sum(c is not None and not c.agrees for c in checks)
        served_by = i % 2  # HAProxy spreads the traffic: each request is routed by one of the two
        pick = decisions[served_by].ranked[0]
        routers[served_by].on_routed(pick, hashes, now_s, session)
        held[pick].update(hashes)
        now_s += 0.05
    assert both_agree > 0 and disagreements > 0  # both branches exercised


# ---- the Ray adapter's counter -----------------------------------------------------------------


class FakeCounter:
    """Records each increment's tags."""

    def __init__(self) -> None:
        self.incs: list[dict[str, str]] = []

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.incs.append(tags)


class FakeReplica:
    """The attributes of a RunningReplica the router reads."""

    def __init__(self, unique_id: str):
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DeploymentID(name="Engine", app_name="app"))
        self.routing_stats: dict = {}
        self.max_ongoing_requests = 100

    async def get_queue_len(self, deadline_s: float) -> int:
        return 0


def _pick_only(hashes) -> PendingRequest:
    return PendingRequest(args=[RoutingKey(block_hashes=hashes)], kwargs={}, metadata=None)


@pytest.mark.parametrize("agreement, tags", [
    (Agreement(True, A), {"agrees": "true", "reason": "none"}),
    (Agreement(False, A, "session"), {"agrees": "false", "reason": "session"}),
])
def test_agreement_tags_fill_every_tag_key(agreement, tags):
    """Ray requires every declared tag: an agreeing check reads reason="none", a disagreeing one its reason."""
    assert agreement_tags(agreement) == tags


def test_router_counts_sampled_checks_by_policy_agrees_and_reason():
    """PrefixAwareRouter counts the first checkable decision and every Nth after it, with all three tags."""
    router = PrefixAwareRouter(deployment_id=DeploymentID(name="Engine", app_name="app"),
                               handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BS, seed=0)
    counter = router._metrics.agreement_checks = FakeCounter()
    replicas = [FakeReplica(A), FakeReplica(B)]

    async def scenario():
        router.update_replicas(replicas)
        for _ in range(AGREEMENT_SAMPLE_EVERY + 1):
            await router.choose_replicas(replicas, _pick_only(PREFIX))
            await router.choose_replicas(replicas, _pick_only(()))  # no full block: never checked

    asyncio.run(scenario())
    assert len(counter.incs) == 2
    assert counter.incs[0] == {"policy": "prefix_aware", "agrees": "true", "reason": "none"}  # nothing private yet
    assert set(counter.incs[1]) == {"policy", "agrees", "reason"}
