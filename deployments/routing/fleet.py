"""The router's per-replica view, updated when routing stats arrive and read at decision time.

Ray Serve pushes each replica's `record_routing_stats()` payload to the router with the
replica list (`RequestRouter.update_replicas`, about once per stats period). Everything
that payload implies is applied here, then, off the request path:

    sync(stats by replica)      digest → RouterState (its deltas, or a full set after a gap)
                                load numbers → cached per replica
                                a new report → this router's pick-only count restarts at 0, and
                                the replica's prefill backlog restarts from the report
                                (`deployments.routing.backlog`: drained at the engine's rate);
                                its request durations → how long a pick counts
                                (`deployments.routing.pick_load`)
                                replicas no longer listed → forgotten (index, sessions)
    snapshots(in-flight counts) per decision: one ReplicaSnapshot per candidate, reused
                                while the replica's numbers are unchanged; pick-only picks
                                since the report that have probably not finished add their
                                load, and their booked prefill sits in the backlog
    digest_ages_s(now)          per replica: how old the newest applied digest is (telemetry:
                                how stale the index's engine truth may be)

so a decision only reads an index that is already current. No Ray import: the adapter
hands plain dicts and ids in.

Sliced application (`slice_blocks`): the router's decisions and its digest application
share one event loop, and a push can carry several reports of hundreds of changed blocks
each (a resync after a gap carries a full set of up to ~100k blocks), so without slicing a
request arriving during a push waits for all of it. With `slice_blocks` set, `sync` only queues the digests and the
owner calls `apply_digests(slice_blocks)` once per loop turn until it returns False: a
decision then waits for one slice at most. A replica's digests apply in arrival order, one
at a time; `forget` drops its queued digests and abandons one half applied.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import replace
from typing import Any, Generator, Iterable, Mapping

from kvtide.deployments.routing.backlog import PrefillBacklog
from kvtide.deployments.routing.pick_load import PickCounts
from kvtide.deployments.routing.policy import RouterState
from kvtide.deployments.routing.stages.scorers import cpu_block_weight
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot

# Block updates per digest slice in the router (deployments.routing.ray_router): each slice decodes and sets
# apart its own part of the delta, then updates the index (`PrefixIndex._apply_delta_steps`).
# The size trades two costs: a decision that arrives during a slice waits for the rest of it,
# so larger slices lengthen the decision's tail, while smaller ones add per-slice overhead to
# the total digest time without shortening that tail further. 16 is where the tail is short
# and the overhead is not yet visible (benchmarks/results/router_microbench.md).
DIGEST_SLICE_BLOCKS = 16


def _durations(value: Any) -> tuple[float, ...]:
    """An engine's reported request-duration quantiles (`RecentDurations.quantiles`); () if absent or malformed."""
    if not isinstance(value, (list, tuple)):
        return ()
    try:
        quantiles = tuple(sorted(float(q) for q in value))
    except (TypeError, ValueError):
        return ()
    return quantiles if all(math.isfinite(q) and q >= 0 for q in quantiles) else ()


_NOT_REPORTED = (0, 0, 0.0, 0, 0.0, 1.0)


def rekey(digest: CacheDigest, replica_id: str) -> CacheDigest:
    """Digests are keyed by the router's replica id (the engine may name itself differently)."""
    if digest.replica_id == replica_id:
        return digest
    cpu = digest.cpu if digest.cpu is None else replace(digest.cpu, replica_id=replica_id)
    return replace(digest, replica_id=replica_id, cpu=cpu)


