"""prefix_aware: rank engine replicas by estimated time-to-first-token, under a load guard.

The pure function `rank_replicas` turns (request block hashes, replica snapshots, the
prefix index, tunables, an rng, the clock) into a ranking, best first. The Ray Serve
adapter tries the replicas in that order (a full replica rejects, the next is tried).

Algorithm, one decision:

    candidates   one entry per snapshot (replicas the router may use right now)
    match        index.match(hashes): longest cached prefix per replica, in blocks
    guard        load(r) = r.num_queued_requests
                 limit   = load_guard_factor × mean(load) + load_guard_slack
                 over(r) = load(r) > limit  or  r.kv_usage_perc >= kv_usage_guard_perc
    score        cost(r) = uncached prefill tokens on r                      (prefill it must do)
                         + tokens_per_queued_request × load(r)              (work ahead of it)
                 uncached = (len(hashes) − matched_blocks(r)) × block_size
    pick         sort by (over, cost, random tiebreak): every replica under the guard
                 comes before every replica over it, whatever its affinity

Consequences, each pinned by a unit test:
- Affinity never overrides the load guard: a replica holding the whole prefix but over
  the limit ranks after every replica under it (bounded-load hashing, Mirrokni et al.).
- No match anywhere: the uncached term is equal for all, so the least loaded wins;
  there is no "smallest tree" fallback that would herd new prefixes onto one replica.
- A longer prefix beats a shorter one at equal load; a cached prefix is worth
  `block_size × blocks / tokens_per_queued_request` requests of queue.
- Exact ties (equal cost) are broken by the injected rng, so equal replicas share load.
- `limit >= mean >= min(load)` when factor >= 1 and slack >= 0, so at least one replica
  is always under the load guard; RoutingConfig's field bounds enforce them. (The
  KV guard can mark every replica; then all rank by cost alone, still load-aware.)

Outcome label (for the router's metrics):
- "no_match":      no replica holds even the first block of the request.
- "cache_hit":     the pick holds the longest match any replica has (> 0 blocks).
- "load_fallback": some replica holds more of the prefix than the pick, and load (the
                   guard, or queue cost outweighing the cached tokens) moved it away.

Tunables (`kvtide.config.RoutingConfig`, the config's `routing:` section, declared once
there with the bounds that keep "at least one replica is under the guard" true), defaults
and why:
- tokens_per_queued_request = 256: what one request already on a replica costs a new
  one, in prefill-token equivalents. With continuous batching a request ahead does not
  block, it takes a share of each step: its own uncached prompt (in cache-friendly
  workloads a question of ~128 tokens) plus its decode steps. 256 makes a cached
  2,048-token system prompt worth 8 queued requests.
- load_guard_factor = 1.25: the bounded-load constant c of consistent hashing with
  bounded loads; no replica takes more than 25 % above the mean for affinity's sake.
- load_guard_slack = 2.0 (requests): keeps the guard from firing on noise at low load
  (mean 1 → limit 3.25, not 1.25), where a queue of 2 costs less than a 2k prefill.
- kv_usage_guard_perc = 0.95: a replica whose KV cache is this full by running
  requests would preempt or evict to admit a new prefill; it counts as over the guard.
- history_ttl_s = 10.0: how long the router's own routing counts as cached before a
  digest confirms it (used by `PrefixIndex`). Long enough to cover a queued request's
  prefill plus a few digest periods (1 s), short enough that a mistaken guess (evicted,
  aborted) stops attracting within seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, Sequence

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import ReplicaSnapshot

Outcome = Literal["cache_hit", "load_fallback", "no_match"]
OUTCOMES: tuple[Outcome, ...] = ("cache_hit", "load_fallback", "no_match")


@dataclass(frozen=True)
class RoutingDecision:
    """The ranking (best first) plus what the metrics need to explain it."""

    ranked: list[str]
    outcome: Outcome
    matched_tokens: int  # cached prefix tokens on ranked[0] (0 if it holds none)


def rank_replicas(request_hashes: Sequence[BlockHash], block_size: int, snapshots: Sequence[ReplicaSnapshot],
                  index: PrefixIndex, tunables: RoutingConfig, rng: random.Random, *,
                  now_s: float) -> RoutingDecision:
    """Rank `snapshots`' replicas for a request whose full blocks hash to `request_hashes`."""
    if not snapshots:
        return RoutingDecision([], "no_match", 0)

    # candidates
    loads = [s.num_queued_requests for s in snapshots]
    limit = tunables.load_guard_factor * (sum(loads) / len(loads)) + tunables.load_guard_slack
    matched = index.match(request_hashes, now_s) if request_hashes else {}

    # score
    num_blocks = len(request_hashes)
    per_request = tunables.tokens_per_queued_request
    kv_guard = tunables.kv_usage_guard_perc
    keyed = []
    for snap, load in zip(snapshots, loads):
        blocks = matched.get(snap.replica_id, 0)
        over = load > limit or snap.kv_usage_perc >= kv_guard
        cost = (num_blocks - blocks) * block_size + per_request * load
        keyed.append((over, cost, rng.random(), snap.replica_id, blocks))

    # pick
    keyed.sort()
    ranked = [k[3] for k in keyed]
    best_blocks = max(k[4] for k in keyed)  # only replicas the router may use count
    picked_blocks = keyed[0][4]
    if best_blocks == 0:
        outcome: Outcome = "no_match"
    elif picked_blocks == best_blocks:
        outcome = "cache_hit"
    else:
        outcome = "load_fallback"
    return RoutingDecision(ranked, outcome, picked_blocks * block_size)
