"""Hot-prefix replication: group keys, decayed demand, and the policy spreading a hot group over k replicas."""

from __future__ import annotations

import random

import pytest

from fakes import index_holding, snapshots

from kvtide.config import RoutingConfig
from kvtide.deployments.routing import rendezvous
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.policy import rank_replicas
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import ReplicaSnapshot
from kvtide.deployments.routing.replication import (MAX_SHARED_BLOCKS, PrefixDemand, common_prefix_blocks, group_key,
                                                     key_blocks_for, replica_count)

BS = 32
PROMPT = block_hashes(list(range(64 * BS)), BS)  # 64 blocks; its group key is block 4 (128 tokens)
OTHER = block_hashes(list(range(10_000, 10_000 + 64 * BS)), BS)
TUNE = RoutingConfig()
KEY_BLOCKS = key_blocks_for(TUNE.replication_key_tokens, BS)
GROUP = group_key(PROMPT, KEY_BLOCKS)
IDS = [f"r{i}" for i in range(8)]


snaps = snapshots


def index_with(**held: int) -> PrefixIndex:
    """Replica r's engine holds the first held[r] blocks of PROMPT."""
    return index_holding(PROMPT, TUNE.history_ttl_s, held)


def demand_with(share: float, prompts=(PROMPT,), total: int = 100) -> PrefixDemand:
    """Demand where PROMPT's group is `share` of `total` requests (observed at t=0), the rest OTHER's."""
    demand = PrefixDemand(TUNE.replication_half_life_s)
    hot = round(share * total)
    for i in range(hot):
        hashes = prompts[i % len(prompts)]
        demand.observe(group_key(hashes, KEY_BLOCKS), hashes, 0.0)
    for _ in range(total - hot):
        demand.observe(group_key(OTHER, KEY_BLOCKS), OTHER, 0.0)
    return demand


def decide(loads, index, demand, hashes=PROMPT, tunables=TUNE):
    return rank_replicas(hashes, BS, snaps(loads), index, tunables, random.Random(0), now_s=0.0, demand=demand)


def holder_outside_set(k: int) -> str:
    """A replica that is not in the group's top-k rendezvous set (so the set is all cold)."""
    return rendezvous.top(GROUP, IDS, len(IDS))[-1] if k < len(IDS) else IDS[0]


# ---- pure pieces ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_hashes, key_blocks, expected_depth", [
    (64, 4, 4), (3, 4, 3), (1, 4, 1), (64, 1, 1),
])
def test_group_key_is_the_hash_at_key_depth(num_hashes, key_blocks, expected_depth):
    """The group key names the first key_blocks blocks (all of a shorter request's blocks)."""
    assert group_key(PROMPT[:num_hashes], key_blocks) == PROMPT[expected_depth - 1]


def test_group_key_of_no_blocks_is_none():
    """A request without a full block belongs to no group."""
    assert group_key([], 4) is None


@pytest.mark.parametrize("key_tokens, block_size, expected", [(128, 32, 4), (128, 16, 8), (100, 32, 3), (8, 32, 1)])
def test_key_blocks_round_down_to_whole_blocks_at_least_one(key_tokens, block_size, expected):
    """replication_key_tokens becomes whole blocks, never zero."""
    assert key_blocks_for(key_tokens, block_size) == expected


@pytest.mark.parametrize("a, b, expected", [
    (PROMPT, PROMPT, 64), (PROMPT, PROMPT[:10], 10), (PROMPT[:10], PROMPT, 10),
    (PROMPT, OTHER, 0), (PROMPT, [], 0),
    (PROMPT, PROMPT[:17] + block_hashes(list(range(5000, 5000 + 8 * BS)), BS, parent=PROMPT[16]), 17),
])
def test_common_prefix_blocks_finds_the_divergence(a, b, expected):
    """Binary search over chained hashes finds how many leading blocks two requests share."""
    assert common_prefix_blocks(a, b) == expected


@pytest.mark.parametrize("demand, capacity, max_replicas, num_replicas, expected", [
    (3.0, 4.0, 8, 8, 1),     # fits one replica
    (4.0, 4.0, 8, 8, 1),     # exactly one replica's worth
    (4.1, 4.0, 8, 8, 2),     # just over: one more
    (30.0, 4.0, 8, 8, 8),    # capped by max_replicas
    (30.0, 4.0, 8, 5, 5),    # capped by the fleet
    (30.0, 4.0, 1, 8, 1),    # max_replicas=1 disables replication
    (5.0, 0.0, 8, 8, 1),     # no capacity figure: no replication
])
def test_replica_count_table(demand, capacity, max_replicas, num_replicas, expected):
    """k = ceil(demand / capacity) within 1..min(max_replicas, fleet)."""
    assert replica_count(demand, capacity, max_replicas, num_replicas) == expected


