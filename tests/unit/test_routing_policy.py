"""prefix_aware policy: affinity by estimated cost, bounded by a load guard, deterministic ties."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fakes import index_holding, snapshots

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.policy import rank_replicas
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot

BS = 32
PROMPT = block_hashes(list(range(64 * BS)), BS)  # 64 blocks, 2,048 tokens
TUNE = RoutingConfig()


def snaps(**loads: int) -> list[ReplicaSnapshot]:
    return snapshots(loads)


def index_with(**held: int) -> PrefixIndex:
    """An index where replica r's engine holds the first held[r] blocks of PROMPT."""
    return index_holding(PROMPT, TUNE.history_ttl_s, held)


def decide(snapshots, index, hashes=PROMPT, tunables=TUNE, seed=0, now_s=0.0):
    return rank_replicas(hashes, BS, snapshots, index, tunables, random.Random(seed), now_s=now_s)


@pytest.mark.parametrize("loads, held, best, outcome", [
    # affinity: the holder wins at equal load
    ({"a": 0, "b": 0, "c": 0}, {"b": 64}, "b", "cache_hit"),
    # affinity survives a small queue difference (2,048 cached tokens ≈ 8 queued requests)
    ({"a": 0, "b": 3}, {"b": 64}, "b", "cache_hit"),
    # longest prefix wins over a shorter one at equal load
    ({"a": 1, "b": 1}, {"a": 10, "b": 40}, "b", "cache_hit"),
    # queue cost outweighs a short cached prefix: load moves it, labelled as such
    ({"a": 0, "b": 3}, {"b": 2}, "a", "load_fallback"),
    # no match anywhere: least loaded
    ({"a": 5, "b": 1, "c": 3}, {}, "b", "no_match"),
])
def test_pick_table(loads, held, best, outcome):
    """The first-ranked replica and outcome label for load/affinity combinations."""
    d = decide(snaps(**loads), index_with(**held))
    assert (d.ranked[0], d.outcome) == (best, outcome)
    assert sorted(d.ranked) == sorted(loads)


def test_affinity_yields_to_load_guard():
    """A replica holding the whole prefix but over factor × mean + slack ranks after every replica under it."""
    loads = {"a": 40, "b": 10, "c": 10}  # mean 20 → limit 25 + 2 + the 2,048-token prompt's 8 requests = 35
    d = decide(snaps(**loads), index_with(a=64))
    assert d.ranked[-1] == "a"
    assert d.outcome == "load_fallback" and d.matched_tokens == 0


def test_load_guard_is_strict_even_with_huge_affinity_weight():
    """Even when cached tokens dwarf queue cost, an over-guard replica is never first."""
    tune = RoutingConfig(uncached_weight=1000.0)  # the whole prompt cached: worth 8,000 queued requests
    d = decide(snaps(a=30, b=1), index_with(a=64), tunables=tune)  # mean 15.5 → limit 19.4 + 2 + 8 = 29.4
    assert d.ranked == ["b", "a"]


def test_kv_full_replica_counts_as_over_guard():
    """A replica whose KV cache is at the usage guard loses its affinity (under half the prompt) to one with room."""
    snapshots = [ReplicaSnapshot("a", 0, kv_usage_perc=0.97), ReplicaSnapshot("b", 0, kv_usage_perc=0.2)]
    assert decide(snapshots, index_with(a=31)).ranked == ["b", "a"]


def test_kv_full_replica_keeps_requests_it_mostly_holds():
    """A full KV cache bars new prefills, not hits: holding half the prompt or more, the replica keeps it."""
    snapshots = [ReplicaSnapshot("a", 0, kv_usage_perc=0.97), ReplicaSnapshot("b", 0, kv_usage_perc=0.2)]
    assert decide(snapshots, index_with(a=32)).ranked == ["a", "b"]
    assert decide(snapshots, index_with(a=64)).ranked == ["a", "b"]


def test_a_report_caught_mid_prefill_keeps_affinity():
    """One prompt's worth of pending prefill on the holder (a report taken mid-prefill) does not move its prefix."""
    snapshots = [ReplicaSnapshot("a", 1, pending_prefill_tokens=64 * BS), ReplicaSnapshot("b", 0)]
    d = decide(snapshots, index_with(a=64))
    assert (d.ranked[0], d.outcome) == ("a", "cache_hit")


def test_a_prompts_worth_of_queued_requests_keeps_affinity_with_no_prefill_reported():
    """With no pending prefill anywhere the guard still has the prompt as slack: 9 queued (a pick-only
    router's picks since the report, some of them finished) on the holder of a 2,048-token prompt, none
    elsewhere, keep the prefix there (limit 1.25 × 4.5 + 2 + 8 = 15.6), but 30 do not."""
    assert decide([ReplicaSnapshot("a", 9), ReplicaSnapshot("b", 0)], index_with(a=64)).ranked == ["a", "b"]
    assert decide([ReplicaSnapshot("a", 30), ReplicaSnapshot("b", 0)], index_with(a=64)).ranked == ["b", "a"]


