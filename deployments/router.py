"""Ray Serve request routers for the engine deployment: prefix_aware and round_robin.

A `RequestRouter` runs inside the caller's process (each ingress replica has its own),
so routing never makes a remote call: the replicas' load and cache digests arrive with
Ray Serve's routing stats (`record_routing_stats`, pushed to every router), and the
router's in-flight counts come from Ray's local queue-length cache.

    choose_replicas(candidates, request)
      observe   routing stats → ReplicaSnapshot per candidate; new digests → PrefixIndex
      decide    deployments.routing.policy.rank_replicas (pure)
      apply     return one rank per replica, best first; on_request_routed → routing history

Pick-only calls (direct mode's routing peer asks `choose_replica(RoutingKey, _reserve=False)`)
never reach `on_request_routed`, and Ray's queue-length cache stays empty for them, so the
router books such a pick itself: the routing history gets the request's blocks, and the
replica's load counts the picks made since its last stats report (the report's numbers
include them from then on).

The policy lives in `deployments.routing.policy`, its tunables in `kvtide.config.RoutingConfig`;
this module only adapts.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.util import metrics

from kvtide.config import RoutingConfig
from kvtide.deployments.messages import RoutingKey
from kvtide.deployments.routing.policy import rank_replicas
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot

DECISION_LATENCY_BUCKETS_S = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2]
MATCHED_TOKENS_BUCKETS = [1, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768]


class RouterMetrics:
    """Routing decisions by policy and outcome, matched-prefix tokens, decision latency."""

    def __init__(self) -> None:
        self.decisions = metrics.Counter(
            "kvtide_router_decisions", "Routing decisions by policy and outcome (cache_hit, load_fallback, no_match).",
            tag_keys=("policy", "outcome"))
        self.matched_tokens = metrics.Histogram(
            "kvtide_router_matched_prefix_tokens", "Cached prefix tokens on the chosen replica, per decision.",
            boundaries=MATCHED_TOKENS_BUCKETS, tag_keys=("policy",))
        self.decision_s = metrics.Histogram(
            "kvtide_router_decision_latency_seconds", "Time to rank replicas for one request.",
            boundaries=DECISION_LATENCY_BUCKETS_S, tag_keys=("policy",))


def _request_hashes(pending_request: Optional[PendingRequest]) -> tuple[int, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return tuple(getattr(pending_request.args[0], "block_hashes", ()) or ())


def _is_pick_only(pending_request: Optional[PendingRequest]) -> bool:
    return pending_request is not None and bool(pending_request.args) and isinstance(pending_request.args[0],
                                                                                       RoutingKey)


def _rid(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """kvtide's router: cache affinity from the engines' own KV events, under a load guard."""

    def initialize_state(self, block_size: int = 16, seed: int | None = None,
                         routing: dict[str, Any] | None = None) -> None:
        self._block_size = block_size
        # Ray hands request_router_kwargs over as plain data; validate it back into the one model.
        self._tunables = RoutingConfig.model_validate(routing or {})
        self._index = PrefixIndex(history_ttl_s=self._tunables.history_ttl_s)
        self._rng = random.Random(seed)
        self._metrics = RouterMetrics()
        self._known: set[str] = set()
        # Pick-only bookkeeping: picks per replica since its stats report stamped `reported_s`.
        self._picks: dict[str, int] = {}
        self._reported_s: dict[str, float] = {}

    def _observe(self, candidates: List[RunningReplica], now_s: float) -> list[ReplicaSnapshot]:
        snapshots = []
        live = set()
        for replica in candidates:
            rid = _rid(replica.replica_id)
            live.add(rid)
            stats = replica.routing_stats or {}
            digest = stats.get("digest")
            if isinstance(digest, CacheDigest):
                self._index.apply_digest(digest if digest.replica_id == rid else _rekey(digest, rid))
            reported_s = stats.get("reported_s")
            if reported_s != self._reported_s.get(rid):
                self._reported_s[rid] = reported_s
                self._picks[rid] = 0
            ongoing = max(self.replica_queue_len_cache.get(replica.replica_id) or 0, self._picks.get(rid, 0))
            snapshots.append(ReplicaSnapshot(
                replica_id=rid, num_ongoing_requests=ongoing,
                num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
                kv_usage_perc=float(stats.get("kv_usage_perc", 0.0))))
        for gone in self._known - live:
            self._index.remove_replica(gone)
            self._picks.pop(gone, None)
            self._reported_s.pop(gone, None)
        self._known = live
        return snapshots

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        started_ns = time.perf_counter_ns()
        now_s = time.monotonic()
        snapshots = self._observe(candidate_replicas, now_s)
        decision = rank_replicas(_request_hashes(pending_request), self._block_size, snapshots, self._index,
                                 self._tunables, self._rng, now_s=now_s)
        by_id = {_rid(r.replica_id): r for r in candidate_replicas}
        tags = {"policy": "prefix_aware"}
        self._metrics.decision_s.observe((time.perf_counter_ns() - started_ns) / 1e9, tags)
        self._metrics.decisions.inc(1, {**tags, "outcome": decision.outcome})
        self._metrics.matched_tokens.observe(decision.matched_tokens, tags)
        if decision.ranked and _is_pick_only(pending_request):
            # Ray takes the first replica of a pick-only ranking and tells the router nothing more.
            picked = decision.ranked[0]
            self._picks[picked] = self._picks.get(picked, 0) + 1
            self._book(picked, _request_hashes(pending_request))
        return [[by_id[rid]] for rid in decision.ranked]

    def _book(self, rid: str, hashes: tuple[int, ...]) -> None:
        # Until the engine's next digest, what we just sent counts as cached there.
        if hashes:
            self._index.on_routed(rid, hashes, time.monotonic())

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._book(_rid(replica_id), _request_hashes(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.remove_replica(_rid(replica_id))


def _rekey(digest: CacheDigest, replica_id: str) -> CacheDigest:
    """Digests are keyed by the router's replica id (the engine may name itself differently)."""
    return CacheDigest(replica_id, digest.epoch, digest.sequence, digest.blocks, digest.all_cleared,
                       digest.timestamp_s)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Baseline: each request to the next replica in turn (load-blind, cache-blind)."""

    def initialize_state(self, **_: Any) -> None:
        self._counter = itertools.count()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: _rid(r.replica_id))
        start = next(self._counter) % len(ordered)
        return [[r] for r in ordered[start:] + ordered[:start]]
