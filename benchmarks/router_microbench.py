"""Decision latency of the prefix_aware policy on a large, realistic index, with digests arriving.

Setup (defaults): 32 replicas whose engines together hold 100k blocks; requests of
2,048 tokens (64 blocks of 32) built as shared system prompt + per-user history +
fresh question, so matches are partial and spread over several replicas:

    request = system prompt (Zipf over 256 prompts, 8-40 blocks; the top one ~half the traffic)
            + user history  (0-16 blocks, reused by the same user, who sends a session key)
            + question      (fresh, fills the rest to 64 blocks)

Each engine is an LRU of its share of the blocks, and reports through the engine's own
`DigestJournal` (deltas since the last report, the full set every few reports). The router
state (`RouterState`: the prefix index, the prefix groups' demand, the session memory) is
warmed by routing requests (200 req/s of simulated time, so ~2,000 requests live in the
10 s routing history) and by one full digest per replica. Then `--decisions` requests arrive
(Poisson at `--rate`) and Ray's pushes with them: each replica is polled every stats period ×
U(0.9, 1.1) (Ray's jitter), and the controller pushes what it collected once per control loop
(0.1 s), so a push carries ~N/10 digests.

Headline, "decision latency": one event loop in virtual time runs what the router's loop runs,
each item timed for real with `time.perf_counter_ns` -- a push (queue its digests), digest
slices of `--slice-blocks` blocks (each schedules the next with `call_soon`, so it runs before
what arrived meanwhile), a decision (the replicas' snapshots with their prefill backlogs drained
to now, `rank_replicas`, then `RouterState.on_routed` and the pick's booking) -- and a
decision's latency runs from its arrival to the end of its ranking: its own work plus any wait
behind a slice, a push or an earlier decision. The same seeded load runs again with each push
applied at once, for comparison. Also reported: the decision's own work (snapshots +
`rank_replicas`), one slice, one push at once, a full resync, the bookkeeping after a pick and
the request's `block_hashes` (once per request at the ingress).
`--protocol full` makes every report a full set applied as such (the protocol before deltas).

    .venv/bin/python -m kvtide.benchmarks.router_microbench --out benchmarks/results/router_microbench.md
    .venv/bin/python -m kvtide.benchmarks.router_microbench --replicas 4 --indexed-blocks 2000 --decisions 500  # smoke

Before/after, `--baseline-rev REV`: the single run at REV ("before", checked out into a temporary
git worktree, removed at the end) and at the working tree ("after"), each run in a process of its
own that imports kvtide from its side's tree, alternated before/after over `--repeats` rounds with
the same options (so the same seed and load). `--out-dir` gets before_after.json (every run, both
trees' commits and import paths, provenance) and before_after.md: each headline latency (decision
latency and the decision's own work, p50 and p99) as median (min–max) per side, after/before, and
the protocol's verdict (overlapping ranges are "no difference"). Also `kvtide bench router`.

    .venv/bin/python -m kvtide.benchmarks.router_microbench --baseline-rev HEAD~3 --repeats 3 --out-dir /tmp/router-ba
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import defaultdict, deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtide.benchmarks.protocol import (
    CLAIM_MIN_REPEATS,
    format_spread,
    order_text,
    provenance,
    provenance_markdown,
    ratio_summary,
    schedule,
    summarize_repeats,
    verdict,
)
from kvtide.benchmarks.report import percentile
from kvtide.deployments.routing.block_hash import BlockHash, block_hashes
from kvtide.config import RoutingConfig
from kvtide.deployments.routing.digest_journal import DEFAULT_DELTA_WINDOW, DEFAULT_FULL_EVERY, DigestJournal
from kvtide.deployments.routing.fleet import DIGEST_SLICE_BLOCKS, FleetView
from kvtide.deployments.routing.policy import RouterState
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot

CONTROL_LOOP_S = 0.1  # Ray Serve's controller loop: routing stats collected then are pushed together
STATS_JITTER = (0.9, 1.1)  # Ray polls each replica's stats every period × U(0.9, 1.1)
_ABSENT = object()

Request = tuple[list[BlockHash], str | None]  # block hashes, session key


def _request_tokens(rng: random.Random, num_blocks: int, block_size: int, num_prompts: int,
                    num_users: int) -> tuple[list[int], str | None]:
    prompt_id = min(int(rng.paretovariate(1.2)) - 1, num_prompts - 1)  # Zipf-like popularity
    prompt_blocks = 8 + (prompt_id * 7) % 33
    user = rng.randrange(num_users)
    history_blocks = min(user % 17, num_blocks - prompt_blocks)
    fresh_blocks = num_blocks - prompt_blocks - history_blocks
    prompt = [(prompt_id * 9973 + i) % 8192 for i in range(prompt_blocks * block_size)]
    history = [(user * 7919 + i) % 8192 for i in range(history_blocks * block_size)]
    fresh = [rng.randrange(8192) for _ in range(fresh_blocks * block_size)]
    return prompt + history + fresh, (f"user-{user}" if history_blocks else None)


def _loads(rng: random.Random, replicas: list[str]) -> list[tuple[str, int]]:
    # Loads around a mean of 8 in flight per replica, spread like a busy but healthy fleet.
    return [(r, max(0, round(rng.gauss(8, 3)))) for r in replicas]


class _InFlight:
    """The router's in-flight count per replica, as it evolves: each decision adds one request
    where it went and one finishes somewhere (a steady ~8 per replica), so between two
    decisions two replicas' counts change, as in a router's queue-length cache."""

    def __init__(self, rng: random.Random, replicas: list[str]):
        self._rng = rng
        self.counts = dict(_loads(rng, replicas))

    def on_decision(self, replica_id: str) -> None:
        self.counts[replica_id] += 1
        busy = [rid for rid, n in self.counts.items() if n]
        self.counts[busy[self._rng.randrange(len(busy))]] -= 1


def _load_report(rng: random.Random, reported_s: float) -> dict:
    """An engine's load fields in its routing stats: some prefill pending, drained at an H200-like rate, and
    request durations of a second or two (so a pick counts for as long: `PickCounts.in_flight` runs in full)."""
    return {"num_running": max(0, round(rng.gauss(8, 3))), "num_waiting": max(0, round(rng.gauss(1, 1))),
            "kv_usage_perc": rng.uniform(0.3, 0.9), "pending_prefill_tokens": rng.randrange(0, 8192),
            "prefill_tokens_per_s": 20_000.0, "reported_s": reported_s,
            "request_durations_s": (0.4, 0.9, 1.5, 2.6)}


class _Engines:
    """What each engine holds: an LRU of block hashes (insertion-ordered dict), its share of the total.

    Every block entering or leaving an LRU is written to that engine's `DigestJournal`, as
    `KvCacheTracker` does from vLLM's KV events.
    """

    def __init__(self, replicas: list[str], capacity_blocks: int, *, full_every: int = DEFAULT_FULL_EVERY,
                 delta_window: int = DEFAULT_DELTA_WINDOW, cpu_capacity_blocks: int = 0):
        self.capacity_blocks = capacity_blocks
        self.held: dict[str, dict[BlockHash, None]] = {r: {} for r in replicas}
        self.journals = {r: DigestJournal(r, 1, delta_window=delta_window, full_every=full_every) for r in replicas}
        # A CPU tier per engine (0: none): vLLM's offloading connector stores every block the engine
        # computes, into an LRU of its own, reported in the digest's `cpu` part.
        self.cpu_capacity_blocks = cpu_capacity_blocks
        self.cpu_held: dict[str, dict[BlockHash, None]] = {r: {} for r in replicas} if cpu_capacity_blocks else {}
        self.cpu_journals = {r: DigestJournal(r, 1, delta_window=delta_window, full_every=full_every)
                             for r in self.cpu_held}

    def store(self, rid: str, hashes: list[BlockHash]) -> None:
        _store_lru(self.held[rid], self.journals[rid], hashes, self.capacity_blocks)
        if self.cpu_capacity_blocks:
            _store_lru(self.cpu_held[rid], self.cpu_journals[rid], hashes, self.cpu_capacity_blocks)

    @property
    def num_held(self) -> int:
        return sum(len(b) for b in self.held.values())

    def digest(self, rid: str, now_s: float) -> CacheDigest:
        digest = self.journals[rid].digest(self.held[rid], now_s)
        if not self.cpu_capacity_blocks:
            return digest
        return replace(digest, cpu=self.cpu_journals[rid].digest(self.cpu_held[rid], now_s))

    def full_digest(self, rid: str, now_s: float) -> CacheDigest:
        """This period's report as the protocol before deltas sent it: the full set alone (each tier's)."""
        d = self.digest(rid, now_s)
        cpu = None if d.cpu is None else CacheDigest.from_hashes(rid, d.cpu.epoch, d.cpu.sequence, self.cpu_held[rid],
                                                                 timestamp_s=now_s)
        return CacheDigest.from_hashes(rid, d.epoch, d.sequence, self.held[rid], timestamp_s=now_s, cpu=cpu)


def _store_lru(blocks: dict[BlockHash, None], journal: DigestJournal, hashes: list[BlockHash],
               capacity_blocks: int) -> None:
    """Store `hashes` in an LRU (insertion-ordered dict) of `capacity_blocks`, journalling what enters and leaves."""
    for h in hashes:
        if blocks.pop(h, _ABSENT) is _ABSENT:  # a new block (a held one just moves to the LRU's end)
            journal.stored(h)
        blocks[h] = None
    while len(blocks) > capacity_blocks:
        oldest = next(iter(blocks))
        del blocks[oldest]
        journal.removed(oldest)


class _StatsPushes:
    """When each replica's report reaches the router: polled with Ray's jitter, pushed per control loop."""

    def __init__(self, replicas: list[str], period_s: float, start_s: float, rng: random.Random):
        self.period_s = period_s
        self.rng = rng
        self.next_poll_s = {r: start_s + rng.uniform(0, period_s) for r in replicas}
        self.next_push_s = start_s + CONTROL_LOOP_S

    def due(self, now_s: float) -> list[str]:
        """Replicas whose new report the push at or before `now_s` carries (empty between pushes)."""
        if now_s < self.next_push_s:
            return []
        self.next_push_s += CONTROL_LOOP_S
        ready = [r for r, poll_s in self.next_poll_s.items() if poll_s <= now_s]
        for r in ready:
            self.next_poll_s[r] += self.period_s * self.rng.uniform(*STATS_JITTER)
        return ready


def build_state(args: argparse.Namespace) -> tuple[RouterState, _Engines, list[Request], list[str], float,
                                                   random.Random]:
    """A warmed router state and engines, the request pool, replica ids, the clock, the rng."""
    rng = random.Random(args.seed)
    state = RouterState(RoutingConfig(), args.block_size)
    replicas = [f"replica-{i:02d}" for i in range(args.replicas)]
    # 25 % above an even share, so the fleet reaches the target total before LRU evicts.
    cpu_blocks = getattr(args, "cpu_tier_blocks", 0)
    engines = _Engines(replicas, math.ceil(1.25 * args.indexed_blocks / args.replicas),
                       full_every=1 if args.protocol == "full" else args.full_every, delta_window=args.delta_window,
                       cpu_capacity_blocks=math.ceil(cpu_blocks / args.replicas) if cpu_blocks else 0)
    step_s = 1.0 / args.rate

    # Warm-up traffic: route, and keep what each engine would hold.
    now_s = 0.0
    requests: list[Request] = []
    for _ in range(args.pool):
        tokens, session = _request_tokens(rng, args.blocks_per_request, args.block_size, 256, 4096)
        requests.append((block_hashes(tokens, args.block_size), session))
    max_warmup = 20 * args.indexed_blocks // max(1, args.blocks_per_request // 2)
    for _ in range(max_warmup):
        if engines.num_held >= args.indexed_blocks:
            break
        hashes, session = requests[rng.randrange(len(requests))]
        snapshots = [ReplicaSnapshot(r, ongoing) for r, ongoing in _loads(rng, replicas)]
        rid = state.rank(hashes, snapshots, rng, now_s=now_s, session_key=session).ranked[0]
        state.on_routed(rid, hashes, now_s, session)
        engines.store(rid, hashes)
        now_s += step_s
    for rid in replicas:
        state.apply_digest(engines.full_digest(rid, now_s))  # a router's first report: a full set
    return state, engines, requests, replicas, now_s, rng


def run(args: argparse.Namespace) -> dict:
    """Both ways of applying digests on the same seeded load: in slices (the router's way) and at once."""
    load_avg_1m = os.getloadavg()[0]
    sliced = _timeline(args, args.slice_blocks)
    at_once = _timeline(args, None)
    return {"load_avg_1m": load_avg_1m, **sliced, "at_once": at_once}


def _timeline(args: argparse.Namespace, slice_blocks: int | None) -> dict:
    """One event loop, in virtual time, running what the router's loop runs, each item timed for real.

    Requests arrive (Poisson, `--rate`) and Ray's pushes arrive (every 0.1 s, with the reports
    polled since); the loop runs one item at a time, in asyncio's order: a push queues its
    digests and schedules the first slice, each slice schedules the next (`call_soon`, so it
    runs before what arrives meanwhile), a request's decision is `rank_replicas`, then its
    bookkeeping. A decision's latency is from its arrival to the end of its ranking: what it
    waited for (a slice, a push applied at once, earlier decisions) and its own work.
    """
    state, engines, requests, replicas, now_s, rng = build_state(args)
    fleet = FleetView(state, slice_blocks=slice_blocks)
    pushes = _StatsPushes(replicas, state.tunables.stats_period_s, now_s, random.Random(args.seed + 1))
    report = engines.full_digest if args.protocol == "full" else engines.digest
    arrivals = random.Random(args.seed + 2)
    stats: dict[str, dict] = {}  # what Ray hands over at a push: every replica's latest stats
    in_flight = _InFlight(random.Random(args.seed + 3), replicas)

    latency_ns, rank_ns, routed_ns, push_ns, slice_ns, outcomes = [], [], [], [], [], defaultdict(int)
    replicated = sticky = delta_changes = waited = num_digests = 0
    ready: deque = deque()  # ("push",) | ("slice",) | ("decision", arrival_s)
    loop_s = now_s  # virtual time at which the loop is free
    next_arrival_s = now_s + arrivals.expovariate(args.rate)
    slice_scheduled = False
    gc.collect()
    while len(latency_ns) < args.decisions:
        if not ready:  # idle until the next event
            loop_s = max(loop_s, min(next_arrival_s, pushes.next_push_s))
        # what arrived while the loop was busy joins the ready queue, in time order
        while True:
            if pushes.next_push_s <= loop_s and pushes.next_push_s <= next_arrival_s:
                for rid in pushes.due(pushes.next_push_s):
                    digest = report(rid, pushes.next_push_s - CONTROL_LOOP_S)  # the engine's work, untimed
                    delta_changes += digest.deltas[-1].num_changes if digest.deltas else 0
                    num_digests += 1
                    stats[rid] = {"digest": digest, **_load_report(rng, pushes.next_push_s - CONTROL_LOOP_S)}
                ready.append(("push",))
            elif next_arrival_s <= loop_s:
                ready.append(("decision", next_arrival_s))
                next_arrival_s += arrivals.expovariate(args.rate)
            else:
                break
        item = ready.popleft()
        if item[0] == "push":
            t = time.perf_counter_ns()
            fleet.sync(stats, now_s=loop_s)  # at once: applies here; sliced: queues
            elapsed = time.perf_counter_ns() - t
            push_ns.append(elapsed)
            loop_s += elapsed / 1e9
            if fleet.num_queued_digests and not slice_scheduled:
                slice_scheduled = True
                ready.append(("slice",))
        elif item[0] == "slice":
            t = time.perf_counter_ns()
            more = fleet.apply_digests(slice_blocks)
            elapsed = time.perf_counter_ns() - t
            slice_ns.append(elapsed)
            loop_s += elapsed / 1e9
            if more:  # call_soon: after what is ready now, before what arrived during this slice
                ready.append(("slice",))
            else:
                slice_scheduled = False
        else:
            arrival_s = item[1]
            waited += loop_s > arrival_s
            hashes, session = requests[rng.randrange(len(requests))]
            t0 = time.perf_counter_ns()
            # As the Ray adapter does: snapshots with each replica's prefill backlog drained to now,
            # then the ranking; after the pick, the bookkeeping and the pick's prefill booked.
            snapshots = fleet.snapshots(in_flight.counts.items(), now_s=loop_s)
            decision = state.rank(hashes, snapshots, rng, now_s=loop_s, session_key=session)
            t1 = time.perf_counter_ns()
            state.on_routed(decision.ranked[0], hashes, loop_s, session)
            fleet.book_pick(decision.ranked[0], len(hashes) * args.block_size - decision.matched_tokens, now_s=loop_s)
            t2 = time.perf_counter_ns()
            in_flight.on_decision(decision.ranked[0])  # the requests' own life, untimed
            rank_ns.append(t1 - t0)
            routed_ns.append(t2 - t1)
            latency_ns.append(round((loop_s - arrival_s) * 1e9) + t1 - t0)
            loop_s += (t2 - t0) / 1e9
            outcomes[decision.outcome] += 1
            replicated += decision.prefix_replicas > 1
            sticky += decision.sticky
            engines.store(decision.ranked[0], hashes)  # the engine's work, untimed

    hash_ns = []
    for tokens in [_request_tokens(rng, args.blocks_per_request, args.block_size, 256, 4096)[0] for _ in range(200)]:
        t = time.perf_counter_ns()
        block_hashes(tokens, args.block_size)
        hash_ns.append(time.perf_counter_ns() - t)
    index = state.index
    return {
        "decision_latency_us": _us(latency_ns),
        "decisions_that_waited": waited,
        "rank_replicas_us": _us(rank_ns),  # the decision's own work: snapshots + rank_replicas (key kept)
        "on_routed_us": _us(routed_ns),
        "push_us": _us(push_ns),
        "slice_us": _us(slice_ns),
        "block_hashes_2048_tokens_us": _us(hash_ns),
        "full_resync_us": _us(_time_full_resyncs(args, engines, replicas, loop_s)) if slice_blocks else None,
        "pushes": len(push_ns),
        "slices": len(slice_ns),
        "digests": num_digests,
        "changes_per_delta": round(delta_changes / max(1, num_digests)),
        "digest_busy_share": round((sum(push_ns) + sum(slice_ns)) / 1e9 / max(loop_s - now_s, 1e-9), 4),
        "outcomes": dict(outcomes),
        "replicated_decisions": replicated,
        "sticky_decisions": sticky,
        "engine_blocks_indexed": index.num_engine_blocks,
        "held_blocks_total": index.num_held_blocks,
        "routed_blocks_indexed": index.num_routed_blocks,
    }


def _us(samples: list[int]) -> dict[str, float]:
    if not samples:
        return {"p50": 0.0, "p99": 0.0}
    return {q: round(percentile(samples, p) / 1000, 1) for q, p in (("p50", 50), ("p99", 99))}


def _time_full_resyncs(args: argparse.Namespace, engines: _Engines, replicas: list[str], now_s: float) -> list[int]:
    """One full set per replica applied by a router that has a gap: the fallback path (untimed in the loop)."""
    state = RouterState(RoutingConfig(), args.block_size)
    for rid in replicas:  # the router's view a few periods back: the journal's next full set, then a gap
        state.apply_digest(engines.full_digest(rid, now_s))
        for h in list(engines.held[rid])[: len(engines.held[rid]) // 20]:  # ~5 % churn since
            engines.store(rid, [h ^ 1])
    samples = []
    for rid in replicas:
        digest = engines.full_digest(rid, now_s)
        t = time.perf_counter_ns()
        state.apply_digest(digest)
        samples.append(time.perf_counter_ns() - t)
    return samples


def _markdown(args: argparse.Namespace, result: dict, command: str) -> str:
    once = result["at_once"]
    headline, rank = result["decision_latency_us"], result["rank_replicas_us"]
    verdict = "met" if headline["p99"] <= args.target_p99_us else "NOT met"
    protocol = ("deltas (a chain of the last {w} reports' changes; a full set every {f} reports, applied only "
                "after a gap)".format(w=args.delta_window, f=args.full_every) if args.protocol == "delta"
                else "full sets (every report the replica's whole block set, applied as such)")
    row = lambda name, r: f"| {name} | {r['p50']} | {r['p99']} |"  # noqa: E731
    return f"""# Router microbenchmark: prefix_aware decision latency, digest application included

Command:

    {command}

Setup: {args.replicas} replicas, {result['held_blocks_total']:,} blocks held by engines
({result['engine_blocks_indexed']:,} distinct hashes in the index), {result['routed_blocks_indexed']:,} hashes in
the routing history, requests of {args.blocks_per_request * args.block_size:,} tokens
({args.blocks_per_request} blocks of {args.block_size}), {args.decisions:,} decisions, Poisson arrivals at
{args.rate:g} req/s, seed {args.seed}. The engines are LRUs that store every routed request's blocks and evict
the oldest, so each report carries real churn (~{result['changes_per_delta']:,} blocks stored + evicted per
replica per report). Digest protocol: {protocol}. {result['digests']:,} digests in {result['pushes']:,} pushes,
as Ray Serve delivers them: each replica polled every 1 s × U(0.9, 1.1), the controller pushing what it
collected every 0.1 s.
Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()};
1-minute load average when the run started: {result['load_avg_1m']:.1f} (other processes on the CPUs inflate the tails).

Method: one event loop in virtual time runs what the router's loop runs, each item timed for
real: pushes (queue the digests), digest slices of {args.slice_blocks} blocks (each schedules the next
with `call_soon`, so it runs before what arrived meanwhile), and decisions (the replicas'
snapshots with their prefill backlogs drained to now and `rank_replicas`, then the bookkeeping).
A decision's latency runs from its arrival to the end of its ranking, so it
includes any wait behind a slice, a push or an earlier decision. The same seeded load is run a
second time with every push applied at once (before slicing).

| step | p50 (µs) | p99 (µs) |
|---|---:|---:|
| **decision latency, digests applied in slices** (headline; {result['decisions_that_waited']:,} of {args.decisions:,} waited) | **{headline['p50']}** | **{headline['p99']}** |
| decision latency, each push applied at once ({once['decisions_that_waited']:,} waited) | {once['decision_latency_us']['p50']} | {once['decision_latency_us']['p99']} |
{row("the decision alone: `FleetView.snapshots` (backlogs drained) + `rank_replicas`", rank)}
{row(f"one digest slice ({args.slice_blocks} blocks)", result['slice_us'])}
{row("one push applied at once", once['push_us'])}
| one full set applied (a router's resync after a gap, at once; not in the loop) | {result['full_resync_us']['p50']} | {result['full_resync_us']['p99']} |
{row("`RouterState.on_routed` + `FleetView.book_pick` (bookkeeping after the pick)", result['on_routed_us'])}
{row("`block_hashes` of 2,048 tokens (once per request, ingress)", result['block_hashes_2048_tokens_us'])}

The loop spent {100 * result['digest_busy_share']:.2f} % of the time on digests.

Target: decision p99 ≤ {args.target_p99_us:.0f} µs with digest application included — **{verdict}**.

Outcomes: {', '.join(f'{k}={v}' for k, v in sorted(result['outcomes'].items()))};
{result['replicated_decisions']:,} decisions for a hot prefix group (k ≥ 2),
{result['sticky_decisions']:,} sticky session picks.
"""


# ---- before/after: the same single run at the working tree and at another revision --------

BEFORE, AFTER = "before", "after"
# The latencies a before/after report compares: (the single run's key, its percentile).
HEADLINE = (("decision_latency_us", "p50"), ("decision_latency_us", "p99"),
            ("rank_replicas_us", "p50"), ("rank_replicas_us", "p99"))
HEADLINE_LABELS = {"decision_latency_us": "decision latency (digests in slices)",
                   "rank_replicas_us": "the decision's own work (snapshots + rank_replicas)"}
# The single run's options that decide its load, forwarded to both sides with this run's values
# (not each tree's defaults, which may differ), so every run has the same seed and load. Each
# exists at the revision this mode was added on and every later one, so an older tree's own
# argument parser accepts them; a revision before one of them fails with argparse's message.
FORWARDED_OPTIONS = ("replicas", "indexed_blocks", "blocks_per_request", "block_size", "decisions", "pool",
                     "rate", "seed", "protocol", "slice_blocks", "delta_window", "full_every")
# String hashing fixed in every run, so whatever iterates a set of strings does so alike in all of them.
SIDE_HASH_SEED = "0"

# What each side's process runs (`python -c`): argv = tree, JSON path, the single run's options.
# It imports kvtide from `tree` alone -- the editable install's finder maps kvtide's packages to
# the checkout it was installed from, and it sits after the path finder, so PYTHONPATH alone
# would take `kvtide` from the tree and its subpackages from that checkout. A finder placed
# first maps each package to the tree's folder as the tree's own pyproject.toml
# ([tool.setuptools.package-dir]) says; subpackages then follow their parent's folder.
# It uses only what the single run has had from the start (`main(argv)`, which calls the
# module's `run`), so a tree from before this mode runs it unchanged.
SIDE_DRIVER = r"""
import importlib.util, json, sys, tomllib
from pathlib import Path

tree, json_out, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
with open(tree / "pyproject.toml", "rb") as f:
    package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]


class TreeFinder:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname not in package_dirs:
            return None
        folder = tree / package_dirs[fullname]
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


sys.meta_path.insert(0, TreeFinder)
import kvtide
import kvtide.benchmarks.router_microbench as bench
import kvtide.deployments.routing.policy as policy

results = []
single_run = bench.run


def capture(args):
    results.append(single_run(args))
    return results[-1]


bench.run = capture  # main() looks `run` up at call time
bench.main(argv)  # its exit status only says whether the p99 target was met
with open(json_out, "w") as f:
    json.dump({"result": results[0], "kvtide_file": kvtide.__file__, "policy_file": policy.__file__,
               "bench_file": bench.__file__}, f)
"""


def _git(root: Path, *argv: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(argv)} failed in {root}: {done.stderr.strip()}")
    return done.stdout


def repo_root() -> Path:
    """The git checkout this module's tree is: the "after" side."""
    return Path(_git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel").strip())


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo on Linux; what `platform` says elsewhere, None if nothing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def code_digest(tree: Path) -> str:
    """A digest of the Python files kvtide imports from `tree` (its package folders' files, tracked or
    not, by content): equal digests, the same code. A commit alone leaves it as it is; an edit does not."""
    with open(tree / "pyproject.toml", "rb") as f:
        folders = sorted(set(tomllib.load(f)["tool"]["setuptools"]["package-dir"].values()))
    names = sorted(n for n in _git(tree, "ls-files", "-co", "--exclude-standard", "-z", "--", *folders).split("\0")
                   if n.endswith(".py"))
    digest = hashlib.sha256()
    for name in names:
        path = tree / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"(deleted)") + b"\0")
    return digest.hexdigest()[:16]


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The single run's options, as both sides' processes get them."""
    argv = []
    for dest in FORWARDED_OPTIONS:
        argv += [f"--{dest.replace('_', '-')}", str(getattr(args, dest))]
    return argv


def run_side(tree: Path, argv: list[str], json_path: Path) -> dict[str, Any]:
    """One single run of `tree`'s benchmark in a process of its own: its result, where kvtide came from, wall_s."""
    env = {**os.environ, "PYTHONHASHSEED": SIDE_HASH_SEED}
    start_s = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SIDE_DRIVER, str(tree), str(json_path), *argv], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    wall_s = time.monotonic() - start_s
    if done.returncode != 0 or not json_path.exists():
        raise RuntimeError(f"the single run in {tree} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    out = json.loads(json_path.read_text())
    for key in ("kvtide_file", "policy_file", "bench_file"):  # else it measured other code
        if not Path(out[key]).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the run meant for {tree} imported {out[key]}")
    return {**out, "wall_s": round(wall_s, 2)}


def before_after(args: argparse.Namespace, command: list[str]) -> dict[str, Any]:
    """The single run at --baseline-rev (before, in a temporary worktree) and at the working tree (after),
    alternated over --repeats rounds with the same options; writes and returns the report."""
    root = repo_root()
    baseline_sha = _git(root, "rev-parse", "--verify", f"{args.baseline_rev}^{{commit}}").strip()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = forwarded_argv(args)
    # Each run is a fresh process whose timed loop follows its own untimed warm-up (build_state
    # routes thousands of requests), so no warm-up run precedes the rounds.
    order = [r for r in schedule([BEFORE, AFTER], args.repeats) if not r.warmup]
    prov = provenance(command)  # the after side's commit ("-dirty" included) as the runs start
    worktree = Path(tempfile.mkdtemp(prefix="kvtide-baseline-"))
    runs = []
    try:
        _git(root, "worktree", "add", "--detach", str(worktree), baseline_sha)
        trees = {BEFORE: worktree, AFTER: root}
        with tempfile.TemporaryDirectory(prefix="kvtide-before-after-") as scratch:
            for i, r in enumerate(order):
                print(f"[{i + 1}/{len(order)}] {r.label}", file=sys.stderr, flush=True)
                digest = code_digest(trees[r.server])
                side_argv = argv + (["--cpu-tier-blocks", str(args.after_cpu_tier_blocks)]
                                    if r.server == AFTER and args.after_cpu_tier_blocks else [])
                side = run_side(trees[r.server], side_argv, Path(scratch) / f"{i}.json")
                runs.append({"side": r.server, "repeat": r.repeat, "code_digest": digest, **side})
    finally:
        removed = subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(worktree)],
                                 capture_output=True, check=False)
        if removed.returncode != 0 or worktree.exists():  # never registered, or git could not remove it
            shutil.rmtree(worktree, ignore_errors=True)
            subprocess.run(["git", "-C", str(root), "worktree", "prune"], capture_output=True, check=False)
    # The working tree may be edited while the runs go: its code is digested before each run and
    # after the last, so a change between any two says the after runs did not all run the same code.
    after_digests = [run["code_digest"] for run in runs if run["side"] == AFTER] + [code_digest(root)]

    def values(side: str, key: str, q: str) -> list[float]:
        return [run["result"][key][q] for run in runs if run["side"] == side]

    headline = {}
    for key, q in HEADLINE:
        before, after = values(BEFORE, key, q), values(AFTER, key, q)
        said = verdict(after, before, higher_is_better=False)
        headline[f"{key}.{q}"] = {"before": summarize_repeats(before), "after": summarize_repeats(after),
                                  "after_over_before": ratio_summary(after, before),
                                  "verdict": {"better": "faster", "worse": "slower"}.get(said, said)}
    sides = {}
    for side, tree in ((BEFORE, worktree), (AFTER, root)):
        first = next(run for run in runs if run["side"] == side)
        sides[side] = {"tree": str(tree), "kvtide_file": first["kvtide_file"], "policy_file": first["policy_file"],
                       "bench_file": first["bench_file"]}
    sides[BEFORE]["commit"] = baseline_sha
    sides[BEFORE]["rev"] = args.baseline_rev
    sides[AFTER]["commit"] = prov["kvtide_commit"]
    report = {
        "kind": "router_microbench_before_after",
        "provenance": {**prov, "cpu_model": cpu_model(), "python_executable": sys.executable,
                       "platform": platform.platform()},
        "sides": sides,
        "side_command": shlex.join([sys.executable, "-c", "<router_microbench.SIDE_DRIVER>", "TREE", "JSON_OUT",
                                    *argv]),
        "single_run_options": {dest: getattr(args, dest) for dest in FORWARDED_OPTIONS},
        "after_cpu_tier_blocks": args.after_cpu_tier_blocks,
        "side_env": {"PYTHONHASHSEED": SIDE_HASH_SEED},
        "repeats": args.repeats,
        "order": [r.label for r in order],
        "order_text": order_text(order),
        "after_code": {"digest_at_end": after_digests[-1], "changed_during_runs": len(set(after_digests)) > 1},
        "headline": headline,
        "runs": runs,
    }
    (out_dir / "before_after.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "before_after.md").write_text(before_after_markdown(report))
    return report


def before_after_markdown(report: dict[str, Any]) -> str:
    """The before/after report: each headline latency's median (min–max) per side, the ratio, the verdict."""
    before, after = report["sides"][BEFORE], report["sides"][AFTER]
    rows = []
    for name, h in report["headline"].items():
        key, q = name.split(".")
        rows.append(f"| {HEADLINE_LABELS[key]}, {q} (`{key}`) | {format_spread(h['before'])} | "
                    f"{format_spread(h['after'])} | {format_spread(h['after_over_before'], fmt='{:.2f}', suffix='×')} "
                    f"| {h['verdict']} |")
    options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in report["single_run_options"].items())
    notes = []
    if report.get("after_cpu_tier_blocks"):
        notes.append(f"The after side runs with a CPU KV tier of {report['after_cpu_tier_blocks']:,} blocks over all "
                     "engines (`--cpu-tier-blocks`): each decision also matches the CPU index, each report carries "
                     "the tier's digest; the before side has no tier.")
    if report["repeats"] < CLAIM_MIN_REPEATS:
        notes.append(f"Fewer than {CLAIM_MIN_REPEATS} repeats: the ranges are too thin to tell a difference from "
                     "noise.")
    if report["after_code"]["changed_during_runs"]:
        notes.append("**The working tree's code changed while the runs went** (each run's `code_digest` in the "
                     "JSON): the after runs did not all run the same code.")
    prov = report["provenance"]
    return "\n".join([
        f"# Router microbenchmark, before/after: {before['commit'][:12]} ({before['rev']}) → {after['commit']}",
        "",
        "Command:",
        "",
        f"    {prov['command']}",
        "",
        f"Each run is the single run (`main`) of its side's own `router_microbench`, in a process of its own with "
        f"kvtide imported from that side's tree; {report['repeats']} rounds, alternated: {report['order_text']}.",
        f"Every run has the same seed and load: `{options}`.",
        "",
        "| latency (µs) | before | after | after / before | verdict |",
        "|---|---:|---:|---:|---|",
        *rows,
        "",
        "Median (min–max) over the repeats; the ratio is paired by round. \"faster\" or \"slower\" only where the "
        "two ranges do not overlap; overlapping ranges are \"no difference\".",
        *(["", *notes] if notes else []),
        "",
        f"- before: {before['commit']}, kvtide from `{before['kvtide_file']}`, policy `{before['policy_file']}` "
        f"(a temporary worktree, removed)",
        f"- after: {after['commit']}, kvtide from `{after['kvtide_file']}`, policy `{after['policy_file']}`",
        f"- CPU: {prov['cpu_model'] or 'unknown'}; Python {prov['versions']['python']} ({prov['python_executable']}); "
        f"{prov['platform']}",
        "",
        provenance_markdown(prov),
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The single run's options, then the before/after mode's (`--baseline-rev`, `--repeats`, `--out-dir`)."""
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--indexed-blocks", type=int, default=100_000, help="blocks held by all engines together")
    parser.add_argument("--blocks-per-request", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--pool", type=int, default=4000, help="distinct requests to draw from")
    parser.add_argument("--rate", type=float, default=200.0, help="simulated requests/s (sets history size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-p99-us", type=float, default=100.0)
    parser.add_argument("--protocol", choices=("delta", "full"), default="delta",
                        help="digests as deltas (with periodic full sets), or a full set every report (before)")
    parser.add_argument("--slice-blocks", type=int, default=DIGEST_SLICE_BLOCKS, help="blocks per digest slice")
    parser.add_argument("--delta-window", type=int, default=DEFAULT_DELTA_WINDOW)
    parser.add_argument("--full-every", type=int, default=DEFAULT_FULL_EVERY)
    parser.add_argument("--cpu-tier-blocks", type=int, default=0,
                        help="blocks the engines' CPU KV tiers hold together (0: no tier); every stored block is "
                             "offloaded, as vLLM's offloading connector does")
    parser.add_argument("--out", help="write the Markdown report here (single run)")
    before_after = parser.add_argument_group(
        "before/after", "the single run at the working tree (after) and at --baseline-rev (before), each in a "
                        "process of its own, alternated over --repeats rounds")
    before_after.add_argument("--baseline-rev", metavar="REV",
                              help="git revision to compare against (a sha, HEAD~3, a branch): checked out into a "
                                   "temporary worktree, removed at the end")
    before_after.add_argument("--repeats", type=int, default=3, help="rounds of before then after (default 3)")
    before_after.add_argument("--after-cpu-tier-blocks", type=int, default=0, metavar="N",
                              help="the after side only runs with --cpu-tier-blocks N (a revision before the tier "
                                   "has no such option): what the tier adds to a decision, against the baseline")
    before_after.add_argument("--out-dir", help="where before_after.json and before_after.md go (needed with "
                                                "--baseline-rev)")


def _before_after_problem(args: argparse.Namespace) -> str | None:
    """Why the parsed options do not make a valid run, or None."""
    if args.baseline_rev is None:
        return None if args.out_dir is None else "--out-dir goes with --baseline-rev (a single run takes --out)"
    if args.out:
        return "--out is the single run's report; with --baseline-rev the reports go to --out-dir"
    if not args.out_dir:
        return "--baseline-rev needs --out-dir"
    if args.repeats < 1:
        return f"--repeats must be 1 or more, got {args.repeats}"
    return None


def _single_run(args: argparse.Namespace, command: str) -> int:
    result = run(args)
    print(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(_markdown(args, result, command))
    return 0 if result["decision_latency_us"]["p99"] <= args.target_p99_us else 1


def _dispatch(args: argparse.Namespace, command: list[str]) -> int:
    if args.baseline_rev is None:
        return _single_run(args, " ".join(command))
    report = before_after(args, command)
    print(before_after_markdown(report))
    print(f"wrote {Path(args.out_dir) / 'before_after.json'} and {Path(args.out_dir) / 'before_after.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    problem = _before_after_problem(args)
    if problem:
        parser.error(problem)
    return _dispatch(args, [".venv/bin/python", "-m", "kvtide.benchmarks.router_microbench",
                            *(argv if argv is not None else sys.argv[1:])])


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`kvtide bench router` on the bench group's subparsers: this module's own options."""
    p = sub.add_parser("router", help="the router's decision latency on a large simulated index (one run), or "
                                      "before/after against --baseline-rev")
    add_arguments(p)
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    problem = _before_after_problem(args)
    if problem:
        print(f"kvtide bench router: {problem}", file=sys.stderr)
        return 2
    return _dispatch(args, ["kvtide", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
