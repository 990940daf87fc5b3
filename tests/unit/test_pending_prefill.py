"""PendingPrefill: the uncached prompt tokens an engine replica has yet to prefill, reported to routers."""

from __future__ import annotations

from kvtide.deployments.pending_prefill import PendingPrefill


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