# ---- PrefixDemand ----------------------------------------------------------------------------


def test_share_is_the_decayed_fraction_of_requests():
    """An arrival one half-life older weighs half: A at t=0 and B at t=half-life give A a share of 1/3."""
    demand = PrefixDemand(half_life_s=10.0)
    demand.observe(1, [1], 0.0)
    demand.observe(2, [2], 10.0)
    assert demand.share(1) == pytest.approx(1 / 3)
    assert demand.share(2) == pytest.approx(2 / 3)
    assert demand.share(3) == 0.0


def test_requests_without_a_group_count_toward_the_total():
    """A block-less request (key None) dilutes every group's share."""
    demand = PrefixDemand(half_life_s=10.0)
    demand.observe(1, [1], 0.0)
    demand.observe(None, [], 0.0)
    assert demand.share(1) == pytest.approx(0.5) and len(demand) == 1


def test_shares_survive_the_weight_rescaling():
    """After hundreds of half-lives (weights rescaled to stay finite) shares are still exact."""
    demand = PrefixDemand(half_life_s=1.0)
    for t in range(0, 1000, 1):
        demand.observe(1 if t % 4 else 2, [1 if t % 4 else 2], float(t))
    assert 0.0 < demand.share(2) < 1.0
    demand.observe(2, [2], 1000.0)
    assert demand.share(2) > 0.5  # the latest arrival dominates at one half-life per request


def test_shared_prefix_only_shrinks_to_what_all_requests_share():
    """The group's shared prefix is the common prefix of its requests, never longer."""
    demand = PrefixDemand(half_life_s=10.0)
    other_tail = PROMPT[:20] + block_hashes(list(range(7000, 7000 + 8 * BS)), BS, parent=PROMPT[19])
    demand.observe(GROUP, PROMPT, 0.0)
    assert len(demand.shared_prefix(GROUP)) == 64
    demand.observe(GROUP, other_tail, 1.0)
    assert list(demand.shared_prefix(GROUP)) == PROMPT[:20]
    demand.observe(GROUP, PROMPT, 2.0)
    assert len(demand.shared_prefix(GROUP)) == 20


def test_shared_prefix_is_capped():
    """A very long first request is kept only up to MAX_SHARED_BLOCKS (bounded memory per group)."""
    demand = PrefixDemand(half_life_s=10.0)
    long = block_hashes(list(range((MAX_SHARED_BLOCKS + 10) * 4)), 4)
    demand.observe(long[0], long, 0.0)
    assert len(demand.shared_prefix(long[0])) == MAX_SHARED_BLOCKS


def test_full_table_drops_the_colder_half():
    """At max_groups the colder half goes; the hottest group survives with its count."""
    demand = PrefixDemand(half_life_s=10.0, max_groups=8)
    for _ in range(10):
        demand.observe(999, [999], 0.0)
    for key in range(8):
        demand.observe(key, [key], 0.0)
    assert len(demand) <= 8 and demand.share(999) == pytest.approx(10 / 18)


def test_demand_rejects_a_non_positive_half_life():
    """A zero half-life would make every share undefined."""
    with pytest.raises(ValueError, match="half_life_s"):
        PrefixDemand(half_life_s=0.0)


# ---- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("share, holder_load, other_load, expected_k", [
    # 8 replicas. limit = 1.25 × mean + 2; capacity = 0.5 × limit; demand = share × Σ load.
    (0.25, 6, 4, 3),    # Σ 34, limit 7.3, cap 3.7, demand 8.5 → 3
    (0.5, 6, 4, 5),     # demand 17 → 5
    (1.0, 6, 4, 8),     # demand 34 → 10, capped at 8
    (0.05, 6, 4, 1),    # a small group stays on its holder
    (1.0, 1, 0, 1),     # low load: the guard's slack absorbs a whole-fleet group (1 request in flight)
])
def test_replica_set_size_follows_demand(share, holder_load, other_load, expected_k):
    """k grows with the group's estimated in-flight demand over replication_fill × the guard limit."""
    holder = IDS[0]
    loads = {rid: holder_load if rid == holder else other_load for rid in IDS}
    d = decide(loads, index_with(**{holder: 64}), demand_with(share))
    assert d.prefix_replicas == expected_k


def test_hot_group_spreads_over_its_rendezvous_set_not_the_least_loaded():
    """A hot group goes to a member of its top-k rendezvous set, not its busy holder nor a lighter outsider."""
    members = rendezvous.top(GROUP, IDS, 3)
    holder = holder_outside_set(3)
    outsiders = [rid for rid in IDS if rid not in members and rid != holder]
    loads = {rid: 4 for rid in IDS} | {holder: 6, outsiders[0]: 3}
    d = decide(loads, index_with(**{holder: 64}), demand_with(0.25))
    assert d.prefix_replicas == 3
    assert d.ranked[0] in members
    assert d.outcome == "load_fallback" and d.matched_tokens == 0  # the first copy is a real (one-off) prefill
    # Without demand information the same request piles onto the holder.
    assert decide(loads, index_with(**{holder: 64}), None).ranked[0] == holder


