"""Load as a pick-only router sees it: the engine's last report plus the picks made since.

In direct mode a routing peer asks Ray Serve's router to name a replica
(`choose_replica(..., _reserve=False)`) and HAProxy sends the request. Ray then neither
probes queue lengths nor calls the router's `on_request_routed`, and its queue-length
cache stays empty: every router must count its own picks. A pick is on its replica until
that replica's next stats report (`record_routing_stats`, stamped `reported_s`), whose
running + waiting numbers include it from then on, or until it has probably finished.

Why "probably finished": the router never sees a pick-only request end. Counted whole
until the next report (up to a stats period, ~1 s), one client's sequential requests
(each done in tens of milliseconds, a GPU's short hits) pile up as phantom load on the
replica holding their prefix while a replica whose report just arrived counts none, and
the load guard then sends the next one elsewhere: a cold prefill on an idle fleet. So a
pick of age a counts as the chance that it is still running, the share of the replica's
recent requests that took longer than a (`RecentDurations`, the engine's own end-to-end
times, reported with its load). Summed over the picks since the report, that is their
expected number in flight; with no finished request reported yet every pick counts whole.
Under load, durations grow with the queue, and picks count for longer, so a burst
between reports still steers picks.

    RecentDurations  the engine side: the last requests' end-to-end seconds, reported as a
                     few quantiles, each standing for an equal share of them
    PickCounts       picks per replica since its last report, with their times: all of them
                     (`count`), or those probably still in flight (`in_flight`) (prefix_aware's
                     FleetView books their prefill tokens in its backlog, `deployments.routing.backlog`)
    PickOnlyLoad     max(picks since the report, reported running + waiting): the queue a
                     load-balancing baseline (pow2, Ray's prefix router) compares in pick-only
                     mode (Ray's own routers have no such estimate: the baselines keep the count)
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from typing import Any, Mapping, Sequence

# Finished requests an engine keeps (the window the quantiles describe): enough that one
# odd request moves a quantile little, few enough to follow a change of workload within
# a few dozen requests.
RECENT_REQUESTS = 64
# Quantiles reported, at the middle of equal shares (12.5, 37.5, 62.5, 87.5 %): the router
# sums, per pick, how many of them exceed its age.
NUM_QUANTILES = 4


class RecentDurations:
    """End-to-end seconds of an engine's last `RECENT_REQUESTS` finished requests."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._seconds: deque[float] = deque(maxlen=size)

    def observe(self, seconds: float) -> None:
        self._seconds.append(max(0.0, float(seconds)))

    def quantiles(self, num: int = NUM_QUANTILES) -> tuple[float, ...]:
        """The middle of each of `num` equal shares of the recent durations, ascending; () before any."""
        ordered = sorted(self._seconds)
        if not ordered:
            return ()
        return tuple(ordered[min(len(ordered) - 1, int((k + 0.5) * len(ordered) / num))] for k in range(num))


class PickCounts:
    """Pick-only choices per replica since the replica's last stats report."""

    def __init__(self) -> None:
        self._reported_s: dict[str, Any] = {}
        self._times: dict[str, list[float]] = {}  # replica → its picks' times since the report, ascending
        self._durations: dict[str, Sequence[float]] = {}  # replica → RecentDurations.quantiles(), () unknown
        # replica → (in flight, from, until): the estimate is a step function of time, and holds
        # until the next pick crosses a quantile's age. A decision reads it for every replica;
        # recomputing it every time was a large share of the decision (benchmarks/router_microbench.py).
        self._estimates: dict[str, tuple[int, float, float]] = {}

    def on_report(self, replica_id: str, reported_s: Any, durations_s: Sequence[float] = ()) -> bool:
        """A replica's stats arrived: if they are a new report (True), its picks are in its numbers now."""
        if durations_s != self._durations.get(replica_id):
            self._durations[replica_id] = durations_s
            self._estimates.pop(replica_id, None)
        if reported_s == self._reported_s.get(replica_id):
            return False
        self._reported_s[replica_id] = reported_s
        self._times[replica_id] = []
        self._estimates.pop(replica_id, None)
        return True

    def book(self, replica_id: str, now_s: float = 0.0) -> None:
        self._times.setdefault(replica_id, []).append(now_s)
        self._estimates.pop(replica_id, None)

    def count(self, replica_id: str) -> int:
        """Every pick since the report, finished or not."""
        return len(self._times.get(replica_id, ()))

    def in_flight(self, replica_id: str, now_s: float) -> int:
        """The picks since the report expected to be running still at `now_s`, rounded to the nearest."""
        estimate = self._estimates.get(replica_id)
        if estimate is not None and estimate[1] <= now_s < estimate[2]:
            return estimate[0]
        times = self._times.get(replica_id)
        if not times:
            return 0
        durations = self._durations.get(replica_id)
        if not durations:
            return len(times)
        # A pick of age a is running with chance (quantiles above a) / (quantiles): the picks
        # younger than a quantile q are those made after now − q, and the oldest of them stops
        # being younger than q at its time + q.
        running, until_s = 0, math.inf
        for q in durations:
            oldest_younger = bisect_right(times, now_s - q)
            if oldest_younger < len(times):
                running += len(times) - oldest_younger
                until_s = min(until_s, times[oldest_younger] + q)
        value = (2 * running + len(durations)) // (2 * len(durations))
        self._estimates[replica_id] = (value, now_s, until_s)
        return value

    def forget(self, replica_id: str) -> None:
        for table in (self._reported_s, self._times, self._durations, self._estimates):
            table.pop(replica_id, None)


class PickOnlyLoad:
    """Requests ahead of a new one per replica, for a router whose picks Ray does not count."""

    def __init__(self) -> None:
        self.counts = PickCounts()
        self._reported: dict[str, int] = {}  # replica → running + waiting at its last report

    def sync(self, stats_by_replica: Mapping[str, Mapping[str, Any]]) -> None:
        """The latest routing stats of every live replica; replicas not listed are forgotten."""
        for rid, stats in stats_by_replica.items():
            self.counts.on_report(rid, stats.get("reported_s"))
            self._reported[rid] = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
        for gone in set(self._reported) - set(stats_by_replica):
            del self._reported[gone]
            self.counts.forget(gone)

    def book(self, replica_id: str) -> None:
        self.counts.book(replica_id)

    def queued(self, replica_id: str) -> int:
        """Whichever view counts more: this router's picks since the report, or the report itself."""
        return max(self.counts.count(replica_id), self._reported.get(replica_id, 0))
