"""The ingress's view of hot shared prefixes, which a new replica prefills (warm start)."""

from __future__ import annotations

from kvtide.deployments.hot_prefixes import HotPrefixTracker
from kvtide.deployments.routing.block_hash import block_hashes

BS = 4


def _observe(tracker: HotPrefixTracker, tokens: list[int], now_s: float = 0.0) -> None:
    tracker.observe(tokens, block_hashes(tokens, BS), now_s)


def test_shared_system_prompt_is_found_block_aligned():
    """Requests sharing a 10-token system prompt yield its block-aligned 8-token prefix."""
    t = HotPrefixTracker(BS)
    system = list(range(1, 11))
    _observe(t, system + [50, 51, 52, 53, 54, 55])
    _observe(t, system + [60, 61, 62, 63, 64, 65])
    assert t.hottest(0.0) == [(system[:8], 2.0)]


def test_single_requests_are_not_hot():
    """A prefix seen once (a unique prompt) is not offered for warm-up."""
    t = HotPrefixTracker(BS)
    _observe(t, list(range(20)))
    assert t.hottest(0.0) == []


def test_hotter_first_and_decay_over_time():
    """Counts decay by half per half-life, so an old hot prefix ranks below a fresh one."""
    t = HotPrefixTracker(BS, half_life_s=10.0)
    old, new = list(range(100, 108)), list(range(200, 208))
    for _ in range(4):
        _observe(t, old, now_s=0.0)
    for _ in range(3):
        _observe(t, new, now_s=20.0)
    ranked = t.hottest(20.0)
    assert [tokens for tokens, _ in ranked] == [new] and ranked[0][1] == 3.0  # old decayed to 1.0


def test_bounded_entries_drop_the_coldest():
    """At capacity, a new key evicts the coldest one."""
    t = HotPrefixTracker(BS, max_entries=2)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    _observe(t, a), _observe(t, a), _observe(t, b), _observe(t, c)
    keys = {tuple(tokens) for tokens, _ in t.hottest(0.0, min_hits=0)}
    assert keys == {tuple(a), tuple(c)}


def test_prompts_shorter_than_a_block_are_ignored():
    """No full block, nothing to cache, nothing tracked."""
    t = HotPrefixTracker(BS)
    _observe(t, [1, 2])
    _observe(t, [1, 2])
    assert t.hottest(0.0, min_hits=0) == []
