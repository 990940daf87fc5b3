"""Engine side of the digest protocol: turn a block set's changes into CacheDigests.

The owner of a block set (`KvCacheTracker` in an engine replica, the microbenchmark's
simulated engines) tells the journal each time a block enters or leaves the set, and asks
it for a digest once per report period (protocol: `deployments.routing.snapshot`):

    stored(h)          h entered the set          pending: +h, or cancels a pending -h
    removed(h)         h left the set             pending: -h, or cancels a pending +h
    cleared(held)      the cache was reset        every held block pending removal; flag
    digest(held, now)  sequence += 1              pending → this report's delta, appended to
                                                  the chain (the last `delta_window`); the
                                                  full set too on the first report and
                                                  every `full_every` reports

Net changes per period, not events: a block stored and evicted between two reports never
reaches a router, and the pending sets are bounded by the blocks that changed, not by
the event rate. Pure (no clock, no I/O); not thread-safe (the tracker's owner locks).
"""

from __future__ import annotations

from collections import deque
from typing import Collection

from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.snapshot import BlockDelta, CacheDigest, pack_hashes

# Four reports: a router bridges up to three lost or coalesced reports without a full set.
DEFAULT_DELTA_WINDOW = 4
# A full set every 5 reports (~5 s at the default 1 s period): how long a router that
# started late or missed more than the window waits for engine truth. 100k held blocks
# cost 800 KB per full set, so this is 160 KB/s instead of the 800 KB/s of a full set per report.
DEFAULT_FULL_EVERY = 5


class DigestJournal:
    """Pending changes since the last report, the recent deltas, and the report sequence of one engine."""

    def __init__(self, replica_id: str, epoch: int, *, delta_window: int = DEFAULT_DELTA_WINDOW,
                 full_every: int = DEFAULT_FULL_EVERY):
        if delta_window < 1:
            raise ValueError(f"delta_window must be at least 1, got {delta_window}")
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        self.replica_id = replica_id
        self.epoch = epoch
        self.full_every = full_every
        self.sequence = 0  # of the last digest built; an engine lifetime starts empty at 0
        self._stored: set[BlockHash] = set()
        self._removed: set[BlockHash] = set()
        self._cleared = False
        self._chain: deque[BlockDelta] = deque(maxlen=delta_window)

    def stored(self, block_hash: BlockHash) -> None:
        """`block_hash` entered the set (it was not held)."""
        if block_hash in self._removed:
            self._removed.discard(block_hash)  # held at the last report after all: no net change
        else:
            self._stored.add(block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        """`block_hash` left the set (it was held)."""
        if block_hash in self._stored:
            self._stored.discard(block_hash)  # entered and left within one period: never reported
        else:
            self._removed.add(block_hash)

    def cleared(self, held: Collection[BlockHash]) -> None:
        """The whole set (`held`, before the reset) was dropped at once."""
        for block_hash in held:
            self.removed(block_hash)
        self._cleared = True

    def digest(self, held: Collection[BlockHash], now_s: float) -> CacheDigest:
        """This period's report; `held` is the set now (read only when a full set is due)."""
        self.sequence += 1
        delta = BlockDelta(self.sequence, pack_hashes(self._stored), pack_hashes(self._removed), self._cleared)
        self._stored, self._removed, self._cleared = set(), set(), False
        self._chain.append(delta)
        full = pack_hashes(held) if self._full_due() else None
        return CacheDigest(self.replica_id, self.epoch, self.sequence, full, delta.all_cleared, now_s,
                           tuple(self._chain))

    def _full_due(self) -> bool:
        # Sequence 1, 1 + full_every, ...: the first report of a lifetime is full, so a
        # router that sees it needs no chain, and then one in every `full_every`.
        return (self.sequence - 1) % self.full_every == 0
