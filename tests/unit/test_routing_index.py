"""PrefixIndex: engine truth from digests, optimistic routing history with a TTL, prefix matching."""

from __future__ import annotations

import pickle
import random

import pytest

from fakes import run_slices

from kvtide.deployments.routing.block_hash import BlockHash, block_hashes
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import BlockDelta, CacheDigest

BS = 4
TTL_S = 10.0
PROMPT = block_hashes(list(range(32)), BS)  # 8 blocks
OTHER = block_hashes(list(range(1000, 1032)), BS)


def digest(replica: str, hashes, seq: int = 1, *, epoch: int = 1, all_cleared: bool = False) -> CacheDigest:
    return CacheDigest.from_hashes(replica, epoch, seq, hashes, all_cleared=all_cleared)


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(history_ttl_s=TTL_S)


@pytest.mark.parametrize("held, expected", [
    ({"a": PROMPT}, {"a": 8}),
    ({"a": PROMPT[:3]}, {"a": 3}),
    ({"a": PROMPT, "b": PROMPT[:5]}, {"a": 8, "b": 5}),
    ({"a": PROMPT[1:]}, {}),                       # missing first block: nothing reusable
    ({"a": PROMPT[:2] + PROMPT[3:]}, {"a": 2}),    # a hole ends the prefix
    ({"a": OTHER}, {}),
])
def test_match_is_longest_prefix_per_replica(index, held, expected):
    """match() counts blocks up to each replica's first miss; replicas matching nothing are absent."""
    for seq, (rid, hashes) in enumerate(held.items()):
        index.apply_digest(digest(rid, hashes, seq))
    assert index.match(PROMPT, now_s=0.0) == expected


def test_digest_replaces_so_evictions_are_seen(index):
    """A later digest without the blocks removes them: evicted prefixes stop matching."""
    index.apply_digest(digest("a", PROMPT, 1))
    index.apply_digest(digest("a", PROMPT[:2], 2))
    assert index.match(PROMPT, 0.0) == {"a": 2}
    assert index.num_engine_blocks == 2


def test_stale_digest_is_ignored(index):
    """A digest with an older sequence of the same epoch does not resurrect evicted blocks."""
    index.apply_digest(digest("a", PROMPT[:2], 5))
    assert index.apply_digest(digest("a", PROMPT, 4)) is False
    assert index.match(PROMPT, 0.0) == {"a": 2}


def test_new_epoch_is_applied_even_with_lower_sequence(index):
    """A restarted engine (new epoch) starts its sequence over and is still applied."""
    index.apply_digest(digest("a", PROMPT, 9, epoch=1))
    assert index.apply_digest(digest("a", PROMPT[:1], 1, epoch=2)) is True
    assert index.match(PROMPT, 0.0) == {"a": 1}


def test_older_epoch_digest_is_ignored_and_newer_epoch_replaces(index):
    """A late digest from a previous engine lifetime is ignored, whatever its sequence; a later lifetime replaces."""
    index.apply_digest(digest("a", PROMPT[:2], 1, epoch=2))
    assert index.apply_digest(digest("a", PROMPT, 9, epoch=1)) is False
    assert index.match(PROMPT, 0.0) == {"a": 2}
    assert index.apply_digest(digest("a", PROMPT[:5], 1, epoch=3)) is True
    assert index.match(PROMPT, 0.0) == {"a": 5}
    assert index.num_engine_blocks == 5


def test_routing_history_attracts_before_first_digest(index):
    """Blocks routed to a replica count as held there before any digest arrives."""
    index.on_routed("a", PROMPT[:6], now_s=100.0)
    assert index.match(PROMPT, now_s=100.5) == {"a": 6}


def test_routing_history_decays_after_ttl(index):
    """Unconfirmed routing history stops matching once the TTL has passed."""
    index.on_routed("a", PROMPT, now_s=100.0)
    assert index.match(PROMPT, now_s=100.0 + TTL_S - 0.01) == {"a": 8}
    assert index.match(PROMPT, now_s=100.0 + TTL_S) == {}
    index.expire(now_s=100.0 + TTL_S)
    assert index.num_routed_blocks == 0


def test_routing_history_confirmed_by_digest_outlives_ttl(index):
    """A block routed and then reported by the engine keeps matching after the history TTL."""
    index.on_routed("a", PROMPT, now_s=0.0)
    index.apply_digest(digest("a", PROMPT[:4]))
    index.expire(now_s=TTL_S + 1)
    assert index.match(PROMPT, now_s=TTL_S + 1) == {"a": 4}


