"""Picker: the order the router tries the candidates in, best first.

    sort       (over, r ≠ s unless over, cost, replica id): every replica under the load guard before
               every replica over it, whatever its affinity, credit or session; under the guard the
               session's replica s first
    tied       the replicas on the first place's side of the guard whose cost is within
               tie_band_tokens of its cost, if the first place holds some of the request, some replica
               on its side holds less, and the group is not hot (k < 2); else those of exactly its cost
    tiebreak   replicas tied for FIRST place are reordered by rendezvous weight of the session key;
               else, by the prefix group g: the tied replicas holding most of the request first, or, if
               none holds any, the engine holding the fewest blocks first (new prefixes fill the
               emptiest cache), then by rendezvous weight of g; only a request with neither (no full
               block, no session) draws from the rng. Later places (tried only when the first rejects)
               keep replica-id order, so weights are computed for the few tied replicas, not all N

Routers agree: the same snapshots, index content and demand give the same order whatever their
rngs (rendezvous weights and replica ids are computed alike everywhere); the band lets routers
whose loads differ by a request or two still send a held group to one replica, its owner.
"""

from __future__ import annotations

import random

from kvtide.deployments.routing import rendezvous
from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.prefix_index import PrefixIndex


def order_candidates(ids: list[str], costs: list[float], over: list[bool], held_blocks: list[int],
                     gpu_blocks: list[int], sticky: str | None, k: int, tie_band_tokens: float,
                     session_key: str | None, group: BlockHash | None, rng: random.Random,
                     index: PrefixIndex) -> tuple[list[int], bool]:
    """Positions of `ids` best first (module docstring), and whether the first is the session's replica.

    `held_blocks`: the request's blocks each replica really holds (any tier; a credit is not a hold);
    `gpu_blocks`: those of them on GPU (among holders of as many, GPU before host memory);
    `index`: the GPU index, whose per-replica block counts break a tie among replicas holding none.
    """
    # The order of sorting (over, over or rid != sticky, cost, rid), built as a stable sort by
    # cost of the replica-id order, then a stable partition by guard and session.
    order = _by_replica_id(ids)
    order.sort(key=costs.__getitem__)
    order, first_sticky = _partition(order, over, ids, sticky)
    if not first_sticky and len(order) > 1:
        band = tie_band_tokens if _owner_decides(order[0], held_blocks, over, k) else 0.0
        tied = _tied_for_first(order, over, costs, band)
        if tied > 1:
            order[:tied] = _break_tie_for_first(order[:tied], ids, held_blocks, gpu_blocks, session_key, group,
                                                 rng, index)
    return order, first_sticky


_ID_ORDERS: dict[tuple[str, ...], list[int]] = {}
_MAX_ID_ORDERS = 256  # candidate lists seen by one router: a few per fleet shape; cleared when exceeded


def _by_replica_id(ids: list[str]) -> list[int]:
    """Positions of `ids` in replica-id order, as a new list (memoized: the candidate list rarely changes)."""
    key = tuple(ids)
    order = _ID_ORDERS.get(key)
    if order is None:
        if len(_ID_ORDERS) >= _MAX_ID_ORDERS:
            _ID_ORDERS.clear()
        order = _ID_ORDERS[key] = sorted(range(len(ids)), key=ids.__getitem__)
    return order[:]


def _partition(order: list[int], over: list[bool], ids: list[str], sticky: str | None) -> tuple[list[int], bool]:
    """`order` with the replicas under the guard first, the session's replica first among them (stable otherwise).

    Also whether the first place is the session's replica.
    """
    if True in over:
        under = [i for i in order if not over[i]]
        order = under + [i for i in order if over[i]]
    else:
        under = order
    if sticky is None or not under:
        return order, False
    for pos in range(len(under)):
        if ids[order[pos]] == sticky:
            order.insert(0, order.pop(pos))
            return order, True
    return order, False


def _owner_decides(first: int, blocks_of: list[int], over: list[bool], k: int) -> bool:
    """Whether the tie band applies: the first place holds some of the request, and holding it is
    what sets replicas apart (some replica on its side of the guard holds less).

    Then replicas holding it within the band tie and the group's owner among them takes it, so
    routers whose load views differ by a request or two agree, and a copy two routers made at
    once ages out. Not for a prefix every candidate holds alike (a system prompt shared by all
    traffic: load, not an owner, should place it), a cold prompt (cold prompts spread by load
    between reports), or a hot group (k >= 2), whose members share it by load.
    """
    held = blocks_of[first]
    if held == 0 or k >= 2:
        return False
    side = over[first]
    return any(blocks < held and o == side for blocks, o in zip(blocks_of, over))


def _tied_for_first(order: list[int], over: list[bool], costs: list[float], band: float) -> int:
    """How many replicas share the first place: its guard side and a cost within `band` tokens of its
    cost (`order` is sorted by cost on each side). They are the ones the tiebreak reorders."""
    first = order[0]
    first_over, worst_cost = over[first], costs[first] + band
    end = 1
    while end < len(order) and costs[order[end]] <= worst_cost and over[order[end]] == first_over:
        end += 1
    return end


def _break_tie_for_first(tied: list[int], ids: list[str], blocks_of: list[int], gpu_of: list[int],
                         session_key: str | None,
                         group: BlockHash | None, rng: random.Random, index: PrefixIndex) -> list[int]:
    """Order the replicas tied for first place: a session by rendezvous weight of its key; a prefix
    group to the replicas that really hold most of the request (a hot group's credit ties members
    that do not), by rendezvous weight of the group among them; a prefix none of them holds to
    the replica whose engine holds the fewest blocks, then by rendezvous weight.

    Fewest blocks for a new prefix (Ray's PrefixCacheAffinityRouter sends an unmatched prefix to its
    smallest tree too): at low load every replica ties, and rendezvous alone deals a few dozen
    groups to a few replicas unevenly (a small sample of a uniform draw), so some engines would
    hold and serve far more prefixes than others.
    The count is the engines' own report, which every router sees alike (routers still agree,
    but for the ~1 s a digest takes to reach them all). Only the first place is contested
    (later places are tried only when the first rejects, and keep their replica-id order), so
    the weights are computed for a few replicas, not N.
    """
    if session_key is not None:
        weights = rendezvous.weights(rendezvous.hash_str(session_key), [ids[i] for i in tied])
        tied.sort(key=lambda i: weights[ids[i]], reverse=True)
    elif group is not None:
        weights = rendezvous.weights(group, [ids[i] for i in tied])
        if any(blocks_of[i] for i in tied):  # some hold it: the holders first (GPU before host memory), by rendezvous
            tied.sort(key=lambda i: (-blocks_of[i], -gpu_of[i], -weights[ids[i]]))
        else:  # a prefix new to all of them: the emptiest engine
            tied.sort(key=lambda i: (index.num_held_by(ids[i]), -weights[ids[i]]))
    else:
        rng.shuffle(tied)  # no blocks, no session: nothing for routers to agree on
    return tied
