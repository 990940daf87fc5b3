"""Ray Serve request routers for the engine deployment: prefix_aware and round_robin.

A `RequestRouter` runs inside the caller's process (each ingress replica has its own),
so routing never makes a remote call: the replicas' load and cache digests arrive with
Ray Serve's routing stats (`record_routing_stats`, pushed to every router), and the
router's in-flight counts come from Ray's local queue-length cache.

    update_replicas(replicas)          Ray calls it on the router's event loop whenever the
                                       replica list or a replica's routing stats change
      sync      routing stats → FleetView: new digests → PrefixIndex, load numbers cached
    choose_replicas(candidates, request)
      observe   FleetView.snapshots: one ReplicaSnapshot per candidate (no decoding here)
      decide    deployments.routing.policy.rank_replicas (pure), via RouterState
      apply     return one rank per replica, best first; on_request_routed → RouterState.on_routed
                (routing history, the prefix group's demand, the session's last replica)

Digests are applied when they arrive, not by the first decision after them: a report's
deltas are cheap, but a full set (after a gap) is costly to decode, and applied lazily it
would land on one request per replica per period. They are applied in slices of
`DIGEST_SLICE_BLOCKS` blocks, one slice per event-loop turn (`loop.call_soon`), so a
decision that arrives during a push waits for one slice, not for the whole push. Both run
on the same event loop, so the index is never read mid-slice.

Pick-only calls (direct mode's routing peer asks `choose_replica(RoutingKey, _reserve=False)`)
never reach `on_request_routed`, and Ray's queue-length cache stays empty for them, so the
router books such a pick itself: the router state gets the request's blocks and session, and
the replica's load counts the picks made since its last stats report, each with the prompt
tokens it must prefill there (the report's numbers include them from then on).

A request's session key (multi-turn affinity) is its `session_key` attribute when it has
one (`RoutingKey.session_key`; None or absent: no session).

Index trust (`deployments.routing.trust`): each decision writes its prediction (the replica
ranked first, the cached tokens counted there) into the request's `decision` slot, the
RoutingKey or GenerateRequest object Ray hands over as `pending_request.args[0]`; whoever
learns the engine's real cached count (the OpenAI frontend) compares the two. The router
also reports how old the newest digest it holds per replica is
(`kvtide_router_digest_age_seconds`), at most every `DIGEST_AGE_RECORD_INTERVAL_S`, when
stats arrive or a decision is made. Ray's metrics API cannot delete a series: a replica
that left is simply no longer set, and Ray's metrics agent drops a gauge not set for two
export intervals (~20 s by default).

Agreement (`deployments.routing.agreement`): one in `AGREEMENT_SAMPLE_EVERY` decisions with
a full block and two candidates or more is ranked again from shared state alone (engine
truth, the same snapshots, no routing history, session memory or group demand) and counted
by whether its first choice is the same (`kvtide_router_agreement_checks`): a pick moved by
this router's private memory is one a router on another node would not make. The check runs
after the decision's latency is taken: that histogram stays the policy's own cost.

KV tiers: of a decision's matched tokens on its first choice, those the router expects that
replica to load from its CPU KV tier (`RoutingDecision.cpu_matched_tokens`) are counted apart
from the GPU-cached ones (`kvtide_router_matched_tokens{tier}`); both tiers' series exist from
the router's start, at zero until a match (a fleet without a CPU tier keeps cpu at zero).

The policy lives in `deployments.routing.policy`, its tunables in `kvtide.config.RoutingConfig`;
this module only adapts.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.util import metrics

from kvtide.config import RoutingConfig
from kvtide.deployments.messages import RoutingKey
from kvtide.deployments.routing.agreement import Agreement, AgreementSampler
from kvtide.deployments.routing.fleet import DIGEST_SLICE_BLOCKS, FleetView
from kvtide.deployments.routing.policy import RouterState, route_of
from kvtide.deployments.routing.stages import filters, post_response

DECISION_LATENCY_BUCKETS_S = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2]
MATCHED_TOKENS_BUCKETS = [1, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768]
# Digest ages are set at most this often: stats pushes (one per replica per period) and
# decisions can come thousands of times a second, and each pass sets one gauge per replica.
# Half a second stays well inside the metrics agent's gauge TTL (two export intervals, at
# least 2 s), so a live replica's series never lapses between two sets.
DIGEST_AGE_RECORD_INTERVAL_S = 0.5
MATCH_TIERS = ("gpu", "cpu")  # the matched-tokens counter's `tier` values


def counter_at_zero(counter: metrics.Counter, tags: dict[str, str]) -> None:
    """Create `counter`'s series for `tags` at 0, so that it is scraped (and rated) before its first increment.

    Ray's public `inc` refuses 0, so this records through `Metric._record`, the call `inc`
    itself makes once it has checked the value; a unit test pins that Ray's Counter has it.
    """
    counter._record(0, tags=tags)


def matched_tokens_by_tier(matched_tokens: int, cpu_matched_tokens: int) -> dict[str, int]:
    """A decision's matched tokens split by the tier they are expected to come from (tiers with none left out:
    Ray's counters take positive increments only)."""
    cpu = max(0, min(cpu_matched_tokens, matched_tokens))
    return {tier: tokens for tier, tokens in (("gpu", matched_tokens - cpu), ("cpu", cpu)) if tokens > 0}


