"""The ingress's view of hot shared prefixes, which a new replica prefills (warm start)."""

from __future__ import annotations

from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
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


class _ScanTracker:
    """The reference: the same counts, the coldest found by scanning every entry's decayed score."""

    def __init__(self, block_size: int, max_entries: int, half_life_s: float):
        self.block_size, self.max_entries, self.half_life_s = block_size, max_entries, half_life_s
        self.entries: dict[int, list] = {}  # key -> [tokens, score, updated_s]

    def decayed(self, entry: list, now_s: float) -> float:
        return entry[1] * 0.5 ** (max(0.0, now_s - entry[2]) / self.half_life_s)

    def observe(self, tokens: list[int], now_s: float) -> None:
        full = len(tokens) // self.block_size * self.block_size
        if not full:
            return
        key = tuple(tokens[:self.block_size])
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.max_entries:
                del self.entries[min(self.entries, key=lambda k: self.decayed(self.entries[k], now_s))]
            self.entries[key] = [tokens[:full], 1.0, now_s]
            return
        common = 0
        while common < min(len(entry[0]), full) and entry[0][common] == tokens[common]:
            common += 1
        entry[0] = entry[0][:common - common % self.block_size]
        entry[1], entry[2] = self.decayed(entry, now_s) + 1.0, now_s


def test_heap_eviction_and_hash_prefixes_match_a_full_scan_over_a_random_stream():
    """Over 3,000 random requests (shared starts, diverging tails, rising times), the tracker keeps the same
    entries, prefixes and scores as scanning every entry for the coldest, and its heap stays bounded."""
    import random

    rng = random.Random(5)
    fast, scan = HotPrefixTracker(BS, max_entries=16, half_life_s=7.0), _ScanTracker(BS, 16, 7.0)
    starts = [[rng.randrange(50) for _ in range(BS)] for _ in range(40)]
    now_s = 0.0
    for _ in range(3000):
        now_s += rng.expovariate(5.0)
        start = starts[min(int(rng.paretovariate(1.2)) - 1, len(starts) - 1)]
        tokens = start + [rng.randrange(3) for _ in range(rng.randrange(0, 5 * BS))]
        _observe(fast, tokens, now_s)
        scan.observe(tokens, now_s)
        assert len(fast._heap) <= 4 * 16 + 64 + 1
    got = sorted((tuple(t), round(s, 9)) for t, s in fast.hottest(now_s, limit=100, min_hits=0))
    want = sorted((tuple(e[0]), round(scan.decayed(e, now_s), 9)) for e in scan.entries.values() if e[0])
    assert got == want and len(want) > 8
