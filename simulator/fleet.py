"""A fleet of simulated engines behind kvtide's own router code, in simulated time.

The loop is discrete-event: request arrivals (from a trace), engine step ends, and report ticks.
No wall clock is read for any decision: every component takes the simulated time `now_s`.

    arrival      the policy picks a replica, the request joins that engine's waiting queue; an
                 idle engine starts a step at once
    step end     the step's results land: first tokens and finished requests are recorded, the
                 blocks it stored and evicted go to the replica's DigestJournal (the engine
                 side of kvtide's digest protocol), and the engine steps again while it has work
    report tick  every `stats_period_s`, each replica builds the stats an engine replica returns
                 from record_routing_stats (load, pending prefill, drain rate, recent request
                 durations, a CacheDigest); the router receives them `report_delay_s` later

What decides is kvtide's code, unmodified (tests/unit/test_sim_fleet.py pins that no copy exists):
prefix_aware goes through `deployments.routing.fleet.FleetView` and `policy.RouterState` in the
order the pick-only router (`deployments.routing.ray_router.PrefixAwareRouter`) calls them; pow2
is Ray's power of two choices as kvtide's baseline completes it for pick-only calls (two replicas
sampled, the shorter queue by `pick_load.PickOnlyLoad`, ties at random); round_robin is load- and
cache-blind; ray_kv is Ray Serve LLM's KV-aware router as its documentation describes it (`RayKv`).
The engine model (`simulator.engine`) stands in for vLLM.

With an autoscaler (`simulator.autoscale`) the fleet changes size: replicas start, serve, go to
standby (drain, then sleep with their KV freed), wake and stop as kvtide's autoscaling policy tick
decides; only the running replicas its roles make active are routed to.

Block names: a trace's hash id stands for one block of `block_tokens` tokens *and* its whole
prefix (Mooncake's convention), so the engine blocks inside it are named by (hash id, position):
equal names mean equal prefixes, as kvtide's chained hashes do.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol, Sequence

from kvtide.config.routing import RoutingConfig
from kvtide.deployments.routing.digest_journal import DigestJournal
from kvtide.deployments.routing.fleet import FleetView
from kvtide.deployments.routing.pick_load import PickOnlyLoad, RecentDurations
from kvtide.deployments.routing.policy import RouterState
from kvtide.simulator.engine import EngineLimits, EngineModel, SimRequest, StepProfile, StepResult

POLICIES = ("prefix_aware", "pow2", "round_robin", "ray_kv")
# Engine blocks inside one trace block are numbered in the low bits of their name.
_POSITION_BITS = 12


def block_name(hash_id: int, position: int) -> int:
    """The name (a uint64, as kvtide's block hashes are) of engine block `position` of trace block `hash_id`."""
    if not 0 <= position < 1 << _POSITION_BITS:
        raise ValueError(f"block position {position} outside 0..{(1 << _POSITION_BITS) - 1}")
    return ((hash_id << _POSITION_BITS) | position) & 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class TraceItem:
    """One request of a trace, as the simulator reads it (Mooncake's fields; timestamps in ms)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def sim_requests(items: Sequence[TraceItem], block_tokens: int, block_size: int) -> list[SimRequest]:
    """The trace's requests for the engine model: each hash id is `block_tokens // block_size` engine blocks.

    `block_tokens` must be a multiple of the engine's `block_size`; a prompt longer than its hash ids
    cover gets no names for the rest (it never hits there), one shorter keeps only the blocks it fills.
    """
    if block_tokens % block_size:
        raise ValueError(f"block_tokens ({block_tokens}) must be a multiple of the engine block size ({block_size})")
    per_id = block_tokens // block_size
    out = []
    for i, item in enumerate(items):
        names = [block_name(h, j) for h in item.hash_ids for j in range(per_id)]
        out.append(SimRequest(request_id=str(i), arrival_s=item.timestamp_ms / 1000.0,
                              block_hashes=tuple(names[:item.input_length // block_size]),
                              prompt_tokens=item.input_length, output_tokens=max(1, item.output_length)))
    return out


@dataclass(frozen=True)
class SimConfig:
    """One simulated fleet: its size, each engine's limits and step profile, and how reports travel."""

    num_replicas: int
    limits: EngineLimits
    profile: StepProfile
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    report_delay_s: float = 0.0  # report tick → the router applies it (Ray's push; the long poll)
    seed: int = 0
    # Engines sharing one GPU (gpus_per_worker 1/k): a step that starts while m others on its GPU are mid-step
    # lasts (m + 1) × its profile time. Separate processes on one GPU time-slice it (no MPS), so concurrent
    # steps serialize; the share is fixed when the step starts (a simplification).
    engines_per_gpu: int = 1
    # Whether replicas report their CPU tier to the router (the digest's `cpu` part and the onload rate), as
    # kvtide's do. False plays a tier-blind router over the same tiers: offloading on, routing on GPU blocks alone.
    router_sees_cpu_tier: bool = True

    @property
    def stats_period_s(self) -> float:
        return self.routing.stats_period_s


class Policy(Protocol):
    name: str

    def on_report(self, stats_by_replica: Mapping[str, Mapping[str, Any]], now_s: float) -> None: ...

    def pick(self, request: SimRequest, replica_ids: Sequence[str], now_s: float) -> str: ...


class PrefixAware:
    """kvtide's router, called as the pick-only router calls it (ray_router.PrefixAwareRouter.choose_replicas)."""

    name = "prefix_aware"

    def __init__(self, routing: RoutingConfig, block_size: int, rng: random.Random):
        self.state = RouterState(routing, block_size)
        self.fleet = FleetView(self.state)  # digests applied at once: the simulated router has no loop to share
        self.rng = rng

    def on_report(self, stats_by_replica: Mapping[str, Mapping[str, Any]], now_s: float) -> None:
        self.fleet.sync(stats_by_replica, now_s)

    def pick(self, request: SimRequest, replica_ids: Sequence[str], now_s: float) -> str:
        hashes = request.block_hashes
        snapshots = self.fleet.snapshots(((rid, None) for rid in replica_ids), now_s)
        decision = self.state.rank(hashes, snapshots, self.rng, now_s=now_s)
        picked = decision.ranked[0]
        self.fleet.book_pick(picked, len(hashes) * self.state.block_size - decision.matched_tokens, now_s)
        self.state.on_routed(picked, hashes, now_s)
        return picked


class Pow2:
    """Power of two choices as kvtide's pow2 baseline completes Ray's for pick-only calls
    (ray_baselines.PickOnlyShortestQueue): two replicas sampled, the shorter queue wins, ties at random."""

    name = "pow2"

    def __init__(self, rng: random.Random):
        self.load = PickOnlyLoad()
        self.rng = rng

    def on_report(self, stats_by_replica: Mapping[str, Mapping[str, Any]], now_s: float) -> None:
        self.load.sync(stats_by_replica)

    def pick(self, request: SimRequest, replica_ids: Sequence[str], now_s: float) -> str:
        rank = self.rng.sample(list(replica_ids), min(2, len(replica_ids)))
        best = min(rank, key=lambda rid: (self.load.queued(rid), self.rng.random()))
        self.load.book(best)
        return best


class RoundRobin:
    """Each request to the next replica in turn (bare vLLM behind a round-robin balancer)."""

    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def on_report(self, stats_by_replica: Mapping[str, Mapping[str, Any]], now_s: float) -> None:
        pass

    def pick(self, request: SimRequest, replica_ids: Sequence[str], now_s: float) -> str:
        picked = replica_ids[self.next % len(replica_ids)]
        self.next += 1
        return picked


class RayKv:
    """Ray Serve LLM's KV-aware router as its documentation describes it (user guide "KV-aware routing", Ray 2.60;
    the cost Dynamo's KV router uses): a global view of each replica's cached blocks built from vLLM's KV events,
    and per replica a *token load* = the request's remaining prefill there (prompt tokens less the cached prefix
    it would reuse) + the replica's active prefill (routed requests not yet past their first token) + its active
    decode work (the context of routed requests past their first token, until they finish); the lowest load
    wins (temperature 0), ties at random. The events reach the router as the step that caused them ends (Ray's
    event stream is not batched per stats period); its load is the router's own bookkeeping of what it routed.
    """

    name = "ray_kv"

    def __init__(self, block_size: int, rng: random.Random):
        self.block_size = block_size
        self.rng = rng
        self.held: dict[str, set[int]] = {}
        self.active_prefill: dict[str, int] = {}
        self.active_decode: dict[str, int] = {}
        self.routed: dict[str, tuple[str, int]] = {}  # request id → (replica, prefill tokens it was charged)

    def on_report(self, stats_by_replica: Mapping[str, Mapping[str, Any]], now_s: float) -> None:
        pass

    def on_kv_events(self, replica_id: str, stored: Sequence[int], removed: Sequence[int]) -> None:
        held = self.held.setdefault(replica_id, set())
        held.update(stored)
        held.difference_update(removed)

    def on_first_token(self, request: SimRequest) -> None:
        replica_id, charged = self.routed[request.request_id]
        self.active_prefill[replica_id] -= charged
        self.active_decode[replica_id] = self.active_decode.get(replica_id, 0) + request.prompt_tokens

    def on_finished(self, request: SimRequest) -> None:
        replica_id, _ = self.routed.pop(request.request_id)
        self.active_decode[replica_id] -= request.prompt_tokens

    def pick(self, request: SimRequest, replica_ids: Sequence[str], now_s: float) -> str:
        best: tuple[float, float, str] | None = None
        for rid in replica_ids:
            held = self.held.get(rid, ())
            overlap = 0
            for name in request.block_hashes:
                if name not in held:
                    break
                overlap += 1
            new = request.prompt_tokens - overlap * self.block_size
            load = new + self.active_prefill.get(rid, 0) + self.active_decode.get(rid, 0)
            key = (load, self.rng.random(), rid)
            if best is None or key < best:
                best = key
                charged = new
        assert best is not None
        picked = best[2]
        self.active_prefill[picked] = self.active_prefill.get(picked, 0) + charged
        self.routed[request.request_id] = (picked, charged)
        return picked


def make_policy(name: str, config: SimConfig, rng: random.Random) -> Policy:
    if name == "prefix_aware":
        return PrefixAware(config.routing, config.limits.block_size, rng)
    if name == "pow2":
        return Pow2(rng)
    if name == "round_robin":
        return RoundRobin()
    if name == "ray_kv":
        return RayKv(config.limits.block_size, rng)
    raise ValueError(f"policy {name!r}: choose one of {', '.join(POLICIES)}")


class SimReplica:
    """One engine and what its replica reports: the block set in kvtide names, its journal, recent durations."""

    def __init__(self, replica_id: str, config: SimConfig, index: int = 0):
        self.replica_id = replica_id
        self.index = index
        self.engine = EngineModel(config.limits, config.profile)
        self.journal = DigestJournal(replica_id, epoch=1)
        self.held: set[int] = set()
        # The CPU tier's block set and journal, reported in the digest's `cpu` part (as KvCacheTracker does).
        self.cpu_journal = DigestJournal(replica_id, epoch=1) if config.limits.cpu_tier_blocks else None
        self.reports_cpu_tier = config.router_sees_cpu_tier
        self.cpu_held: set[int] = set()
        self.durations = RecentDurations()
        self.stepping = False  # a step is in flight (its end is on the event queue)
        self.prefill_tokens_since_report = 0
        self.last_report_s = 0.0
        # Lifecycle (autoscaled fleets): starting → running ⇄ (draining → asleep → waking → running);
        # stopping → gone. Only a running replica the roles make active takes traffic.
        self.state = "running"
        self.hit_tokens_total = 0
        self.exclusive_hit_tokens_total = 0
        self.started_s = 0.0
        self.serial = index  # creation order (FleetSim sets it)

    def forget_cache(self) -> None:
        """Sleep level 1 frees the engine's KV: an empty cache, a fresh digest epoch (FleetSim._cache_gone first
        takes its blocks out of the fleet's views)."""
        self.held.clear()
        self.cpu_held.clear()
        self.engine = EngineModel(self.engine.limits, self.engine.profile)
        self.journal = DigestJournal(self.replica_id, epoch=self.journal.epoch + 1)
        if self.cpu_journal is not None:
            self.cpu_journal = DigestJournal(self.replica_id, epoch=self.journal.epoch)

    def land(self, result: StepResult, holders: dict[int, int] | None = None) -> None:
        """A step's cache changes, as the engine's KV events would tell the tracker; `holders` (block name →
        replicas holding it) kept with them where the autoscaler needs exclusive hits."""
        stored, removed = _journal_changes(self.held, self.journal, result.stored, result.removed)
        if holders is not None:
            for name in stored:
                holders[name] = holders.get(name, 0) + 1
            for name in removed:
                _drop_holder(holders, name)
        if self.cpu_journal is not None:
            _journal_changes(self.cpu_held, self.cpu_journal, result.cpu_stored, result.cpu_removed)
        self.prefill_tokens_since_report += result.prefill_tokens
        for request in result.finished:
            self.durations.observe(request.finished_s - request.arrival_s)

    def stats(self, now_s: float) -> dict[str, Any]:
        """What record_routing_stats returns (deployments.engine.replica), from the model's numbers."""
        engine = self.engine
        elapsed_s = now_s - self.last_report_s
        rate = self.prefill_tokens_since_report / elapsed_s if elapsed_s > 0 else 0.0
        self.prefill_tokens_since_report, self.last_report_s = 0, now_s
        digest = self.journal.digest(self.held, now_s)
        onload_tokens_per_s = 0.0
        if self.cpu_journal is not None and self.reports_cpu_tier:
            digest = replace(digest, cpu=self.cpu_journal.digest(self.cpu_held, now_s))
            per_token_s = engine.limits.cpu_onload_s_per_token
            onload_tokens_per_s = 1.0 / per_token_s if per_token_s > 0 else 0.0
        return {"reported_s": now_s, "num_running": engine.num_running, "num_waiting": engine.num_waiting,
                "kv_usage_perc": engine.kv_usage, "pending_prefill_tokens": engine.pending_prefill_tokens,
                "prefill_tokens_per_s": rate, "onload_tokens_per_s": onload_tokens_per_s,
                "request_durations_s": self.durations.quantiles(), "digest": digest}


def _journal_changes(held: set[int], journal: DigestJournal, stored: Sequence[int],
                     removed: Sequence[int]) -> tuple[list[int], list[int]]:
    """Apply a step's stored and removed block names to a block set and its journal (as KvCacheTracker does from
    KV events); the names that really entered and left it."""
    entered, left = [], []
    for name in stored:
        if name not in held:
            held.add(name)
            journal.stored(name)
            entered.append(name)
    for name in removed:
        if name in held:
            held.discard(name)
            journal.removed(name)
            left.append(name)
    return entered, left


def _drop_holder(holders: dict[int, int], name: int) -> None:
    count = holders.get(name, 0) - 1
    if count > 0:
        holders[name] = count
    else:
        holders.pop(name, None)


@dataclass
class SimResult:
    """Per-request outcomes, per-replica samples at each report tick, and the router's own wall time."""

    policy: str
    requests: list[SimRequest]
    replica_of: dict[str, str]
    samples: list[tuple[float, str, int, int, float]]  # (t, replica, running, waiting, kv usage)
    prefix_queries_tokens: int
    prefix_hits_tokens: int  # GPU prefix-cache hits
    num_preemptions: int
    decision_wall_s: list[float]
    end_s: float
    cpu_hits_tokens: int = 0  # tokens loaded from the engines' CPU tiers
    # Autoscaled fleets: (t, replicas taking traffic, standby, starting) at each tick, and what the
    # autoscaler did: (t, verb, replica id) with verb one of started, serving, demoted, woken, stopping, stopped.
    replica_counts: list[tuple[float, int, int, int]] = field(default_factory=list)
    scaling_events: list[tuple[float, str, str]] = field(default_factory=list)


# Event kinds, in the order they apply at one instant: a step's results land and a replica becomes
# ready before a report is taken, and all of them before the autoscaler ticks and an arrival is routed.
_STEP_END, _READY, _REPORT_TICK, _REPORT_ARRIVES, _AUTOSCALE_TICK, _ARRIVAL = range(6)


class FleetSim:
    """N engine replicas behind one policy, driven by `requests` (arrival_s set, any order).

    With `autoscaler` (a simulator.autoscale.Autoscaler) the fleet starts at its initial size and kvtide's
    autoscaler sizes it; without, `config.num_replicas` serve throughout.
    """

    def __init__(self, config: SimConfig, policy: str, autoscaler: Any = None):
        self.config = config
        self.rng = random.Random(config.seed)
        self.policy = make_policy(policy, config, self.rng)
        # Policies that learn from KV events and request progress as they happen (ray_kv) say so by these hooks.
        self._events_hook = getattr(self.policy, "on_kv_events", None)
        self._first_token_hook = getattr(self.policy, "on_first_token", None)
        self._finished_hook = getattr(self.policy, "on_finished", None)
        self.replicas: dict[str, SimReplica] = {}
        self._made = 0
        self.holders: dict[int, int] | None = None
        self.autoscaler = autoscaler
        self.roles_active: tuple[str, ...] | None = None  # None: no roles, every running replica is active
        if autoscaler is not None:
            self.holders = {}
        for _ in range(autoscaler.config.initial_replicas if autoscaler is not None else config.num_replicas):
            self._new_replica("running", 0.0)
        self.routable = list(self.replicas)
        self._events: list[tuple[float, int, int, Any]] = []
        self._order = 0
        self._exclusive_predicted: dict[str, int] = {}
        self.scaling_events: list[tuple[float, str, str]] = []

    def _push(self, at_s: float, kind: int, payload: Any) -> None:
        self._order += 1
        heapq.heappush(self._events, (at_s, kind, self._order, payload))

    def _new_replica(self, state: str, now_s: float) -> SimReplica:
        """A replica on the lowest free GPU slot (engines_per_gpu replicas share one)."""
        taken = {r.index for r in self.replicas.values()}
        index = next(i for i in range(len(taken) + 1) if i not in taken)
        replica = SimReplica(f"replica-{self._made}", self.config, index)
        replica.serial = self._made
        self._made += 1
        replica.state, replica.started_s = state, now_s
        self.replicas[replica.replica_id] = replica
        return replica

    def _slowdown(self, replica: SimReplica) -> float:
        k = self.config.engines_per_gpu
        if k <= 1:
            return 1.0
        gpu = replica.index // k
        return 1.0 + sum(1 for other in self.replicas.values()
                         if other is not replica and other.index // k == gpu and other.stepping)

    def _step(self, replica: SimReplica, now_s: float) -> None:
        slowdown = self._slowdown(replica)
        result = replica.engine.step(now_s, slowdown)
        while result.duration_s <= 0.0 and result.preempted and replica.engine.has_work():
            # The only running request preempted itself: the next step re-admits it (engine.py, 1 and 5).
            self._land(replica, result)
            result = replica.engine.step(now_s, slowdown)
        if result.duration_s <= 0.0:  # nothing schedulable: an arrival restarts it
            replica.stepping = False
            self._land(replica, result)
            self._idle(replica, now_s)
            return
        replica.stepping = True
        self._push(now_s + result.duration_s, _STEP_END, (replica, result))

    def _land(self, replica: SimReplica, result: StepResult) -> None:
        replica.land(result, self.holders)
        if self._events_hook is not None and (result.stored or result.removed):
            self._events_hook(replica.replica_id, result.stored, result.removed)
        if self._first_token_hook is not None:
            for request in result.first_tokens:
                self._first_token_hook(request)
            for request in result.finished:
                self._finished_hook(request)
        if self.holders is not None:
            for request in result.first_tokens:
                replica.hit_tokens_total += request.cached_tokens
                predicted = self._exclusive_predicted.pop(request.request_id, 0)
                replica.exclusive_hit_tokens_total += min(predicted, request.cached_tokens)

    def _idle(self, replica: SimReplica, now_s: float) -> None:
        """A replica out of routing whose engine has drained: it sleeps or stops."""
        if replica.engine.has_work():
            return
        if replica.state == "draining":
            replica.state = "asleep"
            self._cache_gone(replica)
            replica.forget_cache()
        elif replica.state == "stopping":
            del self.replicas[replica.replica_id]
            self._cache_gone(replica)
            self.scaling_events.append((now_s, "stopped", replica.replica_id))

    def _cache_gone(self, replica: SimReplica) -> None:
        """Every block `replica` holds leaves the fleet's views: the KV-event hook's (ray_kv) and the holder counts."""
        if self._events_hook is not None:
            self._events_hook(replica.replica_id, [], list(replica.held))
        if self.holders is not None:
            for name in replica.held:
                _drop_holder(self.holders, name)

    def _predict_exclusive(self, request: SimRequest, replica: SimReplica) -> None:
        """The prompt tokens the picked replica holds that no other replica holds (routing.trust's prediction)."""
        if self.holders is None:
            return
        tokens = 0
        for name in request.block_hashes:
            if name not in replica.held:
                break
            if self.holders.get(name, 0) == 1:
                tokens += self.config.limits.block_size
        self._exclusive_predicted[request.request_id] = tokens

    def _refresh_routable(self) -> None:
        running = [rid for rid, r in self.replicas.items() if r.state == "running"]
        if self.roles_active is None:
            self.routable = running
        else:
            active = set(self.roles_active)
            self.routable = [rid for rid in running if rid in active]

    def _autoscale(self, now_s: float) -> None:
        """One controller tick: sample, the policy's tick, then apply its roles and Serve's target."""
        scaler = self.autoscaler
        if now_s >= scaler.next_sample_s:
            scaler.next_sample_s = now_s + scaler.config.sample_period_s
            scaler.sample(now_s, {
                rid: {"kv_usage": r.engine.kv_usage, "num_waiting": r.engine.num_waiting,
                      "num_running": r.engine.num_running, "num_preemptions_total": r.engine.num_preemptions,
                      "hit_tokens_total": r.hit_tokens_total, "exclusive_hit_tokens_total": r.exclusive_hit_tokens_total}
                for rid, r in self.replicas.items() if r.state not in ("starting", "stopping")})
        serving = [rid for rid, r in self.replicas.items() if r.state not in ("starting", "stopping")]
        tick = scaler.tick(now_s, serving)
        if tick.plan is not None:
            for rid in tick.plan.demoted:
                replica = self.replicas[rid]
                replica.state = "draining"
                self.scaling_events.append((now_s, "demoted", rid))
                if not replica.stepping:
                    self._idle(replica, now_s)
            for rid in tick.plan.woken:
                replica = self.replicas[rid]
                replica.state = "waking"
                self.scaling_events.append((now_s, "woken", rid))
                self._push(now_s + scaler.config.wake_s, _READY, replica)
            for rid in tick.plan.retired:
                self._stop(self.replicas[rid], now_s)
            for rid in tick.plan.roles.standby:  # a new replica joining the pool sleeps as a demoted one does
                replica = self.replicas[rid]
                if replica.state == "running":
                    replica.state = "draining"
                    if not replica.stepping:
                        self._idle(replica, now_s)
            self.roles_active = tuple(tick.plan.roles.active)
        live = [r for r in self.replicas.values() if r.state != "stopping"]
        for _ in range(scaler.target - len(live)):
            replica = self._new_replica("starting", now_s)
            self.scaling_events.append((now_s, "started", replica.replica_id))
            self._push(now_s + scaler.config.cold_start_s, _READY, replica)
        if len(live) > scaler.target:
            # Ray's choice: replicas still starting first, then the newest.
            order = sorted(live, key=lambda r: (r.state != "starting", -r.started_s, -r.serial))
            for replica in order[:len(live) - scaler.target]:
                self._stop(replica, now_s)
        self._refresh_routable()

    def _stop(self, replica: SimReplica, now_s: float) -> None:
        replica.state = "stopping"
        self.scaling_events.append((now_s, "stopping", replica.replica_id))
        if not replica.stepping:
            self._idle(replica, now_s)

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        for request in requests:
            self._push(request.arrival_s, _ARRIVAL, request)
        last_arrival_s = max((r.arrival_s for r in requests), default=0.0)
        period_s = self.config.stats_period_s
        self._push(period_s, _REPORT_TICK, None)
        if self.autoscaler is not None:
            self._push(0.0, _AUTOSCALE_TICK, None)
        replica_of: dict[str, str] = {}
        samples: list[tuple[float, str, int, int, float]] = []
        counts: list[tuple[float, int, int, int]] = []
        decision_wall_s: list[float] = []
        engines_seen: dict[int, EngineModel] = {}  # every engine that served: a slept one is replaced
        now_s = 0.0

        def busy() -> bool:
            return now_s < last_arrival_s or any(r.engine.has_work() for r in self.replicas.values())

        while self._events:
            now_s, kind, _, payload = heapq.heappop(self._events)
            if kind == _STEP_END:
                replica, result = payload
                self._land(replica, result)
                if replica.engine.has_work():
                    self._step(replica, now_s)
                else:
                    replica.stepping = False
                    self._idle(replica, now_s)
            elif kind == _READY:
                replica = payload
                if replica.state in ("starting", "waking"):
                    if replica.state == "starting":
                        replica.last_report_s = now_s
                    replica.state = "running"
                    self.scaling_events.append((now_s, "serving", replica.replica_id))
                    self._refresh_routable()
            elif kind == _REPORT_TICK:
                stats = {rid: r.stats(now_s) for rid, r in self.replicas.items() if r.state == "running"}
                samples.extend((now_s, rid, s["num_running"], s["num_waiting"], s["kv_usage_perc"])
                               for rid, s in stats.items())
                self._push(now_s + self.config.report_delay_s, _REPORT_ARRIVES, stats)
                if busy():
                    self._push(now_s + period_s, _REPORT_TICK, None)
            elif kind == _REPORT_ARRIVES:
                self.policy.on_report(payload, now_s)
            elif kind == _AUTOSCALE_TICK:
                self._autoscale(now_s)
                states = [r.state for r in self.replicas.values()]
                counts.append((now_s, len(self.routable), sum(states.count(s) for s in ("draining", "asleep", "waking")),
                               states.count("starting")))
                if busy():
                    self._push(now_s + self.autoscaler.config.tick_s, _AUTOSCALE_TICK, None)
            else:
                request = payload
                if not self.routable:  # every active replica is still waking or starting: it waits a tick
                    self._push(now_s + self.autoscaler.config.tick_s, _ARRIVAL, request)
                    continue
                started = time.perf_counter()
                rid = self.policy.pick(request, self.routable, now_s)
                decision_wall_s.append(time.perf_counter() - started)
                replica_of[request.request_id] = rid
                replica = self.replicas[rid]
                self._predict_exclusive(request, replica)
                replica.engine.add(request)
                engines_seen[id(replica.engine)] = replica.engine
                if not replica.stepping:
                    self._step(replica, now_s)
        engines = list(engines_seen.values())
        return SimResult(policy=self.policy.name, requests=list(requests), replica_of=replica_of, samples=samples,
                         prefix_queries_tokens=sum(e.prefix_queries_tokens for e in engines),
                         prefix_hits_tokens=sum(e.prefix_hits_tokens for e in engines),
                         num_preemptions=sum(e.num_preemptions for e in engines), decision_wall_s=decision_wall_s,
                         end_s=now_s, cpu_hits_tokens=sum(e.cpu_hits_tokens for e in engines),
                         replica_counts=counts, scaling_events=self.scaling_events)


def tenant_copies(items: Sequence[TraceItem], copies: int) -> list[TraceItem]:
    """`copies` tenants replaying the same trace at once: copy k's hash ids are moved past every id of copies
    before it (no block is shared across tenants), its timestamps kept; merged in time order (copy order at
    equal times). A trace too short for a large fleet keeps each tenant's own reuse pattern this way, where
    compressing time alone would only shorten the run."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    span = max((h for item in items for h in item.hash_ids), default=-1) + 1
    merged = [(item.timestamp_ms, k, i, TraceItem(item.timestamp_ms, item.input_length, item.output_length,
                                                  tuple(h + k * span for h in item.hash_ids)))
              for k in range(copies) for i, item in enumerate(items)]
    merged.sort(key=lambda entry: entry[:3])
    return [entry[3] for entry in merged]


def prefill_capacity_tokens_per_s(profile: StepProfile, limits: EngineLimits) -> float:
    """One engine's prefill throughput with every step full: a budget of prompt tokens per step."""
    budget = limits.max_num_batched_tokens
    return budget / profile.step_time_s(budget, 0, budget)


def time_scale_for(items: Sequence[TraceItem], utilization: float, num_replicas: int, profile: StepProfile,
                   limits: EngineLimits, block_tokens: int) -> float:
    """The timestamp multiplier that loads `num_replicas` engines' prefill capacity to `utilization` with the
    trace's unavoidable prefill: the tokens of blocks no earlier request had (its infinite-cache misses). A
    router that hits less than that ceiling loads the fleet more."""
    if not 0 < utilization:
        raise ValueError(f"utilization must be positive, got {utilization}")
    seen: set[int] = set()
    miss_tokens = 0
    for item in items:
        new = sum(1 for h in item.hash_ids if h not in seen)
        seen.update(item.hash_ids)
        miss_tokens += new * block_tokens + max(0, item.input_length - len(item.hash_ids) * block_tokens)
    span_s = (max(i.timestamp_ms for i in items) - min(i.timestamp_ms for i in items)) / 1000.0 if items else 0.0
    if span_s <= 0 or miss_tokens == 0:
        raise ValueError("the trace spans no time or needs no prefill: no time scale loads it")
    demand_tokens_per_s = miss_tokens / span_s
    capacity = num_replicas * prefill_capacity_tokens_per_s(profile, limits)
    return demand_tokens_per_s / (utilization * capacity)
