"""Incremental cache digests: the engine-side journal, the router-side application, and their robustness."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from kvtide.deployments.engine.kv_cache_tracker import KvCacheTracker
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.digest_journal import DigestJournal
from kvtide.deployments.routing.fleet import rekey
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import BlockDelta, CacheDigest, unpack_hashes

BS = 4
TTL_S = 10.0
PROMPT = block_hashes(list(range(32)), BS)  # 8 blocks


def _set(packed: bytes) -> set[int]:
    return set(unpack_hashes(packed))


class _Engine:
    """A block set with its journal, as a tracker keeps them (test helper)."""

    def __init__(self, rid: str = "a", epoch: int = 1, *, delta_window: int = 3, full_every: int = 100):
        self.held: set[int] = set()
        self.journal = DigestJournal(rid, epoch, delta_window=delta_window, full_every=full_every)

    def store(self, *hashes: int) -> None:
        for h in hashes:
            if h not in self.held:
                self.held.add(h)
                self.journal.stored(h)

    def evict(self, *hashes: int) -> None:
        for h in hashes:
            if h in self.held:
                self.held.discard(h)
                self.journal.removed(h)

    def digest(self) -> CacheDigest:
        return self.journal.digest(self.held, 0.0)


# ---- engine side: the journal ------------------------------------------------------------

def test_a_delta_carries_net_changes_only():
    """A block stored and evicted within one period is in neither list; one evicted and re-stored is in neither."""
    e = _Engine()
    e.store(1, 2)
    e.digest()
    e.store(3)
    e.evict(3)  # in and out within the period
    e.evict(1)
    e.store(1)  # out and back in
    e.evict(2)
    e.store(4)
    delta = e.digest().deltas[-1]
    assert (_set(delta.stored), _set(delta.removed)) == ({4}, {2})


def test_full_set_on_the_first_report_and_every_full_every_reports():
    """Reports 1, 1+F, 1+2F... carry the full set; the others carry deltas only."""
    e = _Engine(full_every=3)
    e.store(1)
    fulls = [e.digest().has_full_set for _ in range(7)]
    assert fulls == [True, False, False, True, False, False, True]


def test_the_chain_holds_the_last_window_of_consecutive_deltas():
    """Each report carries the last `delta_window` deltas, oldest first, ending with its own."""
    e = _Engine(delta_window=3)
    digests = [e.digest() for _ in range(5)]
    assert [d.sequence for d in digests[0].deltas] == [1]
    assert [d.sequence for d in digests[4].deltas] == [3, 4, 5]


def test_tracker_journals_hash_changes_not_vllm_events_and_a_reset_removes_everything():
    """Two vLLM blocks with one hash enter the delta once; a cache reset puts every held block in `removed`."""
    t = KvCacheTracker("r1", epoch=7, block_size=BS)
    tokens = list(range(8))
    t.on_stored(["v1", "v2"], None, tokens)
    t.on_stored(["w1"], None, tokens[:4])  # the same first block recomputed: same hash
    first = t.digest(0.0)
    assert _set(first.deltas[-1].stored) == set(block_hashes(tokens, BS))
    t.on_removed(["v1"])  # w1 still holds that hash
    t.on_all_cleared()
    second = t.digest(1.0)
    assert _set(second.deltas[-1].removed) == set(block_hashes(tokens, BS))
    assert second.all_cleared and second.deltas[-1].all_cleared and not t.digest(2.0).all_cleared


def test_digest_checks_its_chain():
    """A chain must end with the report's own delta and have consecutive sequences; deltas-only has no full set."""
    with pytest.raises(ValueError, match="last delta"):
        CacheDigest("a", 1, 5, None, deltas=(BlockDelta(4),))
    with pytest.raises(ValueError, match="consecutive"):
        CacheDigest("a", 1, 5, None, deltas=(BlockDelta(3), BlockDelta(5)))
    with pytest.raises(ValueError, match="deltas only"):
        CacheDigest("a", 1, 5, None, deltas=(BlockDelta(5),)).hashes()


