"""Session affinity: the session table, and sticky multi-turn routing under the load guard."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fakes import index_holding, snapshots

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.policy import RouterState, rank_replicas
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.sessions import SessionTable
from kvtide.deployments.routing.snapshot import ReplicaSnapshot

BS = 32
PROMPT = block_hashes(list(range(64 * BS)), BS)
TUNE = RoutingConfig()
TTL_S = TUNE.session_ttl_s


def snaps(**loads: int) -> list[ReplicaSnapshot]:
    return snapshots(loads)


def index_with(**held: int) -> PrefixIndex:
    return index_holding(PROMPT, TUNE.history_ttl_s, held)


def sessions_with(now_s: float = 0.0, **last: str) -> SessionTable:
    """A table where session key k's last turn went to replica last[k] at `now_s`."""
    table = SessionTable(TTL_S)
    for key, rid in last.items():
        table.remember(key, rid, now_s)
    return table


def decide(snapshots, index, sessions, session_key, hashes=PROMPT, now_s=1.0, seed=0):
    return rank_replicas(hashes, BS, snapshots, index, TUNE, random.Random(seed), now_s=now_s,
                         session_key=session_key, sessions=sessions)


# ---- SessionTable ----------------------------------------------------------------------------


def test_table_remembers_the_last_replica_until_the_ttl():
    """last_replica answers the latest turn's replica, and None once ttl_s passed without a turn."""
    table = SessionTable(ttl_s=10.0)
    table.remember("s", "a", 0.0)
    table.remember("s", "b", 5.0)
    assert table.last_replica("s", 14.9) == "b"
    assert table.last_replica("s", 15.0) is None
    assert table.last_replica("unknown", 0.0) is None


def test_table_is_bounded_and_drops_the_oldest_session():
    """At max_sessions the least recently routed session goes first; a refreshed one survives."""
    table = SessionTable(ttl_s=100.0, max_sessions=2)
    table.remember("old", "a", 0.0)
    table.remember("mid", "a", 1.0)
    table.remember("old", "b", 2.0)  # refreshed: now the newest
    table.remember("new", "c", 3.0)
    assert (table.last_replica("mid", 3.0), table.last_replica("old", 3.0), len(table)) == (None, "b", 2)


def test_table_drops_expired_sessions_as_it_goes():
    """Expired entries leave the table on the next remember, so it does not grow with dead sessions."""
    table = SessionTable(ttl_s=1.0)
    for i in range(100):
        table.remember(f"s{i}", "a", float(i) * 2)
    assert len(table) == 1


def test_forget_replica_drops_its_sessions_only():
    """A replica that went away takes its sessions with it; others stay."""
    table = sessions_with(s1="a", s2="b")
    table.forget_replica("a")
    assert (table.last_replica("s1", 0.0), table.last_replica("s2", 0.0)) == (None, "b")


def test_table_rejects_a_non_positive_ttl():
    """A zero TTL would forget every session at once."""
    with pytest.raises(ValueError, match="ttl_s"):
        SessionTable(ttl_s=0.0)


# ---- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("loads, held, last, expected_first, expected_sticky", [
    # the session's replica wins against a replica holding the whole prefix, under the guard
    ({"a": 0, "b": 0}, {"a": 64}, "b", "b", True),
    # ... and against a lighter one (a queue of 3 is within the guard: limit 1.25 × 1.5 + 2)
    ({"a": 0, "b": 3}, {}, "b", "b", True),
    # over the guard, the session goes where the cost model says (mean 15.5 → limit 19.4 + 2
    # + the 2,048-token prompt's 8 requests = 29.4)
    ({"a": 1, "b": 30}, {"b": 64}, "b", "a", False),
    # the session's replica is not a candidate any more: the cost model decides
    ({"a": 0, "c": 0}, {"c": 64}, "b", "c", False),
])
def test_session_sticks_to_its_last_replica_under_the_guard(loads, held, last, expected_first, expected_sticky):
    """The replica of the session's last turn ranks first while under the load guard, never past it."""
    d = decide(snaps(**loads), index_with(**held), sessions_with(chat=last), "chat")
    assert (d.ranked[0], d.sticky) == (expected_first, expected_sticky)


def test_expired_or_unknown_session_follows_the_cost_model():
    """After session_ttl_s without a turn (or with no memory at all) the cache holder wins again."""
    index = index_with(a=64)
    assert decide(snaps(a=0, b=0), index, sessions_with(chat="b"), "chat", now_s=TTL_S + 1).ranked[0] == "a"
    assert decide(snaps(a=0, b=0), index, sessions_with(), "chat").ranked[0] == "a"


def test_session_sticks_before_any_digest_reports_its_blocks():
    """A next turn follows the session even when its blocks are in neither a digest nor the routing history."""
    state = RouterState(TUNE, BS)
    turn_1 = PROMPT[:40]
    state.on_routed("b", turn_1, 0.0, session_key="chat")
    later_s = TUNE.history_ttl_s + 1  # the routing history has expired, the session has not
    d = state.rank(PROMPT, snaps(a=0, b=1, c=0), random.Random(0), now_s=later_s, session_key="chat")
    assert (d.ranked[0], d.sticky) == ("b", True)


def test_session_key_breaks_ties_and_spreads_sessions():
    """Without a memory, equal replicas are ordered by the session key's rendezvous weight: stable, and spread."""
    index = index_with()
    first = {decide(snaps(a=1, b=1), index, None, "s1", seed=seed).ranked[0] for seed in range(10)}
    assert len(first) == 1  # the rng plays no part
    wins = Counter(decide(snaps(a=1, b=1), index, None, f"user-{i}").ranked[0] for i in range(400))
    assert set(wins) == {"a", "b"} and min(wins.values()) > 150


def test_session_key_orders_ties_even_for_block_less_requests():
    """A request with no full block but a session still gets a deterministic (rng-free) pick."""
    index = index_with()
    picks = {decide(snaps(a=1, b=1), index, None, "s1", hashes=[], seed=seed).ranked[0] for seed in range(10)}
    assert len(picks) == 1
