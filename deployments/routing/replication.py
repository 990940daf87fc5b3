"""Hot-prefix replication: spread a prefix group that outgrows one replica over k chosen replicas.

Without it, a shared prefix (a system prompt most traffic uses) piles onto the replica
holding its KV blocks until the load guard trips, and from then on the overflow goes to
whichever replica is least loaded: cold prefills sprayed over the fleet, each evicting
something else. With it, the group's demand is estimated, and once it exceeds what one
replica should carry, the policy treats a fixed set of k replicas as holders of the
group's shared prefix, so load spreads over them deliberately (policy.py, "replicate").

    group key    hash of the request's first `key_blocks` blocks (the block at that depth
                 names the whole prefix up to it: hashes are chained)
    PrefixDemand per group: an exponentially decayed request count and the group's shared
                 prefix (the common prefix of its requests' hashes, capped)
    share        decayed count of the group / decayed count of all requests
    demand       share × Σ load over the replicas   (the group's estimated requests in flight)
    k            ceil(demand / (replication_fill × guard limit)), within 1..max_replicas, ≤ N
    set          the top k replicas by rendezvous weight of the group key (rendezvous.py):
                 every router computes the same set from the same replica ids

Decay without per-entry timers: an arrival at `now_s` adds 2^((now_s - base_s) / half_life_s)
to its group and to the total, so older arrivals weigh exponentially less and a share is
a ratio of two sums, read in O(1); the weights are rescaled (base_s moved) every 64
half-lives so they stay finite. At most `max_groups` groups are kept; when full, the
colder half is dropped (amortized O(log n) per new group). Time is always a parameter.
"""

from __future__ import annotations

import math
from typing import Sequence

from kvtide.deployments.routing import rendezvous
from kvtide.deployments.routing.block_hash import BlockHash

_RESCALE_AFTER_HALF_LIVES = 64.0
_MAX_MEMO_SETS = 1024
# Shared prefixes longer than this many blocks get credit for this many (8k tokens at block
# size 32: already worth 32 queued requests); it bounds a group's memory to one slice of hashes.
MAX_SHARED_BLOCKS = 256


def group_key(hashes: Sequence[BlockHash], key_blocks: int) -> BlockHash | None:
    """The prefix group of a request: the hash of its first `key_blocks` blocks (all of them if fewer)."""
    if not hashes:
        return None
    return hashes[min(len(hashes), key_blocks) - 1]


def key_blocks_for(key_tokens: int, block_size: int) -> int:
    """Whole blocks in the group key: `key_tokens` rounded down, at least one."""
    return max(1, key_tokens // block_size)


def common_prefix_blocks(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """Leading blocks `a` and `b` share, by binary search.

    Chained hashes make "a[i] == b[i]" true for every i below the first difference and
    false after it, so the boundary is found in O(log n) comparisons.
    """
    lo, hi = 0, min(len(a), len(b))  # invariant: the first `lo` blocks are shared
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def replica_count(demand_requests: float, capacity_requests: float, max_replicas: int, num_replicas: int) -> int:
    """How many replicas a group needs: its demand over what one replica may carry of it."""
    if demand_requests <= capacity_requests or capacity_requests <= 0:
        return 1
    return max(1, min(math.ceil(demand_requests / capacity_requests), max_replicas, num_replicas))


_replica_sets: dict[tuple, frozenset[str]] = {}


def replica_set(key: BlockHash, replica_ids: Sequence[str], k: int) -> frozenset[str]:
    """The group's k replicas: the top k by rendezvous weight of its key (memoized: hot groups are few)."""
    memo_key = (key, k, tuple(replica_ids))
    members = _replica_sets.get(memo_key)
    if members is None:
        if len(_replica_sets) >= _MAX_MEMO_SETS:
            _replica_sets.clear()
        members = _replica_sets[memo_key] = frozenset(rendezvous.top(key, replica_ids, k))
    return members


class PrefixDemand:
    """Decayed request counts and shared prefixes per prefix group (one router's view)."""

    def __init__(self, half_life_s: float, max_groups: int = 1024):
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        if max_groups < 2:
            raise ValueError(f"max_groups must be at least 2, got {max_groups}")
        self.half_life_s = half_life_s
        self.max_groups = max_groups
        self._base_s: float | None = None
        self._total = 0.0
        # group key → [decayed count, shared prefix hashes (capped at MAX_SHARED_BLOCKS)]
        self._groups: dict[BlockHash, list] = {}

    def observe(self, key: BlockHash | None, hashes: Sequence[BlockHash], now_s: float) -> None:
        """Count one routed request; `key` None (no full block) counts toward the total only."""
        w = self._weight(now_s)
        self._total += w
        if key is None:
            return
        entry = self._groups.get(key)
        if entry is None:
            if len(self._groups) >= self.max_groups:
                self._drop_colder_half()
            self._groups[key] = [w, hashes if len(hashes) <= MAX_SHARED_BLOCKS else hashes[:MAX_SHARED_BLOCKS]]
            return
        entry[0] += w
        shared = entry[1]
        depth = common_prefix_blocks(shared, hashes)
        if depth < len(shared):
            entry[1] = shared[:depth]  # only shrinks: the group's prefix is what ALL its requests share

    def share(self, key: BlockHash) -> float:
        """The group's share of recent requests, 0.0..1.0 (0.0 if never seen)."""
        entry = self._groups.get(key)
        return entry[0] / self._total if entry is not None and self._total > 0 else 0.0

    def shared_prefix(self, key: BlockHash) -> Sequence[BlockHash]:
        """The prefix every observed request of the group shares (empty if never seen)."""
        entry = self._groups.get(key)
        return entry[1] if entry is not None else ()

    def __len__(self) -> int:
        return len(self._groups)

    # ---- internals ---------------------------------------------------------------------

    def _weight(self, now_s: float) -> float:
        if self._base_s is None:
            self._base_s = now_s
        age = (now_s - self._base_s) / self.half_life_s
        if age > _RESCALE_AFTER_HALF_LIVES:
            scale = 2.0 ** -age
            self._total *= scale
            for entry in self._groups.values():
                entry[0] *= scale
            self._base_s, age = now_s, 0.0
        return 2.0 ** age

    def _drop_colder_half(self) -> None:
        ranked = sorted(self._groups.items(), key=lambda item: item[1][0], reverse=True)
        self._groups = dict(ranked[: self.max_groups // 2])
