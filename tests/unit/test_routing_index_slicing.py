"""PrefixIndex work bounded per call: routing-history pruning in budgets, digest deltas in self-contained slices."""

from __future__ import annotations

import random

from fakes import run_slices

from kvtide.deployments.routing import prefix_index
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.prefix_index import EXPIRY_BLOCKS_PER_BOOKED, PrefixIndex
from kvtide.deployments.routing.snapshot import BlockDelta, CacheDigest

BS = 4
TTL_S = 10.0
PROMPT = block_hashes(list(range(32)), BS)  # 8 blocks
OTHER = block_hashes(list(range(1000, 1032)), BS)


def _prompt(i: int, num_blocks: int) -> list:
    return block_hashes([i * 100_000 + t for t in range(num_blocks * BS)], BS)


def test_expire_with_a_budget_stops_mid_entry_and_resumes_there():
    """expire(max_blocks) prunes that many blocks, resuming inside the head entry; expired blocks never match."""
    index = PrefixIndex(history_ttl_s=TTL_S)
    index.on_routed("a", PROMPT, 0.0)
    index.on_routed("b", OTHER, 0.0)
    now_s = TTL_S + 1
    for left in (11, 6, 1):
        index.expire(now_s, max_blocks=5)
        assert index.num_routed_blocks == left
        assert index.match(PROMPT, now_s) == {} and index.match(OTHER, now_s) == {}
    index.expire(now_s)
    assert index.num_routed_blocks == 0


def test_on_routed_prunes_at_most_twice_what_it_books():
    """A booking prunes at most EXPIRY_BLOCKS_PER_BOOKED × its blocks of due history; the next ones take the rest."""
    index = PrefixIndex(history_ttl_s=TTL_S)
    for i in range(4):
        index.on_routed("a", _prompt(i, 64), 0.0)
    now_s = TTL_S + 1
    index.on_routed("b", _prompt(9, 64), now_s)  # 256 blocks due, 128 pruned
    assert index.num_routed_blocks == 4 * 64 - EXPIRY_BLOCKS_PER_BOOKED * 64 + 64
    assert all(index.match(_prompt(i, 64), now_s) == {} for i in range(4))
    index.on_routed("b", _prompt(9, 64), now_s)  # a refresh: the other 128 go
    assert index.num_routed_blocks == 64 and index.match(_prompt(9, 64), now_s) == {"b": 64}


def test_match_equals_a_naive_reference_while_pruning_lags(monkeypatch):
    """With a pruning budget far below the bookings (a backlog of due entries), match and holders still
    count only live history: lookups read expiries while the queue's head is due."""
    monkeypatch.setattr(prefix_index, "MIN_EXPIRY_BLOCKS", 1)
    monkeypatch.setattr(prefix_index, "EXPIRY_BLOCKS_PER_BOOKED", 0)  # 1 block per booking
    rng = random.Random(3)
    prompts = [block_hashes([p * 1000 + i for i in range(12 * BS)], BS) for p in range(3)]
    for trial in range(30):
        index = PrefixIndex(history_ttl_s=TTL_S)
        routed: dict[str, dict] = {}
        now_s = 0.0
        for _ in range(60):
            now_s += rng.choice((0.0, 1.0, 2.0, 4.0))
            rid = rng.choice("abc")
            blocks = rng.choice(prompts)[: rng.randrange(13)]
            index.on_routed(rid, blocks, now_s)
            routed.setdefault(rid, {}).update((h, now_s + TTL_S) for h in blocks)
            at_s = now_s + 0.5
            for prompt in prompts:
                expected = {}
                for r, held in routed.items():
                    depth = 0
                    while depth < len(prompt) and held.get(prompt[depth], float("-inf")) > at_s:
                        depth += 1
                    if depth:
                        expected[r] = depth
                assert index.match(prompt, at_s) == expected, trial
            h = rng.choice(rng.choice(prompts))
            assert index.holders(h, at_s) == {r for r, held in routed.items()
                                              if held.get(h, float("-inf")) > at_s}, trial


def test_a_sliced_delta_takes_slices_of_reported_blocks_and_ends_where_at_once_does():
    """A delta's slices cover max_blocks reported blocks each, building their own sets (no up-front pass); a
    report naming blocks already stored or never held still ends exactly where applying it at once does."""
    old = [1000 + i for i in range(40)]
    stored = [1000 + i for i in range(35, 40)] + [5000 + i for i in range(20)]  # 5 already held
    removed = [1000 + i for i in range(10)] + [9000 + i for i in range(3)]  # 3 never held
    new = set(old[10:]) | set(stored)
    digests = [CacheDigest.from_hashes("a", 1, 1, old),
               CacheDigest(replica_id="a", epoch=1, sequence=2, blocks=None,
                           deltas=(BlockDelta.from_hashes(2, stored, removed),))]
    at_once, sliced = PrefixIndex(history_ttl_s=TTL_S), PrefixIndex(history_ttl_s=TTL_S)
    for d in digests:
        assert at_once.apply_digest(d)
    assert sliced.apply_digest(digests[0])
    def between_slices() -> None:
        held = sliced.held_by("a")
        assert all(sliced.engine_holders(h) == {"a"} for h in held)
        assert sliced.num_engine_blocks == len(held) and sliced.applied("a") == (1, 1)

    slices = run_slices(sliced.apply_digest_steps(digests[1], 4), between_slices)
    assert slices == 4 + 7  # ceil(13 / 4) + ceil(25 / 4)
    assert sliced.held_by("a") == at_once.held_by("a") == frozenset(new) and sliced.applied("a") == (1, 2)
