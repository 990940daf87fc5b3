"""The router's view of which replica holds which KV block.

Two sources, merged at lookup time:

    engine truth   block hash ──► {replica ids}          kept current per replica by its CacheDigests
    routed         block hash ──► {replica id: expires_s} what this router sent since, optimistic
    expiry queue   [(expires_s, replica id, hashes), ...] time-ordered, for pruning `routed`

Why both: a digest arrives about once a second and describes blocks already stored,
so without `routed` the second request of a burst that shares a prefix would not know
the first one just went to replica A. `routed` entries are a guess (the engine may
evict them, or never finish the prefill), so they expire after `history_ttl_s`; a
block the engine really holds stays attractive through the digests, and affinity the
engine does not confirm decays. A digest moves a replica's engine set to the engine's
state at that report -- by its deltas (cost ∝ blocks changed) when they start right after
the last report applied, else by its full set (cost ∝ blocks held) -- so evictions are seen
at the next report. A report that is not newer than the last one applied is ignored (no
resurrection by a late report); one that neither delta nor full set can apply leaves the
replica's set at the last exact state applied (protocol: `snapshot`).

Invariants:
- `_engine[h]` is never an empty set (emptied entries are deleted), so the index size
  tracks the blocks held, not the blocks ever seen.
- `rid in _engine[h]` iff `h in _engine_blocks[rid]`: the two are one relation, indexed
  both ways, and every update goes through `_add_holder` / `_drop_holder`.
- `_engine[h]` is a shared frozenset only when it has exactly one holder (`_solo`), else a
  set of its own, so it is never mutated while shared. Readers treat both as read-only sets.
- `_applied[rid] = (epoch, sequence)` names the engine state `_engine_blocks[rid]` equals.
- `_routed[h][r]` is the latest expiry for (h, r); an expiry-queue item whose expiry
  no longer matches was refreshed by a later routing and is skipped when pruned.
- Time is always a parameter (`now_s`); nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Generator, Iterable, Iterator, Sequence

from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.snapshot import BlockDelta, CacheDigest, unpack_hashes

_NO_REPLICAS: frozenset[str] = frozenset()
_NEVER = float("-inf")
# on_routed prunes routing history this far ahead of its clock: an entry goes up to this much
# before its TTL (10 s by default), and the decisions made within this time of the last
# booking find nothing expired left, which lets `match` skip reading expiries.
EXPIRY_LOOKAHEAD_S = 0.25


def run_steps(steps: Generator[None, None, bool]) -> bool:
    """Run a stepwise update (`PrefixIndex.apply_digest_steps`) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _slices(hashes: set[BlockHash], size: int) -> Iterator[list[BlockHash]]:
    it = iter(hashes)
    while part := list(islice(it, size)):
        yield part