def test_members_within_the_set_share_by_load():
    """Inside the set the credited replicas compete on queue alone: the least loaded member wins."""
    members = rendezvous.top(GROUP, IDS, 3)
    loads = {rid: 4 for rid in IDS} | {members[0]: 6, members[1]: 5, members[2]: 3}
    d = decide(loads, index_with(**{members[0]: 64}), demand_with(0.25))
    assert d.ranked[0] == members[2]


def test_credit_is_the_shared_prefix_so_history_stays_home():
    """Only the group's shared prefix is credited: a conversation's own history keeps it on the replica holding it."""
    # Two requests of the group diverge after 16 blocks: the shared prefix is 16 blocks.
    variant = PROMPT[:16] + block_hashes(list(range(9000, 9000 + 48 * BS)), BS, parent=PROMPT[15])
    holder = holder_outside_set(3)
    loads = {rid: 4 for rid in IDS} | {holder: 6}
    d = decide(loads, index_with(**{holder: 64}), demand_with(0.25, prompts=(PROMPT, variant)))
    # holder: 6 × 256 = 1,536; a member: (64 − 16) × 32 + 4 × 256 = 2,560.
    assert d.prefix_replicas == 3 and d.ranked[0] == holder and d.outcome == "cache_hit"


def test_credit_never_exceeds_what_some_replica_holds():
    """A member is credited at most the longest real match: nobody has computed the rest yet."""
    holder = holder_outside_set(3)
    loads = {rid: 4 for rid in IDS} | {holder: 5}
    # The holder has 8 blocks: 56 × 32 + 5 × 256 = 3,072; a member credited 8: 56 × 32 + 4 × 256 = 2,816.
    d = decide(loads, index_with(**{holder: 8}), demand_with(0.25))
    assert d.ranked[0] in rendezvous.top(GROUP, IDS, 3)
    # One request lighter, the holder wins (2,560 < 2,816); a member credited all 64 blocks (1,024) would not lose.
    loads[holder] = 3
    assert decide(loads, index_with(**{holder: 8}), demand_with(0.25)).ranked[0] == holder


def test_replication_never_overrides_the_load_guard():
    """A credited member over the guard ranks after every replica under it."""
    members = rendezvous.top(GROUP, IDS, 3)
    loads = {rid: 4 for rid in IDS} | {m: 40 for m in members}  # mean 16 → limit 22: members over
    d = decide(loads, index_with(**{members[0]: 64}), demand_with(1.0))
    assert set(d.ranked[-len(members):]) == set(members)


def test_replica_set_does_not_depend_on_snapshot_order():
    """The set is a function of the group key and the replica ids, not of the order Ray lists them in."""
    loads = {rid: 4 for rid in IDS} | {IDS[0]: 6}
    index, demand = index_with(**{IDS[0]: 64}), demand_with(0.25)
    expected = decide(loads, index, demand).ranked
    for seed in range(5):
        shuffled = list(loads.items())
        random.Random(seed).shuffle(shuffled)
        assert decide(dict(shuffled), index, demand).ranked == expected


def test_replication_disabled_with_max_replicas_one():
    """replication_max_replicas=1 turns replication off: the holder keeps the hot group."""
    holder = holder_outside_set(3)
    loads = {rid: 4 for rid in IDS} | {holder: 6}
    d = decide(loads, index_with(**{holder: 64}), demand_with(1.0), tunables=RoutingConfig(replication_max_replicas=1))
    assert d.prefix_replicas == 1 and d.ranked[0] == holder


def test_pick_only_guesses_do_not_make_a_group_hot():
    """Direct mode's picks since the last report steer load, but only requests known in flight size a group's demand."""
    demand, index = demand_with(0.9), index_with(r0=64)

    def k_of(fleet):
        return rank_replicas(PROMPT, BS, fleet, index, TUNE, random.Random(0), now_s=0.0, demand=demand).prefix_replicas

    picks_only = [ReplicaSnapshot(rid, 6, confirmed_ongoing_requests=0) for rid in IDS]  # 6 picks each, may be done
    assert k_of(picks_only) == 1
    assert k_of([ReplicaSnapshot(rid, 6) for rid in IDS]) == len(IDS)  # the same load known in flight (ingress mode)
    reported = [ReplicaSnapshot(rid, 6, num_running=6, confirmed_ongoing_requests=0) for rid in IDS]
    assert k_of(reported) == len(IDS)  # ... or reported running by the engines

