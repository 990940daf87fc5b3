"""Pick-only load: a pick counts while it has probably not finished, by the engine's recent request durations."""

from __future__ import annotations

import random

import pytest

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.fleet import FleetView
from kvtide.deployments.routing.pick_load import PickCounts, RecentDurations
from kvtide.deployments.routing.policy import RouterState
from kvtide.deployments.routing.snapshot import CacheDigest


def test_recent_durations_report_the_middle_of_equal_shares():
    """Quantiles at 12.5/37.5/62.5/87.5 % of the last requests, ascending; none before the first request."""
    durations = RecentDurations(size=8)
    assert durations.quantiles() == ()
    for seconds in (0.8, 0.1, 0.7, 0.2, 0.6, 0.3, 0.5, 0.4):
        durations.observe(seconds)
    assert durations.quantiles() == (0.2, 0.4, 0.6, 0.8)
    for _ in range(8):  # the window keeps the last 8: the older ones leave it
        durations.observe(5.0)
    assert durations.quantiles() == (5.0, 5.0, 5.0, 5.0)


def test_without_reported_durations_every_pick_counts_until_the_report():
    """An engine that has finished nothing yet (or reports no durations): each pick since the report counts whole."""
    counts = PickCounts()
    counts.on_report("a", 1.0)
    for t in (1.0, 1.1, 1.2):
        counts.book("a", t)
    assert counts.in_flight("a", 100.0) == 3
    assert counts.on_report("a", 2.0) and counts.in_flight("a", 100.0) == 0


@pytest.mark.parametrize("now_s, expected", [
    (10.05, 4),  # every pick younger than the shortest quantile: all running
    (10.35, 3),  # ages 0.35/0.25/0.15/0.05 against quantiles 0.1/0.2/0.4/0.8: (1 + 2 + 4 + 4) / 4 = 2.75
    (10.75, 1),  # ages 0.75/0.65/0.55/0.45: only the 0.8 quantile exceeds them, (0 + 0 + 0 + 4) / 4
    (11.2, 0),   # every pick older than the longest quantile: all done
])
def test_a_pick_counts_as_the_share_of_recent_requests_that_took_longer_than_its_age(now_s, expected):
    """Expected picks in flight = Σ over picks of the share of recent durations above the pick's age, rounded."""
    counts = PickCounts()
    counts.on_report("a", 1.0, (0.1, 0.2, 0.4, 0.8))
    for t in (10.0, 10.1, 10.2, 10.3):
        counts.book("a", t)
    assert counts.in_flight("a", now_s) == expected


def test_the_kept_estimate_equals_one_computed_afresh_at_every_moment():
    """The estimate kept between decisions (valid until a pick crosses a quantile's age) is what a fresh count gives."""
    rng = random.Random(7)
    durations = (0.05, 0.2, 0.3, 1.0)
    kept, now_s, booked = PickCounts(), 0.0, []
    kept.on_report("a", 0.0, durations)
    for _ in range(2000):
        now_s += rng.expovariate(40.0)
        if rng.random() < 0.3:
            kept.book("a", now_s)
            booked.append(now_s)
        fresh = PickCounts()
        fresh.on_report("a", 0.0, durations)
        for t in booked:
            fresh.book("a", t)
        assert kept.in_flight("a", now_s) == fresh.in_flight("a", now_s)


BS = 16
GROUP_A = block_hashes([1] + list(range(1800)), BS)
GROUP_B = block_hashes([2] + list(range(1800)), BS)


def _sequential_picks(durations_s: tuple[float, ...]) -> list[str]:
    """One client's requests of two prefix groups in turn, every 16 ms, each done before the next (a GPU's
    short hits), through a pick-only router on two idle replicas, x holding A and y holding B. x's report
    was taken while an earlier long request of A ran, and no newer one comes within the second; y's next
    report arrives just before A's last request. The replica each A request is sent to."""
    view = FleetView(RouterState(RoutingConfig(), BS))

    def report(seq: int, now_s: float) -> None:
        view.sync({"x": {"digest": CacheDigest.from_hashes("x", 1, 1, GROUP_A), "reported_s": 1.0,
                         "num_running": 1, "request_durations_s": durations_s},
                   "y": {"digest": CacheDigest.from_hashes("y", 1, seq, GROUP_B), "reported_s": now_s,
                         "request_durations_s": durations_s}}, now_s=now_s)

    report(1, 1.0)
    sent_to = []
    for i in range(60):
        now_s = 1.0 + 0.016 * i
        if i == 58:
            report(2, now_s)
        hashes = GROUP_A if i % 2 == 0 else GROUP_B
        decision = view.state.rank(hashes, view.snapshots([("x", None), ("y", None)], now_s=now_s),
                                   random.Random(0), now_s=now_s)
        view.book_pick(decision.ranked[0], len(hashes) * BS - decision.matched_tokens, now_s=now_s)
        view.state.on_routed(decision.ranked[0], hashes, now_s)
        if hashes is GROUP_A:
            sent_to.append(decision.ranked[0])
    return sent_to


def test_one_clients_sequential_requests_keep_their_prefix_between_reports():
    """Finished picks are not phantom load: a sequential client's prefix stays on its holder on an idle fleet.

    Counted whole until x's next report, A's 29 picks plus the running request x reported put x over the
    guard (30 > 1.25 × mean 15 + 2 + the prompt's 7 requests) the moment y's fresh report zeroes y's count:
    A's last request would go to y, a cold prefill on an idle fleet."""
    assert _sequential_picks(durations_s=(0.012, 0.014, 0.014, 0.016)) == ["x"] * 30
    assert _sequential_picks(durations_s=()) == ["x"] * 29 + ["y"]  # no durations: every pick counts whole


@pytest.mark.parametrize("reported", [["soon"], [float("nan")], [-1.0], "0.1", None])
def test_malformed_durations_count_every_pick_whole(reported):
    """A report whose durations are not non-negative numbers is read as none: picks count until the next report."""
    view = FleetView(RouterState(RoutingConfig(), BS))
    view.sync({"x": {"reported_s": 1.0, "request_durations_s": reported}}, now_s=1.0)
    view.book_pick("x", now_s=1.0)
    assert view.snapshots([("x", None)], now_s=60.0)[0].num_queued_requests == 1
