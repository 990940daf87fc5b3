"""Which hot prefixes a new replica prefills before taking traffic (`plan_warmup`)."""

from __future__ import annotations

import pytest

from kvtide.autoscaling.warm_start import plan_warmup

SYSTEM = list(range(100, 164))          # 64-token system prompt
RAG_A = SYSTEM + list(range(500, 564))  # system prompt + document A (128 tokens)
RAG_B = SYSTEM + list(range(600, 632))  # system prompt + document B (96 tokens)
OTHER = list(range(900, 932))           # unrelated 32-token prefix


def test_hottest_first_within_budget():
    """Prefixes come hottest first and stop at the token budget."""
    hot = [(OTHER, 5), (SYSTEM, 50)]
    assert plan_warmup(hot, token_budget=96, kv_capacity_tokens=10_000, max_prefixes=8) == [SYSTEM, OTHER]
    assert plan_warmup(hot, token_budget=64, kv_capacity_tokens=10_000, max_prefixes=8) == [SYSTEM]


def test_shared_stem_is_paid_once():
    """Prefixes sharing a stem cost only their new tokens: 64 + 64 + 32 fits a 160-token budget."""
    hot = [(RAG_A, 30), (RAG_B, 20)]
    assert plan_warmup(hot, token_budget=160, kv_capacity_tokens=10_000, max_prefixes=8) == [RAG_A, RAG_B]


def test_extension_replaces_the_prefix_it_covers():
    """A chosen prefix that a later pick extends is dropped: prefilling the extension caches it."""
    hot = [(SYSTEM, 50), (OTHER, 40), (RAG_A, 30)]
    plan = plan_warmup(hot, token_budget=1000, kv_capacity_tokens=10_000, max_prefixes=8)
    assert plan == [RAG_A, OTHER]


def test_covered_prefix_is_skipped():
    """A prefix already inside a chosen longer one is not prefilled again."""
    hot = [(RAG_A, 50), (SYSTEM, 40)]
    assert plan_warmup(hot, token_budget=1000, kv_capacity_tokens=10_000, max_prefixes=8) == [RAG_A]


def test_kv_capacity_bounds_the_plan():
    """Warm prefixes never take more than max_kv_fraction of the replica's KV cache."""
    hot = [(RAG_A, 50), (OTHER, 10)]
    assert plan_warmup(hot, token_budget=10_000, kv_capacity_tokens=200, max_prefixes=8) == [OTHER]
    assert plan_warmup(hot, token_budget=10_000, kv_capacity_tokens=200, max_prefixes=8,
                       max_kv_fraction=1.0) == [RAG_A, OTHER]


def test_a_prefix_too_big_does_not_block_smaller_ones():
    """A hot prefix over the remaining budget is passed over and colder ones that fit are taken."""
    hot = [(RAG_A, 90), (OTHER, 10)]
    assert plan_warmup(hot, token_budget=100, kv_capacity_tokens=10_000, max_prefixes=8) == [OTHER]


def test_max_prefixes_bounds_the_count():
    """No more than max_prefixes prompts are prefilled."""
    hot = [([i] * 16, 100 - i) for i in range(10)]
    assert len(plan_warmup(hot, token_budget=10_000, kv_capacity_tokens=10_000, max_prefixes=3)) == 3


def test_duplicates_merge_and_blocks_are_whole():
    """Duplicate prefixes add their hits; prefixes are cut to whole KV blocks and too-short ones dropped."""
    short = list(range(10))
    hot = [(OTHER + [1, 2, 3], 1), (OTHER, 1), (SYSTEM, 1), (short, 99)]
    plan = plan_warmup(hot, token_budget=1000, kv_capacity_tokens=10_000, max_prefixes=8, block_size=16)
    assert plan == [OTHER, SYSTEM]


@pytest.mark.parametrize("budget, capacity, max_prefixes", [(0, 1000, 4), (1000, 0, 4), (1000, 1000, 0)])
def test_nothing_to_do(budget, capacity, max_prefixes):
    """A zero budget, capacity or prefix count plans nothing."""
    assert plan_warmup([(SYSTEM, 5)], budget, capacity, max_prefixes) == []


def test_hitless_and_empty_prefixes_are_ignored():
    """Prefixes with no hits or no tokens are never prefilled."""
    assert plan_warmup([([], 9), (SYSTEM, 0)], 1000, 10_000, 4) == []


def test_the_fleet_view_merges_every_routers_list_and_skips_failures():
    """Two routers that each saw a prefix count it twice; a router that failed to answer is skipped."""
    from kvtide.autoscaling.warm_start import fleet_view

    a, b = [1, 2, 3, 4], [9, 9, 9, 9]
    views = [[(a, 3.0)], RuntimeError("replica gone"), [(a, 2.0), (b, 4.0)]]
    merged = fleet_view(views)
    assert merged == [(a, 3.0), (a, 2.0), (b, 4.0)]
    # a: 5 hits over the fleet beats b's 4, though the second router alone ranks b first.
    assert plan_warmup(merged, token_budget=4, kv_capacity_tokens=100, max_prefixes=1, max_kv_fraction=1.0) == [a]