def test_deltas_after_finds_where_the_router_left_off():
    """deltas_after(n) is the suffix after n, empty when caught up, None when the chain starts too late."""
    d = CacheDigest("a", 1, 5, None, deltas=(BlockDelta(3), BlockDelta(4), BlockDelta(5)))
    assert [x.sequence for x in d.deltas_after(3)] == [4, 5]
    assert d.deltas_after(5) == ()
    assert d.deltas_after(1) is None


def test_delta_digests_pickle_and_rekey_with_their_chain():
    """A deltas-only digest survives pickling (Ray's transport) and rekeying with its chain intact."""
    e = _Engine()
    e.digest()
    e.store(*PROMPT)
    d = e.digest()
    again = rekey(pickle.loads(pickle.dumps(d)), "router-id")
    assert again.replica_id == "router-id" and again.deltas == d.deltas and again.blocks is None


# ---- router side: applying deltas -------------------------------------------------------

@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(history_ttl_s=TTL_S)


def test_deltas_store_and_evict_blocks(index):
    """A delta adds its stored blocks and drops its removed ones, so matches follow the engine."""
    e = _Engine()
    e.store(*PROMPT[:4])
    assert index.apply_digest(e.digest())
    e.store(*PROMPT[4:])
    e.evict(PROMPT[0])
    d = e.digest()
    assert not d.has_full_set and index.apply_digest(d)
    assert index.held_by("a") == set(PROMPT[1:]) and index.match(PROMPT, 0.0) == {}
    e.store(PROMPT[0])
    index.apply_digest(e.digest())
    assert index.match(PROMPT, 0.0) == {"a": 8}


def test_duplicate_and_late_deltas_are_ignored_and_never_resurrect(index):
    """A replayed or reordered report (sequence not newer) changes nothing: an evicted block stays evicted."""
    e = _Engine()
    e.store(*PROMPT)
    first = e.digest()
    index.apply_digest(first)
    e.evict(*PROMPT[2:])
    second = e.digest()
    assert index.apply_digest(second)
    assert index.apply_digest(second) is False
    assert index.apply_digest(first) is False
    assert index.match(PROMPT, 0.0) == {"a": 2}


def test_a_gap_the_chain_bridges_is_applied_from_the_chain(index):
    """Reports lost in between are recovered from the chain of the next one, no full set needed."""
    e = _Engine(delta_window=3)
    index.apply_digest(e.digest())
    e.store(PROMPT[0])
    e.digest()  # lost
    e.store(PROMPT[1])
    e.digest()  # lost
    e.store(PROMPT[2])
    d = e.digest()
    assert not d.has_full_set and index.apply_digest(d)
    assert index.held_by("a") == set(PROMPT[:3]) and index.applied("a") == (1, 4)


def test_a_gap_past_the_chain_keeps_the_last_exact_view_until_a_full_set(index):
    """Beyond the chain and with no full set, nothing is applied; the next full set resyncs."""
    e = _Engine(delta_window=2, full_every=6)
    e.store(PROMPT[0])
    index.apply_digest(e.digest())  # sequence 1 (full)
    for h in PROMPT[1:4]:
        e.store(h)
        e.evict(PROMPT[0])
        e.digest()  # sequences 2-4 lost
    e.store(PROMPT[4])
    d5 = e.digest()
    assert index.apply_digest(d5) is False
    assert index.held_by("a") == {PROMPT[0]} and index.applied("a") == (1, 1)  # the engine's state at report 1
    e.store(PROMPT[5])
    assert e.digest().sequence == 6
    d7 = e.digest()  # 1 + full_every: full
    assert d7.has_full_set and index.apply_digest(d7)
    assert index.held_by("a") == e.held


def test_a_new_epoch_starts_empty_and_its_chain_rebuilds_it(index):
    """A restarted engine's blocks replace the old lifetime's; a chain from sequence 1 needs no full set."""
    old = _Engine(epoch=1)
    old.store(*PROMPT)
    index.apply_digest(old.digest())
    new = _Engine(epoch=2)
    new.store(PROMPT[0])
    new.digest()  # report 1 (full) lost
    new.store(PROMPT[1])
    d = new.digest()
    assert not d.has_full_set and index.apply_digest(d)
    assert index.held_by("a") == set(PROMPT[:2])


