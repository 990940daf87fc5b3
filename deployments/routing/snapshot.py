"""What an engine replica tells the router: its load, and which KV blocks it holds.

Why a boundary: the router runs in the caller's process (the ingress) and never sees
an engine directly. Ray Serve carries whatever a replica returns from
`record_routing_stats()` (about once a second) to every router of the deployment.
These two frozen dataclasses are that payload, typed, plain and picklable; the pure
policy reads only them.

    engine replica                                   router (in the ingress process)
    vLLM KV events ──► block set ──► CacheDigest ─┐
    scheduler stats ─────────────► load numbers ──┴─► record_routing_stats ─► ReplicaSnapshot
                                                                               + PrefixIndex

Digest protocol: deltas, with full sets as the fallback. Re-applying a replica's full
block set every period costs the router work proportional to the blocks held (decode +
two set differences) on every report, time taken from the decisions on the same loop. A
report therefore carries what changed, and a full set only now and then:

    deltas   the last `delta_window` per-report changes, each (sequence, stored, removed,
             all_cleared): exactly the blocks that entered / left the set between report
             sequence-1 and sequence (a block stored and evicted within one period is in
             neither). A router that missed up to delta_window-1 reports (Ray's controller
             pull timed out, its long poll coalesced two pushes) catches up from them.
    blocks   the full set, on the first report of an engine lifetime and every
             `full_every` reports after (None otherwise): a router whose gap the chain
             does not bridge (it started late, or missed many reports) resyncs from it.

Robustness, as with full sets alone: the router applies a report only if it is newer
(epoch, sequence) than the last it applied for that replica, so a late, reordered or
duplicated report is ignored and can never resurrect evicted blocks; it applies the
chain only when the chain starts right after its own last sequence (deltas compose
exactly only from the state they were taken against), else the full set, else nothing:
on a gap it keeps its last view, which is an exact past state of the engine, until a
full set arrives (at most `full_every` periods). A new epoch (a restarted engine, whose
cache starts empty) resets the replica to the empty set at sequence 0 first, so a chain
that reaches back to sequence 1 rebuilds it. `deployments.routing.prefix_index` applies them,
`deployments.routing.digest_journal` builds them on the engine side.

Size: 8 bytes per block changed per period in each of the window's deltas, plus 8 per
block held in each full set (100k blocks: 800 KB once every `full_every` periods).
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Iterable

from kvtide.deployments.routing.block_hash import BlockHash

_HASH_TYPECODE = "Q"
assert array(_HASH_TYPECODE).itemsize == 8


@dataclass(slots=True)
class ReplicaSnapshot:
    """One replica's load as the router sees it at decision time.

    Treated as immutable (FleetView caches and shares them across decisions) but not frozen:
    FleetView rebuilds several per decision, and a frozen dataclass's construction (every field
    through object.__setattr__) costs several times a plain one's.

    `num_ongoing_requests` is the router's own count (requests it has in flight on
    that replica, fresh at every decision); `num_running`/`num_waiting`/`kv_usage_perc`/
    `pending_prefill_tokens` come from the engine's last report (up to one period old). The policy uses both:
    the router's count reacts instantly to its own decisions, the engine's numbers see
    work that other routers sent.
    """

    replica_id: str
    num_ongoing_requests: int
    num_running: int = 0
    num_waiting: int = 0
    kv_usage_perc: float = 0.0  # share of KV blocks used by running requests, 0.0..1.0
    # Prompt tokens accepted but not yet prefilled (the engine's last report): on
    # shared-prefix loads a queued request costs ~100 or ~6,000 tokens.
    pending_prefill_tokens: int = 0
    # The part of num_ongoing_requests known to be in flight; None: all of it. In direct mode
    # the router's count is its pick-only choices since the engine's last report, and it
    # cannot see them finish: 0 of them is known (FleetView passes Ray's own count, 0 there).
    confirmed_ongoing_requests: int | None = None
    # Pick-only choices since the engine's report, which its running + waiting do not include
    # yet, and probably not finished (`pick_load.PickCounts.in_flight`): they queue on top of
    # the reported load (direct mode; 0 elsewhere).
    unreported_picks: int = 0
    # What loading one block from this replica's CPU tier costs relative to prefilling it, in
    # (0, 1] (`stages.scorers.cpu_block_weight`, from its measured prefill and onload rates).
    cpu_block_weight: float = 1.0
    # Requests ahead of a new one: whichever of the two views counts more (the engine's view
    # with the picks it has not reported yet). A field computed once, not a property: the
    # policy reads it for every replica of every decision.
    num_queued_requests: int = field(init=False)
    # The same without pick-only guesses: what hot-prefix replication sizes demand with. A
    # burst between reports must steer picks (num_queued_requests), but requests that already
    # finished must not make a group look hot: on sequential requests at a few per second,
    # picks counted until the next report doubled the load and replicated a one-tenant prefix
    # onto a cold replica (tests/integration/test_routing.py, salted tenants).
    num_confirmed_requests: int = field(init=False)

    def __post_init__(self) -> None:
        reported = self.num_running + self.num_waiting
        self.num_queued_requests = max(self.num_ongoing_requests, reported + self.unreported_picks)
        confirmed = self.num_ongoing_requests if self.confirmed_ongoing_requests is None \
            else self.confirmed_ongoing_requests
        self.num_confirmed_requests = max(confirmed, reported)


def pack_hashes(hashes: Iterable[BlockHash]) -> bytes:
    """Block hashes as little-endian uint64s, in one `bytes` (unordered; see CacheDigest)."""
    # No sort: the router reads the blocks back as a set, and sorting a large cache's
    # hashes every report period cost an engine replica ~5 % of its core under load.
    packed = array(_HASH_TYPECODE, hashes if isinstance(hashes, (set, frozenset, dict)) else set(hashes))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_hashes(blocks: bytes) -> array:
    """The uint64s of `pack_hashes`, as an array (iterating it yields ints; no set is built)."""
    packed = array(_HASH_TYPECODE)
    packed.frombytes(blocks)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


def _check_packed(name: str, blocks: bytes) -> None:
    if len(blocks) % 8:
        raise ValueError(f"{name} must be a multiple of 8 bytes, got {len(blocks)}")


@dataclass(frozen=True)
class BlockDelta:
    """What changed in one engine's block set between report `sequence - 1` and report `sequence`.

    `stored`: blocks held now and not at the previous report; `removed`: the reverse (both
    packed as in CacheDigest). Applying the deltas of sequences a+1..s, in order, to the set
    of report a gives exactly the set of report s; applied to any other set it would not,
    which is why the router checks where a chain starts. `all_cleared`: the engine reset
    its prefix cache in that period (its blocks are in `removed`).
    """

    sequence: int
    stored: bytes = b""
    removed: bytes = b""
    all_cleared: bool = False

    def __post_init__(self) -> None:
        _check_packed("BlockDelta.stored", self.stored)
        _check_packed("BlockDelta.removed", self.removed)

    @classmethod
    def from_hashes(cls, sequence: int, stored: Iterable[BlockHash], removed: Iterable[BlockHash], *,
                    all_cleared: bool = False) -> "BlockDelta":
        return cls(sequence, pack_hashes(stored), pack_hashes(removed), all_cleared)

    @property
    def num_changes(self) -> int:
        return (len(self.stored) + len(self.removed)) // 8


@dataclass(frozen=True)
class CacheDigest:
    """One engine replica's report on the blocks it holds: recent deltas, and now and then the full set.

    `blocks` is the full hash set as little-endian uint64s (unordered) in one `bytes` object,
    or None when this report carries deltas only: 8 bytes per block, one pickle opcode, no
    per-int overhead: smaller than a pickled frozenset of ints and far cheaper to pickle and
    unpickle, since a frozenset costs a Python object per block each way. `hashes()` decodes
    it into a frozenset on the router side, only where the set is needed. `from_hashes`
    builds a full-set digest.

    `deltas` are the per-report changes of the last few sequences, oldest first, the last
    one being this report's own (`deltas[-1].sequence == sequence` when not empty); see the
    module docstring for when the router uses them and when the full set.

    `epoch` identifies one engine lifetime (its start time in ns, so a restarted engine
    has a larger one) and `sequence` counts reports within it; the router applies a
    digest only if it is newer than the last one it applied for that replica (a larger
    epoch, or the same epoch and a larger sequence), so a late report -- from this
    lifetime or a previous one -- never resurrects evicted blocks. `all_cleared` says
    the engine reset its prefix cache since the previous digest: the router then also
    forgets what it routed there before.
    """

    replica_id: str
    epoch: int
    sequence: int
    blocks: bytes | None = b""
    all_cleared: bool = False
    timestamp_s: float = 0.0  # the engine's clock; informational (clocks differ across hosts)
    deltas: tuple[BlockDelta, ...] = ()
    # The engine's CPU tier (vLLM's KV offloading), digested the same way with its own sequence;
    # None: no CPU tier (or none reported yet). Its replica_id and epoch are this digest's.
    cpu: "CacheDigest | None" = None
    num_blocks: int = field(init=False)  # blocks in the full set (0 without one)

    def __post_init__(self) -> None:
        if self.blocks is not None:
            _check_packed("CacheDigest.blocks", self.blocks)
        if self.deltas and self.deltas[-1].sequence != self.sequence:
            raise ValueError(f"the last delta must be this report's (sequence {self.sequence}), "
                             f"got {self.deltas[-1].sequence}")
        if any(b.sequence != a.sequence + 1 for a, b in zip(self.deltas, self.deltas[1:])):
            raise ValueError("CacheDigest.deltas must have consecutive sequences")  # deltas_after indexes by it
        object.__setattr__(self, "num_blocks", len(self.blocks) // 8 if self.blocks is not None else 0)

    @classmethod
    def from_hashes(cls, replica_id: str, epoch: int, sequence: int, hashes: Iterable[BlockHash], *,
                    all_cleared: bool = False, timestamp_s: float = 0.0,
                    deltas: tuple[BlockDelta, ...] = (), cpu: "CacheDigest | None" = None) -> "CacheDigest":
        return cls(replica_id, epoch, sequence, pack_hashes(hashes), all_cleared, timestamp_s, deltas, cpu)

    @property
    def has_full_set(self) -> bool:
        return self.blocks is not None

    def hashes(self) -> frozenset[BlockHash]:
        """The full set; ValueError on a deltas-only report."""
        if self.blocks is None:
            raise ValueError(f"digest {self.replica_id}#{self.sequence} carries deltas only, no full set")
        return frozenset(unpack_hashes(self.blocks))  # type: ignore[arg-type]

    def deltas_after(self, sequence: int) -> tuple[BlockDelta, ...] | None:
        """The deltas that take a set at report `sequence` to this report, or None if the chain does not reach back.

        Empty when `sequence` is this report's own (nothing to do).
        """
        if sequence >= self.sequence:
            return ()
        deltas = self.deltas
        if not deltas or deltas[0].sequence > sequence + 1:
            return None
        return deltas[sequence + 1 - deltas[0].sequence:]

    def is_newer_than(self, epoch: int, sequence: int) -> bool:
        """True if this digest should replace one with (epoch, sequence): a later engine lifetime or a later report."""
        return (self.epoch, self.sequence) > (epoch, sequence)
