"""The routing steps the routing peer and the frontend share, and the block-hash header between them."""

from __future__ import annotations

import pytest

from fakes import FakeTokenizer

from kvtide.config import parse_config
from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
from kvtide.deployments.frontend.routing_key import (
    PromptRouting,
    decode_block_hashes,
    encode_block_hashes,
    prompt_block_hashes,
)
from kvtide.deployments.routing.block_hash import block_hashes, salt_root

CONFIG = parse_config({"model": "/m", "served_model_name": "m"})
BS = CONFIG.engine.block_size
TOKENS = list(range(1, 2 * BS + 5))  # two full blocks and a partial one


def test_prompt_hashes_chain_from_the_salt_root():
    """An unsalted prompt hashes from nothing, a salted one from its salt's root (tenants never share blocks)."""
    assert prompt_block_hashes(TOKENS, BS, None) == tuple(block_hashes(TOKENS, BS))
    salted = prompt_block_hashes(TOKENS, BS, "tenant-a")
    assert salted == tuple(block_hashes(TOKENS, BS, parent=salt_root("tenant-a")))
    assert len(salted) == 2 and set(salted).isdisjoint(prompt_block_hashes(TOKENS, BS, None))


def test_hash_header_round_trips_full_64_bit_values():
    """The header decodes to the very hashes, in order, including values above 2**63."""
    hashes = (0, 1, 2**63 + 5, 2**64 - 1)
    assert decode_block_hashes(encode_block_hashes(hashes), 4 * BS + 3, BS) == hashes


@pytest.mark.parametrize("value", [None, "", "not base64!", "AAAA", encode_block_hashes((1, 2, 3))])
def test_hash_header_that_is_absent_malformed_or_for_another_prompt_is_refused(value):
    """None unless the header decodes to exactly one hash per full block of this prompt (then the replica hashes)."""
    assert decode_block_hashes(value, len(TOKENS), BS) is None


def test_only_unsalted_prompts_become_hot_prefixes():
    """observe(): an unsalted prompt seen again and again is a hot prefix, a salted (tenant-private) one never."""
    tracker = HotPrefixTracker(BS)
    routing = PromptRouting(CONFIG, FakeTokenizer(), tracker)
    for _ in range(3):
        routing.observe(TOKENS, routing.hashes(TOKENS, "tenant-a"), "tenant-a")
    assert routing.hottest(8) == []
    for _ in range(3):
        routing.observe(TOKENS, routing.hashes(TOKENS, None), None)
    assert [tokens for tokens, _ in routing.hottest(8)] == [TOKENS[:2 * BS]]


@pytest.mark.parametrize(("policy", "text"), [("ray_prefix", "\x01\x02"), ("prefix_aware", None), ("pow2", None)])
def test_prompt_text_goes_only_to_the_router_that_matches_on_text(policy, text):
    """ray_prefix (Ray's prefix router) gets the prompt's text; kvtide's own policies need none."""
    routing = PromptRouting(parse_config({"routing": {"policy": policy}}), FakeTokenizer(), None)
    assert routing.prompt_text([1, 2]) == text


def test_without_a_tracker_there_are_no_hot_prefixes():
    """A frontend without a tracker (direct mode's engine replica) answers no hot prefixes and counts nothing."""
    routing = PromptRouting(CONFIG, FakeTokenizer(), None)
    for _ in range(3):
        routing.observe(TOKENS, routing.hashes(TOKENS, None), None)
    assert routing.hottest(8) == []