class RouterMetrics:
    """Routing decisions by policy and outcome, matched-prefix tokens (per decision, and by tier), decision latency,
    sampled agreement."""

    def __init__(self, policy: str = "prefix_aware") -> None:
        self.decisions = metrics.Counter(
            "kvtide_router_decisions", "Routing decisions by policy, outcome (cache_hit, load_fallback, no_match) "
            "and route (session: the session's last replica; replicated: a hot prefix spread over k >= 2; single).",
            tag_keys=("policy", "outcome", "route"))
        self.matched_tokens = metrics.Histogram(
            "kvtide_router_matched_prefix_tokens", "Cached prefix tokens on the chosen replica, per decision.",
            boundaries=MATCHED_TOKENS_BUCKETS, tag_keys=("policy",))
        self.matched_tokens_by_tier = metrics.Counter(
            "kvtide_router_matched_tokens", "Matched prefix tokens on the chosen replica, by the tier they are "
            "expected to come from: gpu (its prefix cache) or cpu (loaded from its CPU KV tier).",
            tag_keys=("policy", "tier"))
        for tier in MATCH_TIERS:
            counter_at_zero(self.matched_tokens_by_tier, {"policy": policy, "tier": tier})
        self.decision_s = metrics.Histogram(
            "kvtide_router_decision_latency_seconds", "Time to rank replicas for one request.",
            boundaries=DECISION_LATENCY_BUCKETS_S, tag_keys=("policy",))
        self.digest_age_s = metrics.Gauge(
            "kvtide_router_digest_age_seconds", "Age of the newest cache digest this router holds, per engine "
            "replica (router's wall clock minus the engine's stamp).", tag_keys=("replica",))
        self.agreement_checks = metrics.Counter(
            "kvtide_router_agreement_checks", "Sampled decisions ranked again from shared state alone (engine "
            "digests, the same snapshots; no routing history, session memory or replication demand), by whether "
            "the first choice agrees (true, false) and, if not, the private input that moved it (reason: session, "
            "history, replication, other; none when it agrees).", tag_keys=("policy", "agrees", "reason"))


def agreement_tags(agreement: Agreement) -> dict[str, str]:
    """The agreement counter's `agrees` and `reason` tags (Ray requires every tag key: "none" when it agrees)."""
    if agreement.agrees:
        return {"agrees": "true", "reason": "none"}
    return {"agrees": "false", "reason": agreement.reason or "other"}


def _request_hashes(pending_request: Optional[PendingRequest]) -> tuple[int, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return tuple(getattr(pending_request.args[0], "block_hashes", ()) or ())


def _session_key(pending_request: Optional[PendingRequest]) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "session_key", None) or None


def _decision_slot(pending_request: Optional[PendingRequest]) -> dict | None:
    """The request's `decision` slot (RoutingKey / GenerateRequest), if it carries one."""
    if pending_request is None or not pending_request.args:
        return None
    slot = getattr(pending_request.args[0], "decision", None)
    return slot if isinstance(slot, dict) else None


def is_pick_only(pending_request: Optional[PendingRequest]) -> bool:
    return pending_request is not None and bool(pending_request.args) and isinstance(pending_request.args[0],
                                                                                       RoutingKey)


def _replica_id(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


def routable(candidates: List[RunningReplica]) -> List[RunningReplica]:
    """The candidates that take requests (stages.filters.serving): a standby says so in its routing stats."""
    return filters.serving(candidates, _is_standby)


def _is_standby(replica: RunningReplica) -> bool:
    return bool((replica.routing_stats or {}).get("standby"))


def _pinned_replica(pending_request: Optional[PendingRequest]) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "pinned_replica", None) or None