def test_rerouting_refreshes_the_ttl(index):
    """Routing the same prefix again extends its expiry; the older queue item does not delete it."""
    index.on_routed("a", PROMPT, now_s=0.0)
    index.on_routed("a", PROMPT, now_s=5.0)
    index.expire(now_s=TTL_S + 1)
    assert index.match(PROMPT, now_s=TTL_S + 1) == {"a": 8}


def test_history_and_engine_truth_merge(index):
    """Engine truth on one replica and routing history on another both count."""
    index.apply_digest(digest("a", PROMPT[:3]))
    index.on_routed("b", PROMPT, now_s=0.0)
    assert index.match(PROMPT, now_s=1.0) == {"a": 3, "b": 8}


def test_all_cleared_wipes_a_replica(index):
    """An all_cleared digest drops the replica's engine set and its routing history."""
    index.apply_digest(digest("a", PROMPT, 1))
    index.on_routed("a", OTHER, now_s=0.0)
    index.apply_digest(digest("a", [], 2, all_cleared=True))
    assert index.match(PROMPT, 1.0) == {}
    assert index.match(OTHER, 1.0) == {}


def test_remove_replica_forgets_everything(index):
    """remove_replica drops both sources for that replica and leaves others intact."""
    index.apply_digest(digest("a", PROMPT))
    index.apply_digest(digest("b", PROMPT[:2]))
    index.on_routed("a", OTHER, now_s=0.0)
    index.remove_replica("a")
    assert index.match(PROMPT, 1.0) == {"b": 2}
    assert index.match(OTHER, 1.0) == {}
    assert set(index.replicas()) == {"b"}


def test_a_reused_bit_is_matched_under_its_new_replica(index):
    """match names holders through a memo of bit masks: a bit that changes hands names its new replica."""
    index.apply_digest(digest("a", PROMPT))
    index.apply_digest(digest("b", PROMPT))
    assert index.match(PROMPT, 0.0) == {"a": 8, "b": 8}
    index.remove_replica("a")
    index.apply_digest(digest("c", PROMPT))  # given a's freed bit
    assert index.match(PROMPT, 0.0) == {"b": 8, "c": 8}


def test_digest_round_trips_compactly():
    """A digest pickles to ~8 bytes per block and decodes to the same hash set."""
    hashes = [BlockHash(h) for h in range(0, 2 ** 64 - 1, 2 ** 50)]
    d = CacheDigest.from_hashes("a", 1, 1, hashes)
    assert d.num_blocks == len(hashes)
    assert pickle.loads(pickle.dumps(d)).hashes() == frozenset(hashes)
    assert len(pickle.dumps(d)) < 8 * len(hashes) + 300


def test_ttl_must_be_positive():
    """A zero TTL is rejected: routing history would never count."""
    with pytest.raises(ValueError, match="history_ttl_s"):
        PrefixIndex(history_ttl_s=0)


def _naive_match(held_engine: dict[str, set], routed: dict[str, dict], hashes, now_s: float) -> dict[str, int]:
    """Reference: per replica, count leading blocks it holds (engine truth or unexpired routing)."""
    out = {}
    for rid in set(held_engine) | set(routed):
        depth = 0
        for h in hashes:
            if h in held_engine.get(rid, ()) or routed.get(rid, {}).get(h, float("-inf")) > now_s:
                depth += 1
            else:
                break
        if depth:
            out[rid] = depth
    return out


def test_match_equals_a_naive_walk_on_random_indexes():
    """The set-based walk (with its subset fast path) gives exactly the per-replica first-miss depth."""
    rng = random.Random(4)
    long_prompt = block_hashes(list(range(24 * BS)), BS)  # 24 blocks
    for trial in range(200):
        index = PrefixIndex(history_ttl_s=TTL_S)
        engine: dict[str, set] = {}
        routed: dict[str, dict] = {}
        for rid in ("a", "b", "c", "d"):
            held = {h for h in long_prompt[: rng.randrange(25)] if rng.random() > 0.05}  # prefixes with holes
            engine[rid] = held
            index.apply_digest(digest(rid, held, trial + 1))
            if rng.random() < 0.5:
                routed_at = rng.uniform(0.0, 2 * TTL_S)
                blocks = long_prompt[: rng.randrange(25)]
                index.on_routed(rid, blocks, routed_at)
                routed[rid] = {h: routed_at + TTL_S for h in blocks}
        now_s = 2 * TTL_S
        assert index.match(long_prompt, now_s) == _naive_match(engine, routed, long_prompt, now_s), trial