def test_pending_prefill_counts_as_work_ahead():
    """At equal queue counts, the replica with fewer prompt tokens still to prefill wins (no cache anywhere)."""
    snapshots = [ReplicaSnapshot("a", 2, pending_prefill_tokens=12_000), ReplicaSnapshot("b", 2)]
    assert decide(snapshots, index_with()).ranked == ["b", "a"]


def test_cheap_queue_keeps_affinity_under_overload():
    """Many queued hits (little prefill) do not push a holder over the guard; a few cold prefills do.

    Counted in requests alone (limit 1.25 × mean 14.7 + 2 + the prompt's 8 = 28.3), `a`'s 30 queued
    are over the guard and its prefix goes elsewhere; weighed in tokens, 30 cheap requests are
    less work than b's and c's 7 cold 6k-token prefills each.
    """
    snapshots = [ReplicaSnapshot("a", 30, pending_prefill_tokens=30 * 128),
                 ReplicaSnapshot("b", 7, pending_prefill_tokens=7 * 6_000),
                 ReplicaSnapshot("c", 7, pending_prefill_tokens=7 * 6_000)]
    d = decide(snapshots, index_with(a=64))
    assert (d.ranked[0], d.outcome) == ("a", "cache_hit")
    count_only = [ReplicaSnapshot("a", 30), ReplicaSnapshot("b", 7), ReplicaSnapshot("c", 7)]
    assert decide(count_only, index_with(a=64)).ranked[0] != "a"


def test_cold_prefills_push_a_replica_over_the_guard():
    """A replica whose pending prefill is far above the fleet's mean loses even a full prefix match."""
    snapshots = [ReplicaSnapshot("a", 2, pending_prefill_tokens=40_000), ReplicaSnapshot("b", 2),
                 ReplicaSnapshot("c", 2)]
    d = decide(snapshots, index_with(a=64))
    assert (d.ranked[-1], d.outcome) == ("a", "load_fallback")


def test_engine_queue_counts_as_load():
    """Engine-reported running+waiting counts when it exceeds the router's own in-flight count."""
    snapshots = [ReplicaSnapshot("a", 0, num_running=8, num_waiting=8), ReplicaSnapshot("b", 1)]
    assert decide(snapshots, index_with()).ranked[0] == "b"


def test_evicted_blocks_stop_attracting():
    """After a digest without the prefix, the former holder gets no affinity (least loaded wins)."""
    index = index_with(a=64)
    index.apply_digest(CacheDigest.from_hashes("a", 1, 2, []))
    d = decide(snaps(a=1, b=0), index)
    assert (d.ranked[0], d.outcome) == ("b", "no_match")


def test_routing_history_attracts_then_decays():
    """A prefix routed to a replica attracts the next request before any digest, and not after the TTL."""
    index = index_with()
    index.on_routed("b", PROMPT, now_s=50.0)
    assert decide(snaps(a=0, b=1), index, now_s=51.0).ranked[0] == "b"
    later = 50.0 + TUNE.history_ttl_s + 1
    d = decide(snaps(a=0, b=1), index, now_s=later)
    assert (d.ranked[0], d.outcome) == ("a", "no_match")


def test_ties_without_blocks_or_session_are_random_and_both_chosen():
    """Equal replicas, for a request with no full block and no session, are picked by the injected rng."""
    # Was test_ties_are_random_and_both_chosen with PROMPT: a request with blocks now breaks
    # ties by rendezvous hashing (routers agree), so the rng is left to block-less requests.
    rng = random.Random(7)
    index = index_with()
    wins = Counter(rank_replicas([], BS, snaps(a=2, b=2), index, TUNE, rng, now_s=0.0).ranked[0]
                   for _ in range(400))
    assert set(wins) == {"a", "b"} and min(wins.values()) > 150


def test_ties_with_blocks_ignore_the_rng_and_spread_over_prefixes():
    """A prefix's tie goes to the same replica whatever the rng; different prefixes spread over equal replicas."""
    index = index_with()
    for seed in range(5):
        assert decide(snaps(a=2, b=2), index, seed=seed).ranked == decide(snaps(a=2, b=2), index, seed=0).ranked
    prompts = [block_hashes([p] * (4 * BS), BS) for p in range(400)]
    wins = Counter(decide(snaps(a=2, b=2), index, hashes=h).ranked[0] for h in prompts)
    assert set(wins) == {"a", "b"} and min(wins.values()) > 150


