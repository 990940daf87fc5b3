"""Load as a pick-only router sees it: the engine's last report plus the picks made since.

In direct mode a routing peer asks Ray Serve's router to name a replica
(`choose_replica(..., _reserve=False)`) and HAProxy sends the request. Ray then neither
probes queue lengths nor calls the router's `on_request_routed`, and its queue-length
cache stays empty: every router must count its own picks. A pick counts as one request
on its replica until that replica's next stats report (`record_routing_stats`, stamped
`reported_s`), whose running + waiting numbers include it from then on.

    PickCounts     picks per replica since its last report (prefix_aware's FleetView books their
                   prefill tokens in its backlog, `deployments.routing.backlog`)
    PickOnlyLoad   max(picks since the report, reported running + waiting): the queue a
                   load-balancing baseline (pow2, Ray's prefix router) compares in pick-only mode
"""

from __future__ import annotations

from typing import Any, Mapping


class PickCounts:
    """Pick-only choices per replica since the replica's last stats report."""

    def __init__(self) -> None:
        self.picks: dict[str, int] = {}  # read directly on the decision path
        self._reported_s: dict[str, Any] = {}

    def on_report(self, replica_id: str, reported_s: Any) -> bool:
        """A replica's stats arrived: if they are a new report (True), its picks are in its numbers now."""
        if reported_s == self._reported_s.get(replica_id):
            return False
        self._reported_s[replica_id] = reported_s
        self.picks[replica_id] = 0
        return True

    def book(self, replica_id: str) -> None:
        self.picks[replica_id] = self.picks.get(replica_id, 0) + 1

    def forget(self, replica_id: str) -> None:
        self.picks.pop(replica_id, None)
        self._reported_s.pop(replica_id, None)


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
        return max(self.counts.picks.get(replica_id, 0), self._reported.get(replica_id, 0))