def pinned_rank(candidates: List[RunningReplica],
                pending_request: Optional[PendingRequest]) -> List[List[RunningReplica]] | None:
    """Every router's first step (stages.filters.pinned): a request pinned to a replica (the one holding the
    stored response it names, routing.response_pins) goes there alone while that replica serves; None: the
    policy routes it."""
    replica = filters.pinned(candidates, _pinned_replica(pending_request), lambda r: _replica_id(r.replica_id),
                             _is_standby)
    return None if replica is None else [[replica]]


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """kvtide's router: cache affinity from the engines' own KV events, under a load guard."""

    def initialize_state(self, block_size: int = 16, seed: int | None = None,
                         routing: dict[str, Any] | None = None) -> None:
        # Ray hands request_router_kwargs over as plain data; validate it back into the one model.
        self._state = RouterState(RoutingConfig.model_validate(routing or {}), block_size)
        self._fleet = FleetView(self._state, slice_blocks=DIGEST_SLICE_BLOCKS)
        self._slices_scheduled = False
        self._rng = random.Random(seed)
        self._metrics = RouterMetrics()
        self._agreement = AgreementSampler()
        self._digest_ages_set_s = float("-inf")  # monotonic time of the last digest-age pass

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        # Ray's hook for a new replica list or new routing stats: apply them now, so that
        # choose_replicas only reads (same event loop, so never concurrently with it).
        super().update_replicas(replicas)
        self._fleet.sync({_replica_id(r.replica_id): r.routing_stats or {} for r in replicas})
        self._schedule_digest_slices()
        if not self._slices_scheduled:  # else once the last slice is applied
            self._record_digest_ages(time.monotonic())

    def _schedule_digest_slices(self) -> None:
        if self._slices_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not called on a loop: nothing to interleave with
            self._fleet.apply_digests()
            return
        self._slices_scheduled = True
        loop.call_soon(self._apply_digest_slice, loop)

    def _apply_digest_slice(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._fleet.apply_digests(DIGEST_SLICE_BLOCKS):
            loop.call_soon(self._apply_digest_slice, loop)  # the next slice after what is ready now
        else:
            self._slices_scheduled = False
            self._record_digest_ages(time.monotonic())

    def _record_digest_ages(self, now_s: float) -> None:
        """Set each replica's digest age, at most every DIGEST_AGE_RECORD_INTERVAL_S (monotonic `now_s`)."""
        if now_s - self._digest_ages_set_s < DIGEST_AGE_RECORD_INTERVAL_S:
            return
        self._digest_ages_set_s = now_s
        for replica_id, age_s in self._fleet.digest_ages_s(time.time()).items():
            self._metrics.digest_age_s.set(age_s, {"replica": replica_id})

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if (pinned := pinned_rank(candidate_replicas, pending_request)) is not None:
            return pinned
        started_ns = time.perf_counter_ns()
        now_s = time.monotonic()
        candidate_replicas = routable(candidate_replicas)
        queue_lens = self.replica_queue_len_cache
        snapshots = self._fleet.snapshots((_replica_id(r.replica_id), queue_lens.get(r.replica_id))
                                          for r in candidate_replicas)
        hashes, session_key = _request_hashes(pending_request), _session_key(pending_request)
        decision = self._state.rank(hashes, snapshots, self._rng, now_s=now_s, session_key=session_key)
        by_id = {_replica_id(r.replica_id): r for r in candidate_replicas}
        tags = {"policy": "prefix_aware"}
        self._metrics.decision_s.observe((time.perf_counter_ns() - started_ns) / 1e9, tags)
        self._metrics.decisions.inc(1, {**tags, "outcome": decision.outcome, "route": route_of(decision)})
        self._metrics.matched_tokens.observe(decision.matched_tokens, tags)
        for tier, tokens in matched_tokens_by_tier(decision.matched_tokens,
                                                   decision.cpu_matched_tokens).items():
            self._metrics.matched_tokens_by_tier.inc(tokens, {**tags, "tier": tier})
        agreement = self._agreement.check(self._state, decision, hashes, snapshots, now_s=now_s,
                                          session_key=session_key)
        if agreement is not None:
            self._metrics.agreement_checks.inc(1, {**tags, **agreement_tags(agreement)})
        post_response.record_prediction(_decision_slot(pending_request), decision.ranked, decision.matched_tokens,
                                        decision.exclusive_tokens)
        self._record_digest_ages(now_s)
        if decision.ranked and is_pick_only(pending_request):
            # Ray takes the first replica of a pick-only ranking and tells the router nothing more.
            picked = decision.ranked[0]
            self._fleet.book_pick(picked, len(hashes) * self._state.block_size - decision.matched_tokens)
            self._state.on_routed(picked, hashes, now_s, session_key)
        return [[by_id[replica_id]] for replica_id in decision.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        # Until the engine's next digest, what we just sent counts as cached there.
        self._state.on_routed(_replica_id(replica_id), _request_hashes(pending_request), time.monotonic(),
                              _session_key(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._fleet.forget(_replica_id(replica_id))


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Baseline: each request to the next replica in turn (load-blind, cache-blind)."""

    def initialize_state(self, **_: Any) -> None:
        self._counter = itertools.count()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if (pinned := pinned_rank(candidate_replicas, pending_request)) is not None:
            return pinned
        if not candidate_replicas:
            return []
        ordered = sorted(routable(candidate_replicas), key=lambda r: _replica_id(r.replica_id))
        start = next(self._counter) % len(ordered)
        return [[r] for r in ordered[start:] + ordered[:start]]
