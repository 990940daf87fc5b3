"""The router's view of which replica holds which KV block.

Two sources, merged at lookup time:

    engine truth   block hash ──► holders' bits           kept current per replica by its CacheDigests
    routed         block hash ──► (replica bit, expires_s) what this router sent since, optimistic
                               or {replica bit: expires_s} (a block routed to several replicas)
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

`match(..., engine_only=True)` reads engine truth alone: what every router fed the same
digests sees, whatever it routed itself (the agreement check, `deployments.routing.agreement`).

Holders as bits: each replica the index knows gets one bit (`_bit[rid]`, `_rid_of[bit]`), and
`_engine[h]` is the OR of its holders' bits, a plain int. Why: `match` narrows ~32 candidates
over ~40 blocks per decision, and with ints a whole chunk of blocks is checked against every
candidate by one C-level AND over the chunk instead of a Python step and a subset test per
block; an int is also no container for the garbage collector to scan, nor a set to allocate
when a block gains a second holder. A walk is bound by memory more than by arithmetic,
though: a lookup in this dict of all replicas' blocks usually misses the CPU cache, so the
walk's long single-replica tail reads that replica's own (smaller) block set instead
(`_match_one`). benchmarks/router_microbench.py measures `match`.

Routing history by bits, one owner as a tuple: a block in the history almost always has
one routed owner, so that case is a `(bit, expires_s)` tuple, one per booking shared by all
its blocks, instead of a dict per block; a second owner turns it into a dict. Booking and
pruning a request touch tens of blocks each, mostly cache misses, so less memory per block
is what makes them cheaper; `match` takes a dict's routed holders as one C-level `sum` of
its keys (distinct powers of two: the sum is their OR). The rest of a booking is cache
misses on the history dict itself.

Bits back to replica ids through a memo (`_rids_in`): most matches end with the same few holder
masks (every replica holds the shared system prompt, then all but the session's replica drop
out), and naming them one bit at a time would be a Python step per replica per decision.

Invariants:
- `_engine[h]` is never 0 (emptied entries are deleted), so the index size tracks the
  blocks held, not the blocks ever seen.
- `_engine[h] & _bit[rid]` iff `h in _engine_blocks[rid]`: the two are one relation, indexed
  both ways, and every update goes through `_add_holder` / `_drop_holder`.
- A replica has a bit while it holds engine blocks or routing history; `remove_replica`
  clears both before freeing the bit, so a bit reused by a later replica carries nothing over.
- `_applied[rid] = (epoch, sequence)` names the engine state `_engine_blocks[rid]` equals.
- The latest expiry for (h, r) is `_routed[h]` == (`_bit[r]`, it) or `_routed[h][_bit[r]]`; an
  expiry-queue item whose expiry no longer matches was refreshed by a later routing and is
  skipped when pruned. A dict is never empty (emptied ones are deleted), a tuple is one owner.
- Pruning may stop inside the queue's head (a budget per booking): its first `_expiry_pos`
  blocks are done. An entry past its expiry may stay in `_routed` while the head is due;
  every lookup then reads expiries, so only live history ever counts.
- `_rids_of_bits[mask]` names the replicas of `mask` under the current bit assignment: it is
  cleared whenever a bit is given to a replica or freed.
- Time is always a parameter (`now_s`); nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from functools import reduce
from itertools import islice, repeat
from operator import and_
from types import MappingProxyType
from typing import Generator, Iterable, Iterator, Mapping, Sequence

from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.snapshot import BlockDelta, CacheDigest, unpack_hashes

_NEVER = float("-inf")
_NO_BLOCKS: frozenset[BlockHash] = frozenset()
_Owners = tuple[int, float] | dict[int, float]  # a block's routed owners: (bit, expires_s) or {bit: expires_s}
_NO_ROUTED: Mapping[BlockHash, _Owners] = MappingProxyType({})  # the routing history `match(engine_only)` reads
# on_routed prunes routing history this far ahead of its clock: an entry goes up to this much
# before its TTL (10 s by default), and the decisions made within this time of the last
# booking find nothing expired left (when pruning keeps up with its budget, below), which lets
# `match` skip reading expiries.
EXPIRY_LOOKAHEAD_S = 0.25
# on_routed prunes at most this many routing-history blocks per block it books (and at least
# MIN_EXPIRY_BLOCKS): bookings expire at the rate they are made, so twice that rate drains any
# backlog, while one booking no longer pays for a burst. Unbounded, the blocks due at a
# booking follow the (Poisson) bookings one TTL before it: about one request's worth on
# average but several at the tail, which would make `on_routed`'s tail several times its
# median (and a decision arriving meanwhile waits for it). Entries left past their expiry are only memory:
# lookups check expiries whenever the queue's head is due (`match`'s `all_live`).
EXPIRY_BLOCKS_PER_BOOKED = 2
MIN_EXPIRY_BLOCKS = 64
# match checks blocks this many at a time in C (one lookup pass, one AND or `issuperset`),
# so a run every candidate holds costs no Python step per block; few enough that a walk
# ending early looks up little past its end.
MATCH_CHUNK_BLOCKS = 16
MAX_MEMO_MASKS = 4096  # holder masks remembered by `_rids_in`; cleared when full or when a bit changes hands


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
        self._engine: dict[BlockHash, int] = {}  # block → OR of its holders' bits (never 0)
        self._bit: dict[str, int] = {}  # replica → its bit (a power of two)
        self._rid_of: dict[int, str] = {}  # bit → replica: `_bit` reversed
        self._rids_of_bits: dict[int, tuple[str, ...]] = {}  # memo of `_rids_in`: a few masks recur
        self._free_bits: list[int] = []  # bits of removed replicas, for reuse (keeps the ints small)
        self._engine_blocks: dict[str, set[BlockHash]] = {}
        self._applied: dict[str, tuple[int, int]] = {}  # replica → (epoch, sequence) of its last digest
        # block → (replica bit, expires_s) for one owner, else {replica bit: expires_s}
        self._routed: dict[BlockHash, tuple[int, float] | dict[int, float]] = {}
        self._expiry: deque[tuple[float, str, Sequence[BlockHash]]] = deque()
        self._expiry_pos = 0  # blocks of the queue's head already pruned (pruning stops mid-entry)
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
        if max_blocks is not None:
            return self._apply_delta_steps(rid, blocks, delta, max_blocks)
        removed = blocks.intersection(unpack_hashes(delta.removed))
        stored = set(unpack_hashes(delta.stored))
        stored.difference_update(blocks)
        return self._update_engine_set(rid, blocks, removed, stored, None)

    def _apply_delta_steps(self, rid: str, blocks: set[BlockHash], delta: BlockDelta,
                           max_blocks: int) -> Iterator[None]:
        """A delta in slices of at most `max_blocks` reported blocks, each slice building its own part's set.

        Why not the whole delta's sets first: building them (every int decoded, hashed and
        tested against the replica's set) costs several times a slice's index updates, and
        would all land in the delta's first slice. Per part, removals are tested against the set as it is then: `stored` and
        `removed` are disjoint, and removals go first, so a stored block's membership is the
        same as before the delta (the at-once path's answer); a block stored by an earlier
        part is not stored twice.
        """
        removed, stored = unpack_hashes(delta.removed), unpack_hashes(delta.stored)  # memcpy only
        for start in range(0, len(removed), max_blocks):
            part = blocks.intersection(removed[start:start + max_blocks])
            blocks.difference_update(part)
            self._drop_holder(rid, part)
            yield
        for start in range(0, len(stored), max_blocks):
            part = set(stored[start:start + max_blocks])
            part.difference_update(blocks)
            blocks.update(part)
            self._add_holder(rid, part)
            yield

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

    def _bit_of(self, rid: str) -> int:
        """The replica's bit, given it on first sight: a freed one if any, else the next unused."""
        bit = self._bit.get(rid)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
            self._bit[rid] = bit
            self._rid_of[bit] = rid
            self._rids_of_bits.clear()
        return bit

    def _add_holder(self, rid: str, hashes: Iterable[BlockHash]) -> None:
        """Add `rid` to the holders of each of `hashes` (none of which lists it yet)."""
        engine = self._engine
        engine_get = engine.get
        bit = self._bit_of(rid)
        for h in hashes:
            engine[h] = engine_get(h, 0) | bit

    def _drop_holder(self, rid: str, hashes: Iterable[BlockHash]) -> None:
        """Remove `rid` from the holders of each of `hashes` (each lists it)."""
        engine = self._engine
        keep = ~self._bit.get(rid, 0)
        for h in hashes:
            rest = engine[h] & keep
            if rest:
                engine[h] = rest
            else:
                del engine[h]

    def on_routed(self, replica_id: str, hashes: Sequence[BlockHash], now_s: float) -> None:
        """Record that this router sent a request with `hashes` to `replica_id` at `now_s`."""
        self.expire(now_s + EXPIRY_LOOKAHEAD_S, max(MIN_EXPIRY_BLOCKS, EXPIRY_BLOCKS_PER_BOOKED * len(hashes)))
        if not hashes:
            return
        bit = self._bit_of(replica_id)  # `match` reads routed owners' bits
        expires_s = now_s + self.history_ttl_s
        routed = self._routed
        alone = (bit, expires_s)  # the value of every block this replica alone is routed
        for h in hashes:
            owners = routed.get(h)
            if owners is None:
                routed[h] = alone
            elif owners.__class__ is tuple:
                routed[h] = alone if owners[0] == bit else {owners[0]: owners[1], bit: expires_s}
            else:
                owners[bit] = expires_s
        if self._expiry and expires_s < self._expiry[-1][0]:
            self._expiry_ordered = False  # a caller's clock went back: match reads expiries again
        self._expiry.append((expires_s, replica_id, tuple(hashes)))

    def expire(self, now_s: float, max_blocks: int | None = None) -> None:
        """Drop routing-history entries whose TTL ran out by `now_s` (amortized O(1) per entry).

        `max_blocks`: prune at most that many blocks now (the rest at a later call), so one
        call costs a bounded time; None: all that are due.
        """
        queue, routed = self._expiry, self._routed
        while queue and queue[0][0] <= now_s:
            expires_s, rid, hashes = queue[0]
            bit = self._bit.get(rid)
            start, end = self._expiry_pos, len(hashes)
            if bit is None:  # removed since: its entries went with it
                queue.popleft()
                self._expiry_pos = 0
                continue
            if max_blocks is not None:
                if max_blocks <= 0:
                    return
                end = min(end, start + max_blocks)
                max_blocks -= end - start
            if end < len(hashes):
                self._expiry_pos = end
            else:
                queue.popleft()
                self._expiry_pos = 0
            alone = (bit, expires_s)
            for h in hashes[start:end]:
                owners = routed.get(h)
                if owners is None:
                    continue
                if owners.__class__ is tuple:
                    if owners == alone:
                        del routed[h]
                elif owners.get(bit) == expires_s:
                    del owners[bit]
                    if not owners:
                        del routed[h]

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica entirely (it stopped or was replaced); rare, so O(index size) is fine."""
        self._drop_holder(replica_id, self._engine_blocks.pop(replica_id, ()))
        self._applied.pop(replica_id, None)
        self._forget_routed(replica_id)
        bit = self._bit.pop(replica_id, None)
        if bit is not None:  # nothing holds it now: free for the next replica
            del self._rid_of[bit]
            self._rids_of_bits.clear()
            self._free_bits.append(bit)

    def _forget_routed(self, replica_id: str) -> None:
        # Queue items for this replica stay; they no longer match and are skipped on expiry.
        bit = self._bit.get(replica_id)
        if bit is None:
            return
        routed = self._routed
        for h in [h for h, owners in routed.items()
                  if (owners[0] == bit if owners.__class__ is tuple else bit in owners)]:
            owners = routed[h]
            if owners.__class__ is tuple:
                del routed[h]
            else:
                del owners[bit]
                if not owners:
                    del routed[h]

    # ---- lookup ----------------------------------------------------------------------

    def holders(self, block_hash: BlockHash, now_s: float) -> set[str]:
        """Replicas holding one block at `now_s`: engine truth plus unexpired routing history."""
        return self._replicas_in(self._holder_bits(block_hash, now_s))

    def engine_holders(self, block_hash: BlockHash) -> set[str]:
        """Replicas whose engine reported holding one block (engine truth alone)."""
        return self._replicas_in(self._engine.get(block_hash, 0))

    def _holder_bits(self, block_hash: BlockHash, now_s: float, all_live: bool = False) -> int:
        """Engine holders' bits | live routed holders' bits; `all_live`: no routed entry expired by now."""
        bits = self._engine.get(block_hash, 0)
        owners = self._routed.get(block_hash)
        if owners is None:
            return bits
        if owners.__class__ is tuple:
            return bits | owners[0] if all_live or owners[1] > now_s else bits
        if all_live:
            return bits | sum(owners)  # distinct powers of two: their sum is their OR
        for bit, expires_s in owners.items():
            if expires_s > now_s:
                bits |= bit
        return bits

    def _replicas_in(self, bits: int) -> set[str]:
        rid_of = self._rid_of
        out = set()
        while bits:
            low = bits & -bits
            out.add(rid_of[low])
            bits ^= low
        return out

    def match(self, hashes: Sequence[BlockHash], now_s: float, engine_only: bool = False) -> dict[str, int]:
        """Longest cached prefix per replica, in blocks; replicas matching nothing are absent.

        One walk over the request's hashes, narrowing the candidates (bits): the holders of
        the first block start it, a replica drops out at the first block it lacks (vLLM
        reuses a prefix only up to its first miss), and the walk stops when no candidate is
        left. O(len(hashes)) lookups, checked a chunk at a time in C; a Python step only per
        block of a chunk some candidate lacks, and per routed owner or dropped replica there.
        Once one candidate is left, `_match_one` walks that replica's own block set.

        `engine_only`: engine truth alone, the match any router fed the same digests computes,
        whatever it routed itself (`deployments.routing.agreement`). The same walk over an
        empty routing history, so the two answers differ only by this router's own history.
        """
        if not hashes:
            return {}
        if engine_only:
            routed: Mapping[BlockHash, _Owners] = _NO_ROUTED
            all_live = True  # nothing to expire
            candidates = self._engine.get(hashes[0], 0)
        else:
            routed = self._routed
            # When no routing-history entry has expired by now (the queue's head is the earliest
            # expiry), the slow path below takes every routed owner as live instead of reading
            # each one's expiry. on_routed prunes a little ahead (EXPIRY_LOOKAHEAD_S) so that
            # this holds for the decisions that follow it.
            queue = self._expiry
            all_live = self._expiry_ordered and (not queue or queue[0][0] > now_s)
            candidates = self._holder_bits(hashes[0], now_s, all_live)
        matched: dict[str, int] = {}
        if not candidates:
            return matched
        engine_get, routed_get, rids_of_bits = self._engine.get, routed.get, self._rids_of_bits
        num_blocks, depth = len(hashes), 1
        while depth < num_blocks:
            if not candidates & (candidates - 1):  # one candidate left: its own set is cheaper
                return self._match_one(hashes, depth, candidates, now_s, all_live, matched, routed)
            # The holders of the next chunk of blocks, looked up in one C-level pass.
            chunk = list(map(engine_get, hashes[depth:depth + MATCH_CHUNK_BLOCKS], repeat(0)))
            # Fast path: every surviving candidate is confirmed by the engines on every block of
            # the chunk (a shared prefix held across the fleet, or one conversation's history
            # on its replica, is the common case): one AND over the chunk, in C.
            if reduce(and_, chunk, candidates) == candidates:
                depth += len(chunk)
                continue
            for engine in chunk:
                if candidates & engine == candidates:
                    depth += 1
                    continue
                # Slow path: only the candidates the engines do not confirm need the routing history.
                unconfirmed = candidates & ~engine
                owners = routed_get(hashes[depth])
                if owners is None:
                    dropped = unconfirmed
                elif owners.__class__ is tuple:  # one routed owner
                    dropped = unconfirmed & ~owners[0] if all_live or owners[1] > now_s else unconfirmed
                elif all_live:
                    dropped = unconfirmed & ~sum(owners)  # keys are distinct bits: sum is OR
                else:
                    # Bit loops are written out here and below: a shared generator adds a
                    # frame and a resume per bit to every decision (benchmarks/router_microbench.py).
                    dropped, rest = 0, unconfirmed
                    while rest:
                        low = rest & -rest
                        if owners.get(low, _NEVER) <= now_s:
                            dropped |= low
                        rest ^= low
                if dropped:
                    candidates ^= dropped
                    for rid in rids_of_bits.get(dropped) or self._rids_in(dropped):
                        matched[rid] = depth
                    if not candidates:
                        return matched
                depth += 1
                if not candidates & (candidates - 1):
                    break  # one candidate left: the loop above hands it to _match_one
        for rid in rids_of_bits.get(candidates) or self._rids_in(candidates):
            matched[rid] = depth
        return matched

    def _rids_in(self, bits: int) -> tuple[str, ...]:
        """The replicas of `bits`, memoized: `match` turns the same few masks (all replicas, all but
        one) into replica ids at most decisions, and naming them costs a Python step per bit."""
        rid_of, rids, rest = self._rid_of, [], bits
        while rest:
            low = rest & -rest
            rids.append(rid_of[low])
            rest ^= low
        memo = self._rids_of_bits
        if len(memo) >= MAX_MEMO_MASKS:
            memo.clear()
        memo[bits] = out = tuple(rids)
        return out

    def _match_one(self, hashes: Sequence[BlockHash], depth: int, candidate: int, now_s: float, all_live: bool,
                   matched: dict[str, int], routed: Mapping[BlockHash, _Owners]) -> dict[str, int]:
        """`match` from `depth` on with one candidate left (its bit): the walk past a shared prompt
        into one conversation's history, the longest and coldest part.

        Its engine set is one replica's blocks (a few thousand), so a membership test touches
        less memory than the index's lookup (all blocks of all replicas), and `issuperset`
        runs a chunk's tests in C, stopping at the first block the engine lacks; only there is
        the routing history (`routed`: `match`'s, empty for engine truth alone) read.
        """
        rid = self._rid_of[candidate]
        blocks = self._engine_blocks.get(rid, _NO_BLOCKS)
        routed_get = routed.get
        num_blocks = len(hashes)
        while depth < num_blocks:
            chunk = hashes[depth:depth + MATCH_CHUNK_BLOCKS]
            if blocks.issuperset(chunk):
                depth += len(chunk)
                continue
            for h in chunk:
                if h not in blocks:
                    owners = routed_get(h)
                    if owners is None:
                        expires_s = _NEVER
                    elif owners.__class__ is tuple:
                        expires_s = owners[1] if owners[0] == candidate else _NEVER
                    else:
                        expires_s = owners.get(candidate, _NEVER)
                    if expires_s == _NEVER or (not all_live and expires_s <= now_s):
                        matched[rid] = depth
                        return matched
                depth += 1
        matched[rid] = depth
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

    def run_held_by(self, replica_id: str, hashes: Sequence[BlockHash], start: int) -> int:
        """How many of `hashes`, from position `start`, the replica's engine holds in a row (engine truth only:
        what a CPU tier's load would bring in after the blocks found on GPU)."""
        blocks = self._engine_blocks.get(replica_id)
        if not blocks:
            return 0
        count = 0
        for block in islice(hashes, start, None):
            if block not in blocks:
                break
            count += 1
        return count

    def applied(self, replica_id: str) -> tuple[int, int] | None:
        """(epoch, sequence) of the engine state the replica's set equals, None before any report."""
        return self._applied.get(replica_id)

    def replicas(self) -> Iterable[str]:
        rid_of = self._rid_of
        return set(self._engine_blocks) | {rid_of[bit] for owners in self._routed.values()
                                            for bit in ((owners[0],) if owners.__class__ is tuple else owners)}
