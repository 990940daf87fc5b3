"""The fleet's hottest shared prompt prefixes, as the ingress sees them (for cache-warm scale-up).

Every request passes through an ingress, already tokenized and block-hashed, so the
ingress can tell which prefixes many requests share. A new engine replica asks for
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class _Entry:
    tokens: list[int]
    score: float
    updated_s: float


class HotPrefixTracker:
    """Bounded, decayed counts of shared prefixes keyed by their first block."""

    def __init__(self, block_size: int, max_entries: int = 256, half_life_s: float = 300.0):
        self.block_size = block_size
        self.max_entries = max_entries
        self.half_life_s = half_life_s
        self._entries: dict[int, _Entry] = {}

    def _decayed(self, entry: _Entry, now_s: float) -> float:
        return entry.score * 0.5 ** (max(0.0, now_s - entry.updated_s) / self.half_life_s)

    def observe(self, token_ids: Sequence[int], block_hashes: Sequence[int], now_s: float) -> None:
        """Count one request (its prompt tokens and their full-block hashes)."""
        if not block_hashes:
            return
        key = block_hashes[0]
        full = len(block_hashes) * self.block_size
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self.max_entries:
                coldest = min(self._entries, key=lambda k: self._decayed(self._entries[k], now_s))
                del self._entries[coldest]
            self._entries[key] = _Entry(list(token_ids[:full]), 1.0, now_s)
            return
        common = 0
        limit = min(len(entry.tokens), full)
        while common < limit and entry.tokens[common] == token_ids[common]:
            common += 1
        common -= common % self.block_size  # vLLM caches whole blocks only
        if common < len(entry.tokens):
            del entry.tokens[common:]
        entry.score = self._decayed(entry, now_s) + 1.0
        entry.updated_s = now_s

    def hottest(self, now_s: float, limit: int = 32, min_hits: float = 2.0) -> list[tuple[list[int], float]]:
        """Shared prefixes seen at least `min_hits` (decayed) times, hottest first."""
        ranked = sorted(((e.tokens, self._decayed(e, now_s)) for e in self._entries.values() if e.tokens),
                        key=lambda item: item[1], reverse=True)
        return [(list(tokens), score) for tokens, score in ranked if score >= min_hits][:limit]
