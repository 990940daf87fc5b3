"""The router's view of which replica holds which KV block.

Two sources, merged at lookup time:

    engine truth   block hash ──► {replica ids}          replaced per replica by each CacheDigest
    routed         block hash ──► {replica id: expires_s} what this router sent since, optimistic
    expiry queue   [(expires_s, replica id, hashes), ...] time-ordered, for pruning `routed`

Why both: a digest arrives about once a second and describes blocks already stored,
so without `routed` the second request of a burst that shares a prefix would not know
the first one just went to replica A. `routed` entries are a guess (the engine may
evict them, or never finish the prefill), so they expire after `history_ttl_s`; a
block the engine really holds stays attractive through the digests, and affinity the
engine does not confirm decays. Digests REPLACE a replica's engine set, so evictions
are seen at the next report.

Invariants:
- `_engine[h]` is never an empty set (emptied entries are deleted), so the index size
  tracks the blocks held, not the blocks ever seen.
- `_routed[h][r]` is the latest expiry for (h, r); an expiry-queue item whose expiry
  no longer matches was refreshed by a later routing and is skipped when pruned.
- Time is always a parameter (`now_s`); nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.snapshot import CacheDigest

_NO_REPLICAS: frozenset[str] = frozenset()
_NEVER = float("-inf")


class PrefixIndex:
    """Block hash → replicas that hold it (engine truth ∪ unexpired routing history)."""

    def __init__(self, history_ttl_s: float):
        if history_ttl_s <= 0:
            raise ValueError(f"history_ttl_s must be positive, got {history_ttl_s}")
        self.history_ttl_s = history_ttl_s
        self._engine: dict[BlockHash, set[str]] = {}
        self._engine_blocks: dict[str, frozenset[BlockHash]] = {}
        self._applied: dict[str, tuple[int, int]] = {}  # replica → (epoch, sequence) of its last digest
        self._routed: dict[BlockHash, dict[str, float]] = {}
        self._expiry: deque[tuple[float, str, Sequence[BlockHash]]] = deque()

    # ---- updates ---------------------------------------------------------------------

    def apply_digest(self, digest: CacheDigest) -> bool:
        """Replace the replica's engine-truth set; False (ignored) if not newer than the last one applied."""
        rid = digest.replica_id
        last = self._applied.get(rid)
        if last is not None and not digest.is_newer_than(*last):
            return False
        self._applied[rid] = (digest.epoch, digest.sequence)
        new = digest.hashes()
        old = self._engine_blocks.get(rid, frozenset())
        engine = self._engine
        for h in old - new:
            holders = engine[h]
            holders.discard(rid)
            if not holders:
                del engine[h]
        for h in new - old:
            holders = engine.get(h)
            if holders is None:
                engine[h] = {rid}
            else:
                holders.add(rid)
        self._engine_blocks[rid] = new
        if digest.all_cleared:
            self._forget_routed(rid)
        return True

    def on_routed(self, replica_id: str, hashes: Sequence[BlockHash], now_s: float) -> None:
        """Record that this router sent a request with `hashes` to `replica_id` at `now_s`."""
        self.expire(now_s)
        if not hashes:
            return
        expires_s = now_s + self.history_ttl_s
        routed = self._routed
        for h in hashes:
            owners = routed.get(h)
            if owners is None:
                routed[h] = {replica_id: expires_s}
            else:
                owners[replica_id] = expires_s
        self._expiry.append((expires_s, replica_id, tuple(hashes)))

    def expire(self, now_s: float) -> None:
        """Drop routing-history entries whose TTL ran out by `now_s` (amortized O(1) per entry)."""
        queue, routed = self._expiry, self._routed
        while queue and queue[0][0] <= now_s:
            expires_s, rid, hashes = queue.popleft()
            for h in hashes:
                owners = routed.get(h)
                if owners is not None and owners.get(rid) == expires_s:
                    del owners[rid]
                    if not owners:
                        del routed[h]

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica entirely (it stopped or was replaced); rare, so O(index size) is fine."""
        for h in self._engine_blocks.pop(replica_id, frozenset()):
            holders = self._engine[h]
            holders.discard(replica_id)
            if not holders:
                del self._engine[h]
        self._applied.pop(replica_id, None)
        self._forget_routed(replica_id)

    def _forget_routed(self, replica_id: str) -> None:
        # Queue items for this replica stay; they no longer match and are skipped on expiry.
        for h in [h for h, owners in self._routed.items() if replica_id in owners]:
            owners = self._routed[h]
            del owners[replica_id]
            if not owners:
                del self._routed[h]

    # ---- lookup ----------------------------------------------------------------------

    def holders(self, block_hash: BlockHash, now_s: float) -> frozenset[str] | set[str]:
        """Replicas holding one block at `now_s`: engine truth plus unexpired routing history (read-only)."""
        engine = self._engine.get(block_hash)
        owners = self._routed.get(block_hash)
        if not owners:
            return engine or _NO_REPLICAS
        live = {rid for rid, expires_s in owners.items() if expires_s > now_s}
        return (engine | live) if engine else live

    def match(self, hashes: Sequence[BlockHash], now_s: float) -> dict[str, int]:
        """Longest cached prefix per replica, in blocks; replicas matching nothing are absent.

        One walk over the request's hashes, narrowing the candidates: the holders of the
        first block start it, a replica drops out at the first block it lacks (vLLM reuses
        a prefix only up to its first miss), and the walk stops when no candidate is left.
        O(len(hashes) × candidates) membership tests, most of them inside one C-level
        subset test per block (below).
        """
        if not hashes:
            return {}
        candidates = set(self.holders(hashes[0], now_s))
        matched: dict[str, int] = {}
        engine_get, routed_get = self._engine.get, self._routed.get
        for depth in range(1, len(hashes)):
            if not candidates:
                return matched
            h = hashes[depth]
            engine = engine_get(h)
            # Fast path: a shared prefix the engines confirmed is held by every surviving
            # candidate, so one C-level subset test replaces a Python loop over up to N
            # replicas (a hot system prompt replicated on most of the fleet is the common case).
            if engine is not None and candidates <= engine:
                continue
            owners = routed_get(h)
            dropped = [rid for rid in candidates
                       if (engine is None or rid not in engine)
                       and (owners is None or owners.get(rid, _NEVER) <= now_s)]
            if dropped:
                for rid in dropped:
                    matched[rid] = depth
                candidates.difference_update(dropped)
        for rid in candidates:
            matched[rid] = len(hashes)
        return matched

    # ---- introspection (metrics, tests) -------------------------------------------------

    @property
    def num_engine_blocks(self) -> int:
        """Distinct block hashes some replica's engine reported holding."""
        return len(self._engine)

    @property
    def num_held_blocks(self) -> int:
        """Blocks held summed over replicas (a block on two replicas counts twice)."""
        return sum(len(blocks) for blocks in self._engine_blocks.values())

    @property
    def num_routed_blocks(self) -> int:
        """Distinct block hashes in the routing history (pruned lazily)."""
        return len(self._routed)

    def replicas(self) -> Iterable[str]:
        return set(self._engine_blocks) | {rid for owners in self._routed.values() for rid in owners}
