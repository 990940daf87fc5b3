"""prefix_aware: rank engine replicas by estimated time-to-first-token, under a load guard.

`rank_replicas` is the policy as a chain of stages (`deployments.routing.stages`), each pure
and tested on its own:

    filters   the load guard splits the candidates: every replica under it ranks before every
              replica over it (stages.filters; the standby and pin filters run before the
              policy, in the Ray adapter)
    scorers   per replica, in prefill-token equivalents: the prefix cost by tier (GPU blocks
              cost nothing, CPU-tier blocks their load, the rest a recompute; a hot group's
              credit counts as GPU) + the queue cost; the session's replica (stages.scorers)
    picker    (over, session, cost, replica id), then the tie band and rendezvous for first
              place (stages.picker)
    post      `RouterState.on_routed` books a sent request (stages.post_response)

The algorithm with its formulas, why each term is there, the consequences the unit tests pin
and the tunables' defaults with their reasons are in docs/architecture.md ("Routing policy").

Outcome label (for the router's metrics), from the blocks replicas really hold on any tier (a
credit is not a cache hit):
- "no_match":      no replica holds even the first block of the request.
- "cache_hit":     the pick holds the longest match any replica has (> 0 blocks).
- "load_fallback": some replica holds more of the prefix than the pick, and load (the
                   guard, queue cost outweighing the cached tokens, or a hot group's
                   deliberate spread onto a member that does not hold it yet) moved it away.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Generator, Literal, Mapping, Sequence

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.replication import PrefixDemand, group_key, key_blocks_for
from kvtide.deployments.routing.stages import filters, picker, post_response, scorers
from kvtide.deployments.routing.sessions import SessionTable
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot

Outcome = Literal["cache_hit", "load_fallback", "no_match"]
OUTCOMES: tuple[Outcome, ...] = ("cache_hit", "load_fallback", "no_match")


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
    # Of matched_tokens, those ranked[0] is expected to load from its CPU tier (the rest on GPU).
    cpu_matched_tokens: int = 0


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
                  prefix_match: Mapping[str, int] | None = None,
                  cpu_index: PrefixIndex | None = None) -> RoutingDecision:
    """Rank `snapshots`' replicas for a request whose full blocks hash to `request_hashes`.

    Without `demand` there is no replication, without `sessions` no stickiness (the
    session key still breaks ties), without `cpu_index` no CPU tier; the inputs are only read.
    `prefix_match`: the GPU index's match for `request_hashes` when the caller has it already
    (the agreement check passes engine truth alone, `index.match(..., engine_only=True)`); None:
    `index.match`.
    """
    if not snapshots:
        return RoutingDecision([], "no_match", 0)
    ids = [s.replica_id for s in snapshots]
    num_blocks = len(request_hashes)

    # scorers: the match by tier, the hot group's credit, the session, the costs
    gpu_blocks = scorers.match_gpu(request_hashes, ids, index, now_s, prefix_match)
    cpu_blocks = scorers.match_cpu(request_hashes, ids, gpu_blocks, cpu_index)
    held = gpu_blocks if cpu_blocks is None else [g + c for g, c in zip(gpu_blocks, cpu_blocks)]
    best_blocks = max(held)
    group = group_key(request_hashes, key_blocks_for(tunables.replication_key_tokens, block_size))
    members, credit, k = scorers.NOT_HOT
    if group is not None and demand is not None:
        members, credit, k = scorers.replication_credit(group, request_hashes, ids, best_blocks, demand, snapshots,
                                                        tunables)
    sticky = scorers.session_replica(sessions, session_key, now_s)
    cached = scorers.credited(gpu_blocks, ids, members, credit)
    work = scorers.queue_cost([s.num_queued_requests for s in snapshots],
                              [s.pending_prefill_tokens for s in snapshots], tunables)
    costs = [prefix + queue for prefix, queue in
             zip(scorers.prefix_cost(num_blocks, cached, gpu_blocks, cpu_blocks, snapshots, block_size, tunables),
                 work)]

    # filter: the load guard judges the work ahead of the request
    over = filters.load_guard(snapshots, work, gpu_blocks, num_blocks, block_size, tunables)

    # picker
    order, first_sticky = picker.order_candidates(ids, costs, over, held, gpu_blocks, sticky, k,
                                                  tunables.tie_band_tokens, session_key, group, rng, index)
    first = order[0]
    picked_blocks = held[first]
    if best_blocks == 0:
        outcome: Outcome = "no_match"
    elif picked_blocks == best_blocks:
        outcome = "cache_hit"
    else:
        outcome = "load_fallback"
    exclusive_blocks = 0
    if picked_blocks and picked_blocks == best_blocks:  # else none, or another holds more: nothing exclusive
        exclusive_blocks = picked_blocks - max((b for i, b in enumerate(held) if i != first), default=0)
    cpu_picked = 0 if cpu_blocks is None else max(0, picked_blocks - cached[first])
    return RoutingDecision([ids[i] for i in order], outcome, picked_blocks * block_size, k, first_sticky,
                           exclusive_blocks * block_size, cpu_picked * block_size)


class RouterState:
    """What one router remembers between decisions: the prefix indexes (GPU, CPU tier), group demand,
    session memory.

    `rank` decides (read-only), `on_routed` books a request once it is sent, and the
    digest/replica methods keep the view current as stats arrive. Time is a parameter.
    """

    def __init__(self, tunables: RoutingConfig, block_size: int):
        self.tunables = tunables
        self.block_size = block_size
        self.key_blocks = key_blocks_for(tunables.replication_key_tokens, block_size)
        self.index = PrefixIndex(history_ttl_s=tunables.history_ttl_s)
        # Engine truth of the replicas' CPU tiers (their digests' `cpu` part); the router books no
        # history there: what it sends is computed on GPU.
        self.cpu_index = PrefixIndex(history_ttl_s=tunables.history_ttl_s)
        self.demand = PrefixDemand(half_life_s=tunables.replication_half_life_s)
        self.sessions = SessionTable(ttl_s=tunables.session_ttl_s)

    def rank(self, request_hashes: Sequence[BlockHash], snapshots: Sequence[ReplicaSnapshot], rng: random.Random,
             *, now_s: float, session_key: str | None = None) -> RoutingDecision:
        return rank_replicas(request_hashes, self.block_size, snapshots, self.index, self.tunables, rng, now_s=now_s,
                             session_key=session_key, demand=self.demand, sessions=self.sessions,
                             cpu_index=self.cpu_index if self.tunables.cpu_tier_aware else None)

    def on_routed(self, replica_id: str, request_hashes: Sequence[BlockHash], now_s: float,
                  session_key: str | None = None) -> None:
        """Book a request sent to `replica_id` (stages.post_response.book_routed)."""
        post_response.book_routed(self.index, self.demand, self.sessions, self.key_blocks, replica_id,
                                  request_hashes, now_s, session_key)

    def apply_digest(self, digest: CacheDigest) -> bool:
        """Apply a replica's digest (its CPU tier's with it); whether the GPU part was newer and applied."""
        applied = self.index.apply_digest(digest)
        if digest.cpu is not None:
            self.cpu_index.apply_digest(digest.cpu)
        return applied

    def apply_digest_steps(self, digest: CacheDigest, max_blocks: int | None) -> Generator[None, None, bool]:
        """`apply_digest` in slices of at most `max_blocks` blocks (see `PrefixIndex.apply_digest_steps`)."""
        applied = yield from self.index.apply_digest_steps(digest, max_blocks)
        if digest.cpu is not None:
            yield from self.cpu_index.apply_digest_steps(digest.cpu, max_blocks)
        return applied

    def remove_replica(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
        self.cpu_index.remove_replica(replica_id)
        self.sessions.forget_replica(replica_id)
