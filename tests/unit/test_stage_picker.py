"""Picker stage: guard side, session, cost, then the tie band and rendezvous for first place."""

from __future__ import annotations

import random

from kvtide.deployments.routing import rendezvous
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import CacheDigest
from kvtide.deployments.routing.stages.picker import order_candidates

IDS = ["a", "b", "c"]
GROUP = 12345


def pick(costs, over=(False, False, False), held=(0, 0, 0), gpu=None, sticky=None, k=1, band=512.0,
         session_key=None, group=GROUP, seed=0, index=None):
    order, first_sticky = order_candidates(IDS, list(costs), list(over), list(held),
                                           list(held if gpu is None else gpu), sticky, k, band, session_key, group,
                                           random.Random(seed), index or PrefixIndex(10.0))
    return [IDS[i] for i in order], first_sticky


def test_every_replica_under_the_guard_ranks_before_every_replica_over_it():
    """Affinity never overrides the guard: the cheapest replica over it comes after the dearer ones under it."""
    assert pick([0, 900, 800], over=[True, False, False])[0] == ["c", "b", "a"]


def test_the_sessions_replica_goes_first_under_the_guard_and_not_over_it():
    """Stickiness outranks cost under the guard; over it, the session goes where cost says."""
    assert pick([0, 900, 800], sticky="b") == (["b", "a", "c"], True)
    assert pick([0, 900, 800], over=[False, True, False], sticky="b") == (["a", "c", "b"], False)


def test_holders_within_the_band_tie_and_the_groups_owner_among_them_goes_first():
    """Two holders within tie_band_tokens of each other tie; rendezvous weight of the group picks, not the load."""
    weights = rendezvous.weights(GROUP, ["a", "b"])
    owner = max(["a", "b"], key=weights.__getitem__)
    assert pick([100, 300, 5000], held=[8, 8, 0])[0][0] == owner
    assert pick([100, 700, 5000], held=[8, 8, 0])[0][0] == "a"  # past the band, cost decides


def test_among_holders_of_as_many_blocks_gpu_goes_before_host_memory():
    """A tie between a GPU holder and a CPU-tier holder of the same blocks goes to the GPU holder."""
    assert pick([0, 3, 5000], held=[8, 8, 0], gpu=[0, 8, 0])[0][0] == "b"
    assert pick([0, 3, 5000], held=[8, 8, 0], gpu=[8, 0, 0])[0][0] == "a"


def test_a_prefix_nobody_holds_goes_to_the_emptiest_engine_among_the_tied():
    """New prefixes fill the emptiest cache: equal costs, no holder → fewest blocks held first."""
    index = PrefixIndex(10.0)
    index.apply_digest(CacheDigest.from_hashes("a", 1, 1, range(1, 50)))
    index.apply_digest(CacheDigest.from_hashes("c", 1, 1, range(100, 110)))
    assert pick([0, 0, 0], index=index)[0][0] == "b"


def test_only_a_request_with_neither_blocks_nor_session_draws_from_the_rng():
    """Ties with a group or a session key are deterministic across rngs; with neither, the rng decides."""
    assert {pick([0, 0, 0], seed=s)[0][0] for s in range(20)} == {pick([0, 0, 0])[0][0]}
    assert {pick([0, 0, 0], session_key="u1", seed=s)[0][0] for s in range(20)} == \
        {pick([0, 0, 0], session_key="u1")[0][0]}
    assert len({pick([0, 0, 0], group=None, seed=s)[0][0] for s in range(20)}) > 1