class FleetView:
    """Engine-reported load, digests applied to the state, and pick-only counts, per replica."""

    def __init__(self, state: RouterState, slice_blocks: int | None = None):
        self.state = state
        self.slice_blocks = slice_blocks  # None: `sync` applies digests at once
        self._queued: deque[CacheDigest] = deque()  # rekeyed, in arrival order
        self._newest_queued: dict[str, tuple[int, int]] = {}  # replica → (epoch, sequence) last queued
        self._applying: tuple[CacheDigest, Generator[None, None, bool]] | None = None
        # replica → (running, waiting, kv usage, pending prefill tokens, its drain rate, CPU-tier block weight)
        self._reported: dict[str, tuple[int, int, float, int, float, float]] = {}
        self._picks = PickCounts()  # pick-only choices since each replica's last report
        self._backlog = PrefillBacklog()  # prefill tokens ahead, reported + booked, drained between reports
        self._snapshots: dict[str, tuple[tuple[int, int, int], ReplicaSnapshot]] = {}  # replica → (inputs, snapshot)
        self._digest_s: dict[str, float] = {}  # replica → engine timestamp of its newest applied digest

    def sync(self, stats_by_replica: Mapping[str, Mapping[str, Any]], now_s: float | None = None) -> None:
        """Apply the latest routing stats of every live replica; forget the replicas not listed.

        `now_s`: wall-clock time (the engines stamp `reported_s` with theirs); default time.time().
        """
        now_s = time.time() if now_s is None else now_s
        for rid, stats in stats_by_replica.items():
            digest = stats.get("digest")
            if isinstance(digest, CacheDigest):
                self._receive(rekey(digest, rid))
            reported_s = stats.get("reported_s")
            new_report = self._picks.on_report(rid, reported_s, _durations(stats.get("request_durations_s")))
            prefill_tokens_per_s = float(stats.get("prefill_tokens_per_s", 0.0))
            reported = (int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0)),
                        float(stats.get("kv_usage_perc", 0.0)), int(stats.get("pending_prefill_tokens", 0)),
                        prefill_tokens_per_s,
                        cpu_block_weight(prefill_tokens_per_s, float(stats.get("onload_tokens_per_s", 0.0))))
            if new_report or reported != self._reported.get(rid):  # (a new report also drops the booked prefill)
                self._reported[rid] = reported
                self._backlog.on_report(rid, reported[3], reported[4],
                                        reported_s if isinstance(reported_s, (int, float)) else now_s, now_s)
                self._snapshots.pop(rid, None)
        for gone in set(self._reported) - set(stats_by_replica):
            self.forget(gone)

    def _receive(self, digest: CacheDigest) -> None:
        if self.slice_blocks is None:
            self._applied(digest, self.state.apply_digest(digest))
            return
        # Ray hands every replica's latest stats over at each push, a digest already seen
        # included: queue only reports newer than the last one queued for the replica.
        last = self._newest_queued.get(digest.replica_id)
        if last is None or digest.is_newer_than(*last):
            self._newest_queued[digest.replica_id] = (digest.epoch, digest.sequence)
            self._queued.append(digest)

    def _applied(self, digest: CacheDigest, applied: bool) -> None:
        # A digest is ignored unless newer than the last applied; timestamp 0.0 means "not stamped".
        if applied and digest.timestamp_s > 0:
            self._digest_s[digest.replica_id] = digest.timestamp_s

    def apply_digests(self, max_blocks: int | None = None) -> bool:
        """Apply queued digests: all of them (None), or one slice of at most `max_blocks` blocks.

        True while some remain: call again (next loop turn) until False.
        """
        while True:
            if self._applying is None:
                if not self._queued:
                    return False
                digest = self._queued.popleft()
                self._applying = (digest, self.state.apply_digest_steps(digest, max_blocks))
            digest, steps = self._applying
            try:
                next(steps)
            except StopIteration as done:
                self._applying = None
                self._applied(digest, done.value)
            if max_blocks is not None:
                return self._applying is not None or bool(self._queued)

    @property
    def num_queued_digests(self) -> int:
        """Digests received and not fully applied yet (the one in progress included)."""
        return len(self._queued) + (self._applying is not None)

    def forget(self, replica_id: str) -> None:
        """A replica stopped or died: drop it from the state and from every per-replica table."""
        if self._applying is not None and self._applying[0].replica_id == replica_id:
            self._applying[1].close()  # half applied: remove_replica below clears what it did
            self._applying = None
        self._queued = deque(d for d in self._queued if d.replica_id != replica_id)
        self._newest_queued.pop(replica_id, None)
        self.state.remove_replica(replica_id)
        self._picks.forget(replica_id)
        self._backlog.forget(replica_id)
        for table in (self._reported, self._snapshots, self._digest_s):
            table.pop(replica_id, None)

    def digest_ages_s(self, now_s: float) -> dict[str, float]:
        """Replica → seconds since its newest applied digest was taken, for every replica that sent one.

        `now_s` is wall-clock time (the digests' timestamps are the engines' time.time()), so
        the age includes clock skew between hosts; a negative age (skew) reads as 0.
        """
        return {rid: max(0.0, now_s - stamp_s) for rid, stamp_s in self._digest_s.items()}

    def book_pick(self, replica_id: str, uncached_tokens: int = 0, now_s: float | None = None) -> None:
        """A pick-only choice (no request sent through Ray): count it as load until the next report
        or until it has probably finished (`PickCounts.in_flight`).

        `uncached_tokens`: the prompt tokens the replica must prefill for it (the router's
        estimate at the pick). Until the engine reports it, a pick is work of one queued
        request (tokens_per_queued_request) or of its own prefill, whichever is more: a
        cold 6,000-token prompt just sent is 6,000 tokens ahead of the next request there,
        not 256. Without it, a second new prefix arriving within the report period could
        land behind that prefill, and wait for it before its own first token. Not both: a short cold prompt must not
        cost its replica the affinity of the next request of the same prefix.
        """
        now_s = time.time() if now_s is None else now_s
        extra = max(0, uncached_tokens - self.state.tunables.tokens_per_queued_request)
        self._picks.book(replica_id, now_s)
        if extra:
            self._backlog.book(replica_id, extra, now_s)

    def snapshots(self, in_flight: Iterable[tuple[str, int | None]],
                  now_s: float | None = None) -> list[ReplicaSnapshot]:
        """One snapshot per (replica id, this router's in-flight count or None), in that order.

        `now_s`: wall-clock time, as for `sync` (the backlog drains with it).
        """
        now_s = time.time() if now_s is None else now_s
        out = []
        cache, picks_in_flight, pending_tokens = self._snapshots, self._picks.in_flight, self._backlog.tokens
        # Runs for every replica of every decision: a snapshot is rebuilt only when one of its
        # inputs changed, found by comparing them as one tuple.
        for rid, confirmed in in_flight:
            key = (confirmed or 0, picks_in_flight(rid, now_s), pending_tokens(rid, now_s))
            cached = cache.get(rid)
            if cached is None or cached[0] != key:
                confirmed, unreported, pending = key
                running, waiting, kv_usage, _, _, weight = self._reported.get(rid, _NOT_REPORTED)
                cached = cache[rid] = (key, ReplicaSnapshot(rid, max(confirmed, unreported), running, waiting,
                                                            kv_usage, pending, confirmed, unreported, weight))
            out.append(cached[1])
        return out