def test_a_router_joining_late_waits_for_a_full_set(index):
    """A first report whose chain does not reach sequence 1 applies nothing; the next full set does."""
    e = _Engine(delta_window=2, full_every=4)
    e.store(*PROMPT)
    for _ in range(3):
        e.digest()  # reports 1-3, before this router existed
    assert index.apply_digest(e.digest()) is False  # report 4: chain 3-4
    assert index.held_by("a") == set()
    assert index.apply_digest(e.digest())  # report 5 = 1 + full_every: full
    assert index.held_by("a") == set(PROMPT)


def test_a_reset_inside_a_bridged_gap_forgets_the_routing_history(index):
    """all_cleared in a lost report still reaches the router through the chain."""
    e = _Engine()
    index.apply_digest(e.digest())
    index.on_routed("a", PROMPT, now_s=0.0)
    e.journal.cleared(e.held)
    e.digest()  # lost: it carried the reset
    d = e.digest()
    assert not d.all_cleared and index.apply_digest(d)
    assert index.match(PROMPT, 0.0) == {}


def test_sequence_zero_full_digest_still_applies(index):
    """A full set stamped with sequence 0 (the assumed empty start) is applied as a full set."""
    assert index.apply_digest(CacheDigest.from_hashes("a", 1, 0, PROMPT))
    assert index.match(PROMPT, 0.0) == {"a": 8}


def test_deltas_give_the_same_index_as_full_sets_on_a_random_trace():
    """Random churn, lost/duplicated/reordered reports: the delta-fed view is always an exact past engine state,
    and equals the full-set-fed index whenever both are at the same report."""
    rng = random.Random(11)
    universe = block_hashes(list(range(400 * BS)), BS)
    engines = {rid: _Engine(rid, delta_window=3, full_every=5) for rid in ("a", "b", "c")}
    by_deltas, by_fulls = PrefixIndex(TTL_S), PrefixIndex(TTL_S)
    history: dict[tuple[str, int], frozenset[int]] = {}
    pending: list[CacheDigest] = []
    for step in range(600):
        rid = rng.choice(list(engines))
        e = engines[rid]
        for _ in range(rng.randrange(12)):
            e.store(rng.choice(universe))
        for h in rng.sample(sorted(e.held), min(len(e.held), rng.randrange(10))):
            e.evict(h)
        if rng.random() < 0.02:
            e.journal.cleared(e.held)
            e.held.clear()
        d = e.digest()
        history[(rid, d.sequence)] = frozenset(e.held)
        by_fulls.apply_digest(CacheDigest.from_hashes(rid, d.epoch, d.sequence, e.held))
        fate = rng.random()
        if fate < 0.15:
            continue  # lost
        pending.append(d)
        if fate < 0.25:
            pending.append(d)  # duplicated
        if fate < 0.35 and len(pending) > 1:
            pending[-1], pending[-2] = pending[-2], pending[-1]  # reordered
        if rng.random() < 0.5:
            continue  # held back a little longer
        for late in pending:
            by_deltas.apply_digest(late)
        pending.clear()
        for r in engines:
            applied = by_deltas.applied(r)
            if applied is not None and applied[1] > 0:
                assert by_deltas.held_by(r) == history[(r, applied[1])], (step, r)
                if applied == by_fulls.applied(r):
                    assert by_deltas.held_by(r) == by_fulls.held_by(r)
    for r, e in engines.items():  # one more report each, delivered: both indexes meet the engines
        while not by_deltas.apply_digest(e.digest()):
            pass
        by_fulls.apply_digest(CacheDigest.from_hashes(r, 1, e.journal.sequence + 1, e.held))
        assert by_deltas.held_by(r) == by_fulls.held_by(r) == e.held
    assert by_deltas.num_engine_blocks == by_fulls.num_engine_blocks
    for h in universe:
        assert set(by_deltas.holders(h, 0.0)) == set(by_fulls.holders(h, 0.0))
