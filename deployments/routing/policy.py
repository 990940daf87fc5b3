"""prefix_aware: rank engine replicas by estimated time-to-first-token, under a load guard.

The pure function `rank_replicas` turns (request block hashes, replica snapshots, the
prefix index, the prefix groups' demand, the session memory, tunables, an rng, the
clock, an optional session key) into a ranking, best first. The Ray Serve adapter tries
the replicas in that order (a full replica rejects, the next is tried). `RouterState`
bundles what one router remembers between decisions and books each routed request.

Algorithm, one decision:

    candidates   one entry per snapshot (replicas the router may use right now)
    match        index.match(hashes): longest cached prefix per replica, in blocks
    guard        load(r) = r.num_queued_requests  (reported running + waiting, + the router's
                                                    pick-only picks since the report that
                                                    have probably not finished)
                 pend(r) = r.pending_prefill_tokens  (prompt tokens accepted, not yet prefilled;
                                                      + the router's picks since the report,
                                                      drained at the engine's prefill rate)
                 work(r) = pend(r) + tokens_per_queued_request × load(r)           (tokens)
                 limit   = load_guard_factor × mean(work)
                           + load_guard_slack × tokens_per_queued_request + the prompt's tokens
                           (with pend = 0 everywhere: load(r) > factor × mean(load) + slack
                            + the prompt's tokens / tokens_per_queued_request)
                 over(r) = work(r) > limit
                           or (r.kv_usage_perc >= kv_usage_guard_perc and r holds < half the prompt)
    group        g = hash of the request's first replication_key_tokens (whole blocks)
    replicate    demand(g) = share(g) × Σ known(r)    (share: g's decayed share of requests;
                                                       known: load(r) without direct mode's
                                                       pick-only picks since the last report)
                 k = ceil(demand(g) / (replication_fill × limit')), 1 ≤ k ≤ replication_max_replicas, N
                 (limit': the request limit above, of the known loads)
                 if k ≥ 2: set(g) = the top k replicas by rendezvous weight of g
                           credit = min(blocks the request shares with g's shared prefix,
                                        the longest match any candidate has)
    score        cached(r) = max(matched(r), credit) if r ∈ set(g) else matched(r)
                 cost(r)   = (len(hashes) − cached(r)) × block_size × uncached_weight
                                                                         (prefill it must do)
                           + pend(r)                                     (prefill ahead of it)
                           + tokens_per_queued_request × load(r)         (decode work ahead of it)
    sticky       s = the replica that served this session's last turn (session_ttl_s), if known
    pick         sort by (over, r ≠ s unless over, cost, replica id):
                 every replica under the guard comes before every replica over it,
                 whatever its affinity, credit or session; under the guard the session's
                 replica comes first
    tied         the replicas on the first place's side of the guard whose cost is within
                 tie_band_tokens of its cost, if the first place holds some of the request,
                 some replica on its side holds less, and the group is not hot (k < 2); else
                 those of exactly its cost
    tiebreak     replicas tied for FIRST place are reordered by rendezvous weight of the
                 session key; else, by g: the tied replicas holding most of the request
                 first, or, if none holds any, the engine holding the fewest blocks first
                 (new prefixes fill the emptiest cache), then by rendezvous weight of g;
                 only a request with neither (no full block, no session) draws from the rng. Later places (tried only when the first
                 rejects) keep replica-id order, so weights are computed for the few
                 tied replicas, not all N

Why pending prefill (pend) and not a request count alone: with system prompts of
thousands of tokens a count-only cost and guard move requests off the replica holding
their prefix as queues grow, each move a cold prefill that evicts another group there,
so the hit rate collapses as the load rises, far below what an oracle achieves. A queued hit costs ~100 tokens, a
queued miss thousands; engines report the uncached tokens they have yet to prefill
(`deployments.engine.pending_prefill`). Between reports (~1 s) a pick-only router adds its own
picks (`FleetView.book_pick`): each is one queued request (while it has probably not
finished, by the engine's recent request durations: `deployments.routing.pick_load`), and
its uncached prompt tokens beyond one queued request's worth are pending prefill, until
the next report includes them. Counting the larger of the two (not their sum) keeps a short cold prompt from
costing its replica the next request of the same prefix, and with uncached_weight 2 a
long one never does (its holder's booked N tokens against 2N elsewhere). The router
cannot see a prefill end, so it drains the reported and booked tokens at the rate the
engine reports for its own backlog (`deployments.routing.backlog`): a replica caught
mid-prefill at its report stops repelling requests once that prefill would be done.
Engines that report none and no booking (pend = 0 everywhere) give the count-only
guard, with the prompt's tokens in requests (÷ tokens_per_queued_request) as slack.

Consequences, each pinned by a unit test:
- Affinity never overrides the load guard: a replica holding the whole prefix (or
  credited with it, or serving the session) but over the limit ranks after every
  replica under it (bounded-load hashing, Mirrokni et al.).
- No match anywhere: the uncached term is equal for all, so the least loaded wins;
  there is no "smallest tree" fallback that would herd new prefixes onto one replica.
- A longer prefix beats a shorter one at equal load; a cached prefix is worth
  `uncached_weight × block_size × blocks / tokens_per_queued_request` requests of queue.
- Hot prefixes replicate, they are not sprayed: a group whose estimated in-flight demand
  exceeds replication_fill × limit counts as cached (up to its shared prefix) on k
  replicas picked by rendezvous hashing, so its traffic spreads over those k by load,
  and the first request to a cold member prefills the prefix there once. Replicas
  outside the set keep only their real cache. A conversation's own history (blocks past
  the shared prefix) is never credited, so it stays where it is cached. When demand
  falls, k falls, and the extra copies simply stop being preferred.
- Sessions stick: the replica of a session's last turn ranks first while under the
  guard, even before the engine's digest reports that turn's blocks (this router's
  memory); over the guard, the session goes where the cost model says.
- Routers agree: two routers with the same snapshots, index content and demand give
  the same ranking, whatever their rngs: a tie for first goes by rendezvous weight of
  the session key or the prefix group, which every router computes alike, the rest by
  replica id, and the replica set of a hot group is rendezvous too. Breaking ties on the
  prefix group (not on the first block, often the chat template's header that every
  request shares) also spreads different prefixes over equal replicas instead of
  herding them onto one. What a router keeps to itself (routing history, session memory,
  group demand) can still move its pick; `deployments.routing.agreement` measures how
  often, on a sample of decisions ranked again from shared state alone.
- Routers agree on a held prefix despite their load views: two replicas holding a group
  within the band of each other's cost tie, and the tie goes to the group's rendezvous owner
  among them, so routers whose loads differ by a request or two (each counts its own picks)
  still send the group to one replica, and a copy made by two routers' simultaneous first
  requests is left to age out instead of both being kept warm. Past the band load decides; a
  cold prompt (nobody holds it), a prefix every replica holds alike (one system prompt for all
  traffic: an owner there would only queue everyone's first turns on it) and a hot group's
  members still go by load.
- `limit >= mean >= min(load)` when factor >= 1 and slack >= 0, so at least one replica
  is always under the load guard; RoutingConfig's field bounds enforce them. (The
  KV guard can mark every replica; then all rank by cost alone, still load-aware.)

Outcome label (for the router's metrics), from the blocks replicas really hold (a
credit is not a cache hit):
- "no_match":      no replica holds even the first block of the request.
- "cache_hit":     the pick holds the longest match any replica has (> 0 blocks).
- "load_fallback": some replica holds more of the prefix than the pick, and load (the
                   guard, queue cost outweighing the cached tokens, or a hot group's
                   deliberate spread onto a member that does not hold it yet) moved it away.

Tunables (`kvtide.config.RoutingConfig`, the config's `routing:` section, declared once
there with the bounds that keep "at least one replica is under the guard" true), defaults
and why:
- tokens_per_queued_request = 256: what one request already on a replica costs a new
  one, in prefill-token equivalents. With continuous batching a request ahead does not
  block, it takes a share of each step: its own uncached prompt (in cache-friendly
  workloads a question of ~128 tokens) plus its decode steps. 256 makes a cached
  2,048-token system prompt worth 16 queued requests (with uncached_weight 2).
- uncached_weight = 2.0: the request's own uncached tokens count twice against work
  already queued: once for its wait (its TTFT), once for the fleet's prefill capacity it
  spends (and the prefix its blocks evict there). Work already queued is spent whichever
  replica this request goes to. With 1, a replica caught mid-prefill of one prompt (the
  engine's report) ties with a cold replica for the next request of the same prefix.
- load_guard_factor = 1.25: the bounded-load constant c of consistent hashing with
  bounded loads; no replica takes more than 25 % above the mean for affinity's sake.
- load_guard_slack = 2.0 (requests): keeps the guard from firing on noise at low load
  (mean 1 → limit 3.25 requests plus the prompt, not 1.25), where a queue of 2 costs less
  than a 2k prefill. The prompt's own tokens are slack too (a 2k prompt: 8 requests), so
  the guard never fires over one prompt's worth of work; past that, at any load.
- tie_band_tokens = 512: two queued requests (tokens_per_queued_request = 256). Load views of
  routers on different nodes differ by their own recent picks, a request or two; within that,
  holders of the prefix tie and the owner takes the group. A 2k cold prompt's booking (~1,800
  tokens) is far past it, so a replica caught mid-prefill still repels the next request.
- kv_usage_guard_perc = 0.95: a replica whose KV cache is this full by running
  requests would preempt or evict to admit a new prefill; it counts as over the guard
  for a request it holds less than half of (a hit adds few blocks; under overload every
  engine's cache is this full, and barring hits then sprays cold prefills).
- history_ttl_s = 10.0: how long the router's own routing counts as cached before a
  digest confirms it (used by `PrefixIndex`). Long enough to cover a queued request's
  prefill plus a few digest periods (1 s), short enough that a mistaken guess (evicted,
  aborted) stops attracting within seconds.
- replication_key_tokens = 128: the prefix group is named by the first 128 tokens
  (4 blocks of 32, 8 of 16). Past a chat template's header (~30-60 tokens, identical for
  every request) and into the system prompt, so requests with different system prompts
  fall in different groups, yet short enough that one user's question is not in the key.
  Two prompts sharing their first 128 tokens merge into one group whose shared prefix
  (the credit) shrinks to what they have in common: harmless, just less credit.
- replication_fill = 0.5: one group may fill half of a replica's guard limit before it
  gets one more replica. Replicating costs one cold prefill of the shared prefix per new
  member (2k tokens ≈ 8 queued requests, once); not replicating costs the holder a queue
  up to the guard and then cold prefills sprayed by the guard, each evicting another
  prefix. Half leaves the members room for their other traffic (conversations with
  history there, other groups) under the guard. At low load the guard's slack keeps
  demand under it (1 request in flight never replicates).
- replication_max_replicas = 8: a cap on deliberate copies, so an overestimated share
  cannot pull the prefix onto the whole fleet at once; a group bigger than 8 replicas'
  worth still overflows by load, and the replicas it lands on then hold it for real.
- replication_half_life_s = 10.0: the traffic-share estimate forgets with this half-life:
  ten digest periods, so a few requests' burst does not flip k, and a shift in the mix
  is followed within ~20 s.
- session_ttl_s = 60.0: a session sticks to its last replica for a minute after its last
  turn: agent loops and chat replies come back well within it; after longer, the engine
  may have evicted the history and the digests (engine truth) are the better guide.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Generator, Literal, Mapping, Sequence

from kvtide.config import RoutingConfig
from kvtide.deployments.routing import rendezvous
from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.replication import (PrefixDemand, common_prefix_blocks, group_key, key_blocks_for,
                                                     replica_count, replica_set)
from kvtide.deployments.routing.sessions import SessionTable
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot

Outcome = Literal["cache_hit", "load_fallback", "no_match"]
OUTCOMES: tuple[Outcome, ...] = ("cache_hit", "load_fallback", "no_match")
_NOT_HOT: tuple[frozenset[str], int, int] = (frozenset(), 0, 1)


@dataclass(frozen=True)
class RoutingDecision:
    """The ranking (best first) plus what the metrics and tests need to explain it."""

    ranked: list[str]
    outcome: Outcome
    matched_tokens: int  # cached prefix tokens on ranked[0] (0 if it holds none)
    prefix_replicas: int = 1  # k: replicas the request's prefix group is spread over (1: not hot)
    sticky: bool = False  # ranked[0] is the replica of the session's last turn
    # Of matched_tokens, those no other candidate holds (engine truth ∪ routing history): what
    # only ranked[0] can serve from cache, the worth a cache-aware scale-down weighs.
    exclusive_tokens: int = 0


def route_of(decision: RoutingDecision) -> str:
    """How the first choice was reached, for the decisions counter's `route` label.

    session: the replica of the session's previous turn; replicated: a hot prefix group
    spread over k >= 2 replicas; single: one replica's cache or load alone.
    """
    if decision.sticky:
        return "session"
    return "replicated" if decision.prefix_replicas >= 2 else "single"


def rank_replicas(request_hashes: Sequence[BlockHash], block_size: int, snapshots: Sequence[ReplicaSnapshot],
                  index: PrefixIndex, tunables: RoutingConfig, rng: random.Random, *, now_s: float,
                  session_key: str | None = None, demand: PrefixDemand | None = None,
                  sessions: SessionTable | None = None,
                  prefix_match: Mapping[str, int] | None = None) -> RoutingDecision:
    """Rank `snapshots`' replicas for a request whose full blocks hash to `request_hashes`.

    Without `demand` there is no replication, without `sessions` no stickiness (the
    session key still breaks ties); the inputs are only read. `prefix_match`: the index's
    match for `request_hashes` when the caller has it already (the agreement check passes
    engine truth alone, `index.match(..., engine_only=True)`); None: `index.match`.
    """
    if not snapshots:
        return RoutingDecision([], "no_match", 0)

    # candidates, match, guard
    ids = [s.replica_id for s in snapshots]
    loads = [s.num_queued_requests for s in snapshots]
    total_load = sum(loads)
    factor, slack = tunables.load_guard_factor, tunables.load_guard_slack
    limit = factor * (total_load / len(loads)) + slack  # in requests: replication's scale
    per_request = tunables.tokens_per_queued_request
    num_blocks = len(request_hashes)
    pendings = [s.pending_prefill_tokens for s in snapshots]
    # The guard weighs work in tokens: a replica with many cached (cheap) requests queued
    # is less loaded than one with a few cold prefills. Work moves in steps of a prompt, so
    # one prompt like this one is slack too: neither a report caught mid-prefill nor the
    # picks a pick-only router still counts (finished or not) may cost a replica its
    # affinity at low load.
    work = [pending + per_request * load for load, pending in zip(loads, pendings)]
    work_limit = factor * (sum(work) / len(work)) + slack * per_request + num_blocks * block_size
    if prefix_match is None:
        matched = index.match(request_hashes, now_s) if request_hashes else {}
    else:
        matched = prefix_match
    if matched:
        matched_get = matched.get
        blocks_of = [matched_get(rid, 0) for rid in ids]  # only replicas we may use
        best_blocks = max(blocks_of)
    else:
        blocks_of, best_blocks = [0] * len(ids), 0

    # group, replicate
    group = group_key(request_hashes, key_blocks_for(tunables.replication_key_tokens, block_size))
    members, credit, k = _NOT_HOT
    if group is not None and demand is not None:
        members, credit, k = _replica_set(group, request_hashes, ids, best_blocks, demand, snapshots, tunables)

    # sticky
    sticky = sessions.last_replica(session_key, now_s) if sessions is not None and session_key is not None else None

    # score: plain lists of numbers, no per-replica tuples (fewer allocations, fewer GC passes)
    cached = blocks_of
    if credit:
        cached = [credit if blocks < credit and rid in members else blocks for blocks, rid in zip(blocks_of, ids)]
    new_prefill = tunables.uncached_weight * block_size
    costs = [(num_blocks - c) * new_prefill + pending + per_request * load
             for c, pending, load in zip(cached, pendings, loads)]
    kv_guard = tunables.kv_usage_guard_perc
    # A full KV cache bars new prefills, not hits: a replica holding at least half the
    # prompt needs few new blocks for it, and sending it elsewhere means a cold prefill
    # that evicts another prefix there.
    over = [w > work_limit or (snap.kv_usage_perc >= kv_guard and 2 * held < num_blocks)
            for snap, w, held in zip(snapshots, work, blocks_of)]

    # pick: the order of sorting (over, over or rid != sticky, cost, rid), built as a stable
    # sort by cost of the replica-id order, then a stable partition by guard and session.
    order = _by_replica_id(ids)
    order.sort(key=costs.__getitem__)
    order, first_sticky = _partition(order, over, ids, sticky)
    if not first_sticky and len(order) > 1:
        band = tunables.tie_band_tokens if _owner_decides(order[0], blocks_of, over, k) else 0.0
        tied = _tied_for_first(order, over, costs, band)
        if tied > 1:
            order[:tied] = _break_tie_for_first(order[:tied], ids, blocks_of, session_key, group, rng, index)
    picked_blocks = blocks_of[order[0]]
    if best_blocks == 0:
        outcome: Outcome = "no_match"
    elif picked_blocks == best_blocks:
        outcome = "cache_hit"
    else:
        outcome = "load_fallback"
    exclusive_blocks = 0
    if picked_blocks and picked_blocks == best_blocks:  # else none, or another holds more: nothing exclusive
        first = order[0]
        exclusive_blocks = picked_blocks - max((b for i, b in enumerate(blocks_of) if i != first), default=0)
    return RoutingDecision([ids[i] for i in order], outcome, picked_blocks * block_size, k, first_sticky,
                           exclusive_blocks * block_size)


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


def _break_tie_for_first(tied: list[int], ids: list[str], blocks_of: list[int], session_key: str | None,
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
        if any(blocks_of[i] for i in tied):  # some hold it: the holders first, by rendezvous among them
            tied.sort(key=lambda i: (-blocks_of[i], -weights[ids[i]]))
        else:  # a prefix new to all of them: the emptiest engine
            tied.sort(key=lambda i: (index.num_held_by(ids[i]), -weights[ids[i]]))
    else:
        rng.shuffle(tied)  # no blocks, no session: nothing for routers to agree on
    return tied


def _replica_set(group: BlockHash, request_hashes: Sequence[BlockHash], ids: list[str], best_blocks: int,
                 demand: PrefixDemand, snapshots: Sequence[ReplicaSnapshot],
                 tunables: RoutingConfig) -> tuple[frozenset[str], int, int]:
    """(the hot group's replica set, the blocks credited on it, k), or nobody/0/1 if the group is not hot."""
    share = demand.share(group)
    if share == 0.0:
        return _NOT_HOT
    # Demand and capacity from the requests known to be in flight (no pick-only guesses).
    total_load = sum(s.num_confirmed_requests for s in snapshots)
    limit = tunables.load_guard_factor * (total_load / len(snapshots)) + tunables.load_guard_slack
    k = replica_count(share * total_load, tunables.replication_fill * limit, tunables.replication_max_replicas,
                      len(ids))
    if k < 2:
        return _NOT_HOT
    # Credit the group's shared prefix only, and no more than some replica really holds:
    # a member is treated as a holder of what the group has in common, not of one
    # conversation's history, nor of blocks nobody has computed yet.
    shared = common_prefix_blocks(demand.shared_prefix(group), request_hashes)
    return replica_set(group, ids, k), min(shared, best_blocks), k


class RouterState:
    """What one router remembers between decisions: the prefix index, group demand, session memory.

    `rank` decides (read-only), `on_routed` books a request once it is sent, and the
    digest/replica methods keep the view current as stats arrive. Time is a parameter.
    """

    def __init__(self, tunables: RoutingConfig, block_size: int):
        self.tunables = tunables
        self.block_size = block_size
        self.key_blocks = key_blocks_for(tunables.replication_key_tokens, block_size)
        self.index = PrefixIndex(history_ttl_s=tunables.history_ttl_s)
        self.demand = PrefixDemand(half_life_s=tunables.replication_half_life_s)
        self.sessions = SessionTable(ttl_s=tunables.session_ttl_s)

    def rank(self, request_hashes: Sequence[BlockHash], snapshots: Sequence[ReplicaSnapshot], rng: random.Random,
             *, now_s: float, session_key: str | None = None) -> RoutingDecision:
        return rank_replicas(request_hashes, self.block_size, snapshots, self.index, self.tunables, rng, now_s=now_s,
                             session_key=session_key, demand=self.demand, sessions=self.sessions)

    def on_routed(self, replica_id: str, request_hashes: Sequence[BlockHash], now_s: float,
                  session_key: str | None = None) -> None:
        """Book a request sent to `replica_id`: routing history, its group's demand, its session."""
        self.index.on_routed(replica_id, request_hashes, now_s)
        self.demand.observe(group_key(request_hashes, self.key_blocks), request_hashes, now_s)
        if session_key is not None:
            self.sessions.remember(session_key, replica_id, now_s)

    def apply_digest(self, digest: CacheDigest) -> bool:
        return self.index.apply_digest(digest)

    def apply_digest_steps(self, digest: CacheDigest, max_blocks: int | None) -> Generator[None, None, bool]:
        """`apply_digest` in slices of at most `max_blocks` blocks (see `PrefixIndex.apply_digest_steps`)."""
        return self.index.apply_digest_steps(digest, max_blocks)

    def remove_replica(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
        self.sessions.forget_replica(replica_id)