class PrefixIndex:
    """Block hash → replicas that hold it (engine truth ∪ unexpired routing history)."""

    def __init__(self, history_ttl_s: float):
        if history_ttl_s <= 0:
            raise ValueError(f"history_ttl_s must be positive, got {history_ttl_s}")
        self.history_ttl_s = history_ttl_s
        self._engine: dict[BlockHash, set[str] | frozenset[str]] = {}
        self._solo: dict[str, frozenset[str]] = {}  # replica → {replica}: the holders of its blocks alone
        self._engine_blocks: dict[str, set[BlockHash]] = {}
        self._applied: dict[str, tuple[int, int]] = {}  # replica → (epoch, sequence) of its last digest
        self._routed: dict[BlockHash, dict[str, float]] = {}
        self._expiry: deque[tuple[float, str, Sequence[BlockHash]]] = deque()
        # True while the expiry queue is in time order (routing times never went back), so
        # that after expire(now) every entry left in `_routed` is live at `now`.
        self._expiry_ordered = True

    # ---- updates ---------------------------------------------------------------------

    def apply_digest(self, digest: CacheDigest) -> bool:
        """Move the replica's engine-truth set to `digest`'s report; False if it was not applied.

        Not applied: a report not newer than the last one applied (late, duplicate), or a
        gap that neither its deltas nor a full set can bridge (the set stays at the last
        report applied; a later full set resyncs it).
        """
        return run_steps(self.apply_digest_steps(digest, None))

    def apply_digest_steps(self, digest: CacheDigest, max_blocks: int | None) -> Generator[None, None, bool]:
        """`apply_digest` in slices of at most `max_blocks` block updates, yielding between slices.

        Why: a router applies digests on the event loop that also makes its decisions, and
        one report can change hundreds of blocks (a resync, 100k); in slices, a decision
        waits for at most one slice instead of a whole push. Between slices the index is
        consistent block by block (both directions of the holder relation agree) and shows
        the replica part-way from its last report to this one; `applied()` moves only after
        the last slice. Until the generator is exhausted the caller must not apply another
        digest of the same replica nor remove it (FleetView queues them). None: no slicing.
        """
        rid = digest.replica_id
        last = self._applied.get(rid)
        if last is not None and not digest.is_newer_than(*last):
            return False
        if last is None or digest.epoch > last[0]:
            # A new engine lifetime (or the first report this router sees) starts from an
            # empty cache at sequence 0, so a chain reaching back to sequence 1 rebuilds it;
            # the previous lifetime's blocks are gone with its engine.
            yield from self._replace_engine_set(rid, frozenset(), max_blocks)
            last = self._applied[rid] = (digest.epoch, 0)
        chain = digest.deltas_after(last[1])
        if chain:  # the common case: this report's delta, right after the last one applied
            for delta in chain:
                yield from self._apply_delta(rid, delta, max_blocks)
            cleared = any(delta.all_cleared for delta in chain)
        elif digest.has_full_set:
            yield from self._replace_engine_set(rid, digest.hashes(), max_blocks)
            # A reset inside the gap is seen only if the chain still holds it (or this report's flag).
            cleared = digest.all_cleared or any(d.all_cleared for d in digest.deltas if d.sequence > last[1])
        elif chain is None:
            return False
        else:
            cleared = digest.all_cleared  # sequence 0 with no full set: the empty start, as assumed
        self._applied[rid] = (digest.epoch, digest.sequence)
        if cleared:
            self._forget_routed(rid)
        return True

    def _apply_delta(self, rid: str, delta: BlockDelta, max_blocks: int | None) -> Iterator[None]:
        # Idempotent per block (removing a block not held, storing one held, do nothing),
        # so the invariants hold whatever a delta says. `stored` and `removed` of one delta
        # are disjoint, so both can be taken against the set before either is applied.
        blocks = self._engine_blocks[rid]
        removed = blocks.intersection(unpack_hashes(delta.removed))
        stored = set(unpack_hashes(delta.stored))
        stored.difference_update(blocks)
        return self._update_engine_set(rid, blocks, removed, stored, max_blocks)

    def _replace_engine_set(self, rid: str, new: frozenset[BlockHash], max_blocks: int | None) -> Iterator[None]:
        """Make the replica's engine set `new`, touching only the blocks that differ (cost ∝ both sets)."""
        blocks = self._engine_blocks.setdefault(rid, set())
        return self._update_engine_set(rid, blocks, blocks - new, new - blocks, max_blocks)

    def _update_engine_set(self, rid: str, blocks: set[BlockHash], removed: set[BlockHash], stored: set[BlockHash],
                           max_blocks: int | None) -> Iterator[None]:
        """Take `removed` out of and put `stored` into the replica's set and the reverse index.

        The per-replica set changes by C-level set operations; only the reverse index needs
        a Python loop per block. With `max_blocks`, a slice at a time, yielding after each.
        """
        if max_blocks is None:
            blocks.difference_update(removed)
            self._drop_holder(rid, removed)
            blocks.update(stored)
            self._add_holder(rid, stored)
            return
        for part in _slices(removed, max_blocks):
            blocks.difference_update(part)
            self._drop_holder(rid, part)
            yield
        for part in _slices(stored, max_blocks):
            blocks.update(part)
            self._add_holder(rid, part)
            yield

    def _add_holder(self, rid: str, hashes: Iterable[BlockHash]) -> None:
        """Add `rid` to the holders of each of `hashes` (none of which lists it yet)."""
        # Most blocks have one holder (a conversation's own blocks): they all share one
        # frozenset per replica instead of a new set each, which halves a delta's cost.
        # A second holder turns the entry into a mutable set of its own.
        engine = self._engine
        engine_get = engine.get
        solo = self._solo.get(rid)
        if solo is None:
            solo = self._solo[rid] = frozenset((rid,))
        for h in hashes:
            holders = engine_get(h)
            if holders is None:
                engine[h] = solo
            elif holders.__class__ is frozenset:
                engine[h] = {*holders, rid}
            else:
                holders.add(rid)

    def _drop_holder(self, rid: str, hashes: Iterable[BlockHash]) -> None:
        """Remove `rid` from the holders of each of `hashes` (each lists it)."""
        engine = self._engine
        for h in hashes:
            holders = engine[h]
            if len(holders) == 1:
                del engine[h]
            else:
                holders.discard(rid)  # two or more holders: a mutable set

    def on_routed(self, replica_id: str, hashes: Sequence[BlockHash], now_s: float) -> None:
        """Record that this router sent a request with `hashes` to `replica_id` at `now_s`."""
        self.expire(now_s + EXPIRY_LOOKAHEAD_S)
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
        if self._expiry and expires_s < self._expiry[-1][0]:
            self._expiry_ordered = False  # a caller's clock went back: match reads expiries again
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
        self._drop_holder(replica_id, self._engine_blocks.pop(replica_id, ()))
        self._solo.pop(replica_id, None)
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
        if not engine:
            return {rid for rid, expires_s in owners.items() if expires_s > now_s}
        # Only routed owners the engine does not confirm need their expiry read (usually few).
        live = [rid for rid in owners.keys() - engine if owners[rid] > now_s]
        return engine.union(live) if live else engine

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
        # When no routing-history entry has expired by now (the queue's head is the earliest
        # expiry), the slow path below drops the unconfirmed candidates by one C-level set
        # difference instead of reading each one's expiry. on_routed prunes a little ahead
        # (EXPIRY_LOOKAHEAD_S) so that this holds for the decisions that follow it.
        queue = self._expiry
        all_live = self._expiry_ordered and (not queue or queue[0][0] > now_s)
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
            # Slow path: only the candidates the engines do not confirm (a C-level set
            # difference, usually a few) need the routing history's expiry read.
            unconfirmed = candidates if engine is None else candidates - engine
            owners = routed_get(h)
            if owners is None:
                dropped = unconfirmed
            elif all_live:
                dropped = unconfirmed.difference(owners)
            else:
                dropped = [rid for rid in unconfirmed if owners.get(rid, _NEVER) <= now_s]
            if dropped:
                for rid in dropped:
                    matched[rid] = depth
                if len(dropped) == len(candidates):
                    return matched
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

    def num_held_by(self, replica_id: str) -> int:
        """Blocks the replica's engine holds, as last reported (0 before any report)."""
        blocks = self._engine_blocks.get(replica_id)
        return len(blocks) if blocks is not None else 0

    def held_by(self, replica_id: str) -> frozenset[BlockHash]:
        """The replica's engine-truth set as last applied (a copy)."""
        return frozenset(self._engine_blocks.get(replica_id, ()))

    def applied(self, replica_id: str) -> tuple[int, int] | None:
        """(epoch, sequence) of the engine state the replica's set equals, None before any report."""
        return self._applied.get(replica_id)

    def replicas(self) -> Iterable[str]:
        return set(self._engine_blocks) | {rid for owners in self._routed.values() for rid in owners}