def test_a_prefix_no_tied_replica_holds_goes_to_the_emptiest_engine():
    """At equal load, new prefixes fill the engine holding the fewest blocks first (as Ray's smallest tree)."""
    index = index_with()
    for rid, n in (("a", 30), ("b", 5), ("c", 60)):  # other prompts' blocks fill the engines unevenly
        index.apply_digest(CacheDigest.from_hashes(rid, 1, 1, [10_000 * (ord(rid) + 1) + i for i in range(n)]))
    prompts = [block_hashes([p] * (4 * BS), BS) for p in range(50)]
    assert {decide(snaps(a=1, b=1, c=1), index, hashes=h).ranked[0] for h in prompts} == {"b"}
    # a prefix one of them holds still goes to its holder; load still comes first
    assert decide(snaps(a=1, b=1, c=1), index, hashes=tuple(10_000 * (ord("c") + 1) + i for i in range(8))).ranked[0] == "c"
    assert decide(snaps(a=1, b=4, c=1), index, hashes=prompts[0]).ranked[0] == "a"


def test_seeded_rng_is_deterministic():
    """The same seed gives the same ranking (reproducible benchmarks and tests)."""
    s = snaps(a=0, b=0, c=0, d=0)
    assert decide(s, index_with(), seed=3).ranked == decide(s, index_with(), seed=3).ranked


def test_replicas_outside_snapshots_are_ignored():
    """A replica known to the index but absent from the snapshots is never ranked nor counted as best match."""
    d = decide(snaps(a=0, b=0), index_with(gone=64, a=4))
    assert "gone" not in d.ranked and d.outcome == "cache_hit" and d.matched_tokens == 4 * BS


def test_empty_snapshots_give_empty_ranking():
    """No replicas: an empty ranking, not an exception (the adapter waits and retries)."""
    assert decide([], index_with()).ranked == []


def test_short_prompt_without_full_block_is_least_loaded():
    """A prompt shorter than one block has no hashes and goes to the least loaded replica."""
    d = decide(snaps(a=3, b=0), index_with(a=64), hashes=[])
    assert (d.ranked[0], d.outcome) == ("b", "no_match")


@pytest.mark.parametrize("field, value", [
    ("load_guard_factor", 0.9), ("load_guard_slack", -1.0), ("tokens_per_queued_request", -1.0),
    ("kv_usage_guard_perc", 0.0), ("history_ttl_s", 0.0),
    ("replication_key_tokens", 0), ("replication_fill", 0.0), ("replication_fill", 1.5),
    ("replication_max_replicas", 0), ("replication_half_life_s", 0.0), ("session_ttl_s", 0.0),
])
def test_tunables_reject_values_that_break_the_guard(field, value):
    """Tunables that could leave no replica under the guard (or make no sense) are rejected by name."""
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{field: value})


@pytest.mark.parametrize("sticky, k, expected", [(True, 3, "session"), (False, 3, "replicated"),
                                                 (False, 2, "replicated"), (False, 1, "single")])
def test_route_label_names_how_the_first_choice_was_reached(sticky, k, expected):
    """The decisions counter's route: session stickiness first, then replication (k >= 2), else single."""
    from kvtide.deployments.routing.policy import RoutingDecision, route_of

    assert route_of(RoutingDecision(["a"], "cache_hit", 0, prefix_replicas=k, sticky=sticky)) == expected



def _reference_keys(fleet, index, now_s, sticky) -> list[tuple]:
    """The documented pick order, by the plain tuple sort: (over, over or not sticky, cost, replica id)."""
    per_request = TUNE.tokens_per_queued_request
    work = {s.replica_id: s.pending_prefill_tokens + per_request * s.num_queued_requests for s in fleet}
    limit = (TUNE.load_guard_factor * sum(work.values()) / len(fleet) + TUNE.load_guard_slack * per_request
             + len(PROMPT) * BS)
    matched = index.match(PROMPT, now_s)
    keyed = []
    for s in fleet:
        held = matched.get(s.replica_id, 0)
        over = work[s.replica_id] > limit or (s.kv_usage_perc >= TUNE.kv_usage_guard_perc and 2 * held < len(PROMPT))
        cost = ((len(PROMPT) - held) * BS * TUNE.uncached_weight + s.pending_prefill_tokens
                + per_request * s.num_queued_requests)
        keyed.append((over, over or s.replica_id != sticky, cost, s.replica_id))
    return sorted(keyed)


