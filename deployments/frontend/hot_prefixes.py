"""The fleet's hottest shared prompt prefixes, as a router sees them (for cache-warm scale-up).

Every request passes through a router (the routing peer, or an Ingress replica), already
tokenized and block-hashed, so it can tell which prefixes many requests share. A new engine replica asks for
them before it takes traffic and prefills them (autoscaling.warm_start plans which),
so a scale-up under a hot system prompt does not start with a burst of cold prefills.

    key        = hash of the request's FIRST full block (one entry per distinct start)
    entry      = (longest block-aligned prefix shared by the requests with that key,
                  decayed hit count)

The shared prefix of an entry only shrinks: it starts as the first request's full
blocks and becomes the common prefix with every later request of that key, so after
two requests it is the shared system prompt, not one user's question. Hit counts decay
by half every `half_life_s`, so yesterday's hot prompt gives way to today's. At most
`max_entries` keys are kept; the coldest is dropped first. Time is a parameter.

Cost per request, because the routing peer observes every POST before HAProxy forwards it:
- Eviction by a heap, not a scan. Every entry decays at the same rate, so the order of decayed
  scores never changes between updates: `log2(score) + updated_s / half_life_s` ranks entries
  at any time, and changes only when an entry is counted. A full table met by a new key (every
  unique prompt) then pops the coldest in O(log n) instead of scanning all entries and
  decaying each, which would cost every request O(max_entries) once the table is full.
- The shared prefix is found by comparing block hashes (chained: equal through block i means
  equal tokens through block i), one per block, not the tokens one at a time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

# Stale heap items (entries counted again or dropped) are compacted away past this many per entry.
_HEAP_ITEMS_PER_ENTRY = 4


@dataclass
class _Entry:
    tokens: list[int]
    hashes: tuple[int, ...]  # the block hashes of `tokens`
    cache_salt: str | None  # the salt they were hashed under (salted hashes keep each salt's entries apart)
    score: float
    updated_s: float
    stamp: int = 0  # names this entry's one live heap item


class HotPrefixTracker:
    """Bounded, decayed counts of shared prefixes keyed by their first block."""

    def __init__(self, block_size: int, max_entries: int = 256, half_life_s: float = 300.0):
        self.block_size = block_size
        self.max_entries = max_entries
        self.half_life_s = half_life_s
        self._entries: dict[int, _Entry] = {}
        self._heap: list[tuple[float, int, int]] = []  # (rank, stamp, key); the coldest first
        self._stamps = itertools.count()

    def _decayed(self, entry: _Entry, now_s: float) -> float:
        return entry.score * 0.5 ** (max(0.0, now_s - entry.updated_s) / self.half_life_s)

    def _rank(self, entry: _Entry) -> float:
        # log2 of the decayed score plus now / half_life: the same order as _decayed at any now.
        return math.log2(entry.score) + entry.updated_s / self.half_life_s

    def _push(self, key: int, entry: _Entry) -> None:
        entry.stamp = next(self._stamps)
        heapq.heappush(self._heap, (self._rank(entry), entry.stamp, key))
        if len(self._heap) > _HEAP_ITEMS_PER_ENTRY * self.max_entries + 64:
            self._heap = [(self._rank(e), e.stamp, k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)

    def _drop_coldest(self) -> None:
        while self._heap:
            _, stamp, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is not None and entry.stamp == stamp:
                del self._entries[key]
                return

    def observe(self, token_ids: Sequence[int], block_hashes: Sequence[int], now_s: float,
                cache_salt: str | None = None) -> None:
        """Count one request (its prompt tokens and their full-block hashes, under `cache_salt`)."""
        if not block_hashes:
            return
        key = block_hashes[0]
        full = len(block_hashes) * self.block_size
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self.max_entries:
                self._drop_coldest()
            entry = self._entries[key] = _Entry(list(token_ids[:full]), tuple(block_hashes), cache_salt, 1.0, now_s)
            self._push(key, entry)
            return
        shared = entry.hashes
        blocks = 0
        for mine, theirs in zip(shared, block_hashes):  # whole blocks only: vLLM caches no less
            if mine != theirs:
                break
            blocks += 1
        if blocks < len(shared):
            entry.hashes = shared[:blocks]
            del entry.tokens[blocks * self.block_size:]
        entry.score = self._decayed(entry, now_s) + 1.0
        entry.updated_s = now_s
        self._push(key, entry)

    def hottest(self, now_s: float, limit: int = 32, min_hits: float = 2.0) -> list[tuple]:
        """Shared prefixes seen at least `min_hits` (decayed) times, hottest first: (tokens, hits), or
        (tokens, hits, cache salt) for a salted one (autoscaling.warm_start prefills it under its salt)."""
        ranked = sorted(((e.tokens, self._decayed(e, now_s), e.cache_salt) for e in self._entries.values() if e.tokens),
                        key=lambda item: item[1], reverse=True)
        return [(list(tokens), score, salt) if salt is not None else (list(tokens), score)
                for tokens, score, salt in ranked if score >= min_hits][:limit]