def test_routing_history_equals_a_naive_reference_through_refreshes_expiry_and_removals():
    """Repeated bookings (refreshes), pruning, digests that clear, and removals whose bits are reused
    by new replicas: match and holders agree with a plain per-replica {block: latest expiry} at
    every step. Bookings on whole seconds, lookups half a second later, so the pruning lookahead
    (which may drop an entry up to EXPIRY_LOOKAHEAD_S early) never reaches a live entry."""
    rng = random.Random(11)
    prompts = [block_hashes([p * 1000 + i for i in range(24 * BS)], BS) for p in range(3)]
    for trial in range(60):
        index = PrefixIndex(history_ttl_s=TTL_S)
        engine: dict[str, set] = {}
        routed: dict[str, dict] = {}
        seqs: dict[str, int] = {}
        names = iter(f"r{i}" for i in range(1000))
        live = [next(names) for _ in range(4)]
        now_s = 0.0
        for _ in range(40):
            now_s += rng.choice((0.0, 1.0, 1.0, 3.0))
            action = rng.random()
            rid = rng.choice(live)
            if action < 0.6:
                blocks = rng.choice(prompts)[: rng.randrange(25)]
                index.on_routed(rid, blocks, now_s)
                routed.setdefault(rid, {}).update((h, now_s + TTL_S) for h in blocks)
            elif action < 0.8:
                held = {h for h in rng.choice(prompts)[: rng.randrange(25)] if rng.random() > 0.1}
                seqs[rid] = seqs.get(rid, 0) + 1
                cleared = rng.random() < 0.3
                assert index.apply_digest(digest(rid, held, seqs[rid], all_cleared=cleared))
                engine[rid] = held
                if cleared:
                    routed.pop(rid, None)
            else:  # a replica goes away; a new one (maybe reusing its bit) takes its place
                index.remove_replica(rid)
                engine.pop(rid, None), routed.pop(rid, None), seqs.pop(rid, None)
                live[live.index(rid)] = next(names)
            at_s = now_s + 0.5
            for prompt in prompts:
                assert index.match(prompt, at_s) == _naive_match(engine, routed, prompt, at_s), trial
            h = rng.choice(rng.choice(prompts))
            expected = {r for r in live if h in engine.get(r, ()) or routed.get(r, {}).get(h, float("-inf")) > at_s}
            assert index.holders(h, at_s) == expected, trial


def _consistent(index: PrefixIndex, rid: str) -> bool:
    """Both directions of the holder relation agree for `rid`."""
    held = index._engine_blocks.get(rid, set())
    return (all(rid in index.engine_holders(h) for h in held)
            and all(h in held for h in index._engine if rid in index.engine_holders(h)))


def test_a_digest_applied_in_slices_ends_where_applying_it_at_once_does():
    """Slices of max_blocks: one yield per slice, consistent between slices, `applied` moves only at the end."""
    old = [1000 + i for i in range(250)]
    new = old[100:] + [5000 + i for i in range(170)]  # 100 removed, 170 stored
    digests = [CacheDigest.from_hashes("a", 1, 1, old),
               CacheDigest.from_hashes("a", 1, 2, new, deltas=(BlockDelta.from_hashes(2, new[150:], old[:100]),))]
    at_once, sliced = PrefixIndex(history_ttl_s=10.0), PrefixIndex(history_ttl_s=10.0)
    for d in digests:
        assert at_once.apply_digest(d)
    assert sliced.apply_digest(digests[0])
    def between_slices() -> None:
        assert _consistent(sliced, "a") and sliced.applied("a") == (1, 1)

    slices = run_slices(sliced.apply_digest_steps(digests[1], 64), between_slices)
    assert slices == 2 + 3  # ceil(100 / 64) + ceil(170 / 64)
    assert sliced.held_by("a") == at_once.held_by("a") == frozenset(new) and sliced.applied("a") == (1, 2)


def test_match_ignores_expired_routing_history_even_when_routing_times_went_back(index):
    """match prunes expired history first; a clock that went back makes it read each expiry (no stale hit)."""
    index.on_routed("a", PROMPT, now_s=5.0)  # live until 15
    assert index.match(PROMPT, now_s=14.0) == {"a": 8}
    assert index.match(PROMPT, now_s=15.0) == {}
    index.on_routed("b", OTHER, now_s=20.0)  # until 30: heads the expiry queue
    index.on_routed("c", PROMPT, now_s=1.0)  # until 11, queued behind 30: out of time order, not pruned at 12
    index.on_routed("c", PROMPT[:1], now_s=19.0)  # the first block refreshed until 29
    assert index.match(PROMPT, now_s=12.0) == {"c": 1}  # blocks 2-8 expired at 11
