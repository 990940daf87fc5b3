"""PendingPrefill: the uncached prompt tokens an engine replica has yet to prefill, reported to routers."""

from __future__ import annotations

from kvtide.deployments.engine.pending_prefill import PendingPrefill


def test_uncached_tokens_subtracts_whole_cached_blocks():
    """A prompt's uncached part: its tokens past the cached full blocks, never negative."""
    assert PendingPrefill.uncached_tokens(6128, 0, 16) == 6128
    assert PendingPrefill.uncached_tokens(6128, 375, 16) == 128
    assert PendingPrefill.uncached_tokens(100, 10, 16) == 0


def test_requests_count_until_first_token_or_end():
    """Booked on arrival, off at the first token; a second `done` (the stream's end) changes nothing."""
    pending = PendingPrefill()
    pending.start("r1", 6000)
    pending.start("r2", 128)
    assert (pending.total_tokens, len(pending)) == (6128, 2)
    pending.done("r1")
    pending.done("r1")
    assert (pending.total_tokens, len(pending)) == (128, 1)


def test_a_reused_request_id_is_counted_once():
    """Starting an id already pending replaces its count (a retry under the same id must not double it)."""
    pending = PendingPrefill()
    pending.start("r1", 6000)
    pending.start("r1", 100)
    assert pending.total_tokens == 100
    pending.done("r1")
    assert pending.total_tokens == 0


def test_drain_rate_is_prefilled_tokens_over_busy_seconds():
    """Tokens taken off by first tokens over the seconds the backlog was non-empty; idle time does not dilute it."""
    pending = PendingPrefill(rate_tau_s=1e9)  # no decay: exact sums
    assert pending.drain_rate_tokens_per_s(0.0) == 0.0  # nothing prefilled yet: unknown
    pending.start("r1", 2000, now_s=0.0)
    pending.done("r1", prefilled=True, now_s=0.1)  # 2,000 tokens in 0.1 s
    pending.start("r2", 1000, now_s=5.0)  # 4.9 idle seconds in between
    pending.done("r2", prefilled=True, now_s=5.1)
    assert abs(pending.drain_rate_tokens_per_s(9.0) - 15_000.0) < 1e-3  # 3,000 tokens / 0.2 busy s


def test_aborted_requests_leave_the_books_without_raising_the_rate():
    """An abort before the first token drains its tokens from the backlog but not into the rate."""
    pending = PendingPrefill(rate_tau_s=1e9)
    pending.start("r1", 1000, now_s=0.0)
    pending.start("gone", 9000, now_s=0.0)
    pending.done("gone", now_s=0.05)  # aborted
    pending.done("r1", prefilled=True, now_s=0.1)
    assert pending.total_tokens == 0
    assert abs(pending.drain_rate_tokens_per_s(0.1) - 10_000.0) < 1e-3


def test_drain_rate_follows_a_change_of_speed():
    """Decayed sums: after a few time constants at a new speed, the rate reads the new speed, not the average."""
    pending = PendingPrefill(rate_tau_s=1.0)
    t = 0.0
    for i in range(20):  # 20,000 tokens/s
        pending.start(f"fast{i}", 2000, now_s=t)
        pending.done(f"fast{i}", prefilled=True, now_s=t + 0.1)
        t += 0.2
    for i in range(50):  # then 5,000 tokens/s for 10 s of busy time
        pending.start(f"slow{i}", 1000, now_s=t)
        pending.done(f"slow{i}", prefilled=True, now_s=t + 0.2)
        t += 0.2
    assert 4_500 < pending.drain_rate_tokens_per_s(t) < 5_500
