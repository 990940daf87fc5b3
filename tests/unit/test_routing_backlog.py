"""PrefillBacklog: each replica's reported + booked prefill tokens, drained between reports at the engine's rate."""

from __future__ import annotations

from kvtide.deployments.routing.backlog import PrefillBacklog


def test_a_report_is_drained_by_its_age_at_the_engines_rate():
    """2,048 tokens reported 1/16 s ago at 16,000 tokens/s: 1,048 left now, none 0.2 s after the report."""
    backlog = PrefillBacklog(quantum_tokens=1)
    backlog.on_report("a", 2048, 16_000.0, reported_s=100.0, now_s=100.0625)
    assert backlog.tokens("a", 100.0625) == 1048
    assert backlog.tokens("a", 100.2) == 0


def test_without_a_rate_the_backlog_is_the_report_plus_bookings_exactly():
    """An engine that reports no rate (0): nothing drains, bookings add up, no rounding (the undrained view)."""
    backlog = PrefillBacklog()
    backlog.on_report("a", 100, 0.0, reported_s=1.0, now_s=50.0)
    backlog.book("a", 5744, now_s=51.0)
    assert backlog.tokens("a", 99.0) == 5844


def test_a_booking_drains_from_when_it_was_made_after_what_was_left():
    """A pick booked mid-period adds to what is left of the report then, and drains from that moment."""
    backlog = PrefillBacklog(quantum_tokens=1)
    backlog.on_report("a", 1000, 8_000.0, reported_s=0.0, now_s=0.0)
    backlog.book("a", 2000, now_s=0.5)  # the report drained away at 0.125 s: only the booking is left
    assert backlog.tokens("a", 0.5) == 2000
    assert backlog.tokens("a", 0.625) == 1000
    assert backlog.tokens("a", 1.0) == 0


def test_clock_skew_and_old_reports_are_clamped():
    """A report stamped in the future drains nothing; one older than max_age_s drains only max_age_s' worth."""
    backlog = PrefillBacklog(quantum_tokens=1, max_age_s=1.0)
    backlog.on_report("a", 5000, 1000.0, reported_s=10.0, now_s=9.0)
    assert backlog.tokens("a", 9.0) == 5000
    backlog.on_report("b", 5000, 1000.0, reported_s=0.0, now_s=60.0)
    assert backlog.tokens("b", 60.0) == 4000


def test_drained_values_round_up_to_the_quantum():
    """While draining, the value moves in quantum steps (the router's snapshot is rebuilt only when it changes)."""
    backlog = PrefillBacklog(quantum_tokens=64)
    backlog.on_report("a", 1000, 1000.0, reported_s=0.0, now_s=0.0)
    assert backlog.tokens("a", 0.0) == 1024
    assert backlog.tokens("a", 0.001) == 1024  # 999 left
    assert backlog.tokens("a", 0.99) == 64  # 10 left
    assert backlog.tokens("a", 1.0) == 0
    backlog.forget("a")
    assert backlog.tokens("a", 0.0) == 0


def test_a_drained_backlog_stays_empty_until_a_report_or_booking_refills_it():
    """Past its empty time a backlog reads 0 (also for a query just before it was set); a booking restarts it."""
    backlog = PrefillBacklog(quantum_tokens=1)
    backlog.on_report("a", 500, 1000.0, reported_s=10.0, now_s=10.0)
    assert backlog.tokens("a", 10.5) == 0 and backlog.tokens("a", 99.0) == 0
    backlog.book("a", 300, now_s=100.0)
    assert backlog.tokens("a", 100.125) == 175
    backlog.on_report("b", 0, 0.0, reported_s=5.0, now_s=5.0)
    assert backlog.tokens("b", 4.0) == 0 and backlog.tokens("b", 6.0) == 0
    assert PrefillBacklog().tokens("never-reported", 1.0) == 0