def test_ranking_is_the_documented_sort_on_random_fleets():
    """The list-based scoring (no per-replica tuples) ranks as the tuple sort it replaced; only ties for first
    (exact, or within tie_band_tokens among holders) move."""
    from kvtide.deployments.routing.sessions import SessionTable

    rng = random.Random(5)
    for trial in range(300):
        ids = [f"r{i:02d}" for i in rng.sample(range(40), rng.randrange(1, 12))]
        fleet = [ReplicaSnapshot(r, rng.choice([0, 1, 2, 2, 3, 9]), kv_usage_perc=rng.choice([0.1, 0.1, 0.97]),
                                 pending_prefill_tokens=rng.choice([0, 0, 0, 128, 2048, 6000]))
                 for r in ids]
        index = index_with(**{r: rng.choice([0, 0, 4, 8, 64]) for r in ids})
        sessions = SessionTable(ttl_s=60.0)
        sticky = rng.choice(ids + [None, None])
        if sticky is not None:
            sessions.remember("s", sticky, 0.0)
        d = rank_replicas(PROMPT, BS, fleet, index, TUNE, random.Random(trial), now_s=1.0, session_key="s",
                          sessions=sessions)
        keyed = _reference_keys(fleet, index, 1.0, sticky)
        first = keyed[0]
        # The first place's ties: none for a session's replica; within tie_band_tokens of its cost
        # when the band applies, exact otherwise (on its side of the guard).
        held = index.match(PROMPT, 1.0)
        first_held = held.get(first[3], 0)
        # the band applies when the first place holds some of the prompt and a replica on its side holds less
        band = TUNE.tie_band_tokens if first_held and any(
            held.get(k[3], 0) < first_held and k[0] == first[0] for k in keyed) else 0.0
        tied = 1 if not first[1] else sum(1 for k in keyed if k[:2] == first[:2] and k[2] <= first[2] + band)
        expected = [k[3] for k in keyed]
        assert sorted(d.ranked[:tied]) == sorted(expected[:tied]) and d.ranked[tied:] == expected[tied:], trial
        assert d.sticky == (not keyed[0][1]), trial


# ---- the tie band: holders of a prefix within tie_band_tokens go to the group's owner ---------------

def _owner_of_prompt(*ids: str) -> str:
    from kvtide.deployments.routing import rendezvous
    from kvtide.deployments.routing.replication import group_key, key_blocks_for

    group = group_key(PROMPT, key_blocks_for(TUNE.replication_key_tokens, BS))
    return rendezvous.top(group, list(ids), 1)[0]


@pytest.mark.parametrize("loads", [{"a": 1, "b": 2}, {"a": 2, "b": 1}, {"a": 0, "b": 2}, {"a": 2, "b": 0}])
def test_holders_within_the_band_go_to_the_groups_owner_whatever_the_load_order(loads):
    """Two full holders (c holds nothing) whose loads differ by up to 2 requests (512 tokens): the owner, either way."""
    d = decide(snaps(**loads, c=0), index_with(a=64, b=64))
    assert d.ranked[0] == _owner_of_prompt("a", "b")


def test_past_the_band_load_decides_between_holders():
    """Loads 3 requests apart (768 tokens > 512): the less loaded holder, owner or not."""
    owner = _owner_of_prompt("a", "b")
    other = "b" if owner == "a" else "a"
    assert decide(snaps(**{owner: 3, other: 0}, c=0), index_with(a=64, b=64)).ranked[0] == other


def test_a_prefix_every_replica_holds_alike_goes_by_load():
    """All hold it (one system prompt for all traffic): no owner, the less loaded by one request wins."""
    for loads in ({"a": 0, "b": 1}, {"a": 1, "b": 0}):
        assert decide(snaps(**loads), index_with(a=64, b=64)).ranked[0] == min(loads, key=loads.get)


def test_a_cold_prompt_still_goes_to_the_least_loaded():
    """Nobody holds it: exact ties only, so one request of load difference decides (cold prompts spread)."""
    for loads in ({"a": 0, "b": 1}, {"a": 1, "b": 0}):
        assert decide(snaps(**loads), index_with()).ranked[0] == min(loads, key=loads.get)


def test_a_band_of_zero_restores_exact_ties():
    """tie_band_tokens=0: the less loaded holder wins by one request."""
    exact = RoutingConfig(tie_band_tokens=0)
    for loads in ({"a": 0, "b": 1}, {"a": 1, "b": 0}):
        assert decide(snaps(**loads, c=0), index_with(a=64, b=64), tunables=exact).ranked[0] == min(
            loads, key=loads.get)


@pytest.mark.parametrize("held, best, exclusive_blocks", [
    ({"b": 64}, "b", 64),                # only b holds the prompt: all of it is b's alone
    ({"a": 10, "b": 40}, "b", 30),       # a holds the first 10 blocks too: b alone holds 30
    ({"a": 64, "b": 64}, None, 0),       # both hold all of it (either may win the tie): none exclusive
    ({}, None, 0),                       # nothing cached anywhere
])
def test_the_decision_says_how_much_of_its_match_no_other_replica_holds(held, best, exclusive_blocks):
    """exclusive_tokens: the first choice's matched blocks beyond the best other candidate's, in tokens."""
    d = decide(snaps(a=0, b=0), index_with(**held))
    assert best in (None, d.ranked[0]) and d.exclusive_tokens == exclusive_blocks * BS
