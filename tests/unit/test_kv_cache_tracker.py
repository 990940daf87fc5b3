"""The engine-side block set rebuilt from vLLM KV events, in the router's hashes."""

from __future__ import annotations

from dataclasses import dataclass

from kvtide.deployments.engine.kv_cache_tracker import KvCacheTracker
from kvtide.deployments.routing.block_hash import block_hashes, chain_key, salt_root

BS = 4


@dataclass
class BlockStored:  # same field names as vllm.distributed.kv_events.BlockStored
    block_hashes: list
    parent_block_hash: object
    token_ids: list


@dataclass
class BlockRemoved:
    block_hashes: list


class AllBlocksCleared:
    pass


def _tracker() -> KvCacheTracker:
    return KvCacheTracker("r1", epoch=7, block_size=BS)


def test_stored_blocks_get_the_routers_chained_hashes():
    """Blocks stored in two events (parent then child) hash exactly as the ingress hashes the prompt."""
    tokens = list(range(100, 112))  # three full blocks
    t = _tracker()
    t.apply(BlockStored(["v1"], None, tokens[:4]))
    t.apply(BlockStored(["v2", "v3"], "v1", tokens[4:12]))
    assert t.digest(0.0).hashes() == frozenset(block_hashes(tokens, BS))


def test_removed_blocks_leave_the_digest():
    """An evicted block is gone from the next digest, so the router stops counting it."""
    tokens = list(range(8))
    t = _tracker()
    t.apply(BlockStored(["a", "b"], None, tokens))
    t.apply(BlockRemoved(["b"]))
    assert t.digest(0.0).hashes() == frozenset(block_hashes(tokens, BS)[:1])


def test_all_cleared_empties_and_flags_the_next_digest_only():
    """A cache reset empties the set and is reported once, in the next digest."""
    t = _tracker()
    t.apply(BlockStored(["a"], None, [1, 2, 3, 4]))
    t.apply(AllBlocksCleared())
    first, second = t.digest(0.0), t.digest(1.0)
    assert first.num_blocks == 0 and first.all_cleared and not second.all_cleared


def test_unknown_parent_is_not_advertised():
    """A chain whose parent was stored before we subscribed cannot be named, so it is skipped."""
    t = _tracker()
    t.apply(BlockStored(["x"], "never-seen", [1, 2, 3, 4]))
    assert t.num_blocks == 0


def test_partial_block_is_ignored_and_duplicates_count_once():
    """Only full blocks count, and a block re-announced (prefix reuse) is held once until removed."""
    t = _tracker()
    t.apply(BlockStored(["a"], None, [1, 2, 3, 4, 5, 6]))
    t.apply(BlockStored(["a"], None, [1, 2, 3, 4]))
    assert t.num_blocks == 1
    t.apply(BlockRemoved(["a"]))
    assert t.num_blocks == 0


def test_digests_are_sequenced_within_an_epoch():
    """Each digest carries the engine epoch and a rising sequence, so routers drop stale ones."""
    t = _tracker()
    a, b = t.digest(0.0), t.digest(1.0)
    assert (a.epoch, a.sequence) == (7, 1) and b.is_newer_than(a.epoch, a.sequence)


def _vllm_stored(hashes, parent, tokens, extra_keys=None, lora_name=None):
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored

    return VllmBlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                           lora_id=None, medium="GPU", lora_name=lora_name, extra_keys=extra_keys)


def test_a_salted_prompt_gets_the_routers_salted_chain():
    """vLLM's event names the cache salt in the first block's extra keys; the chain starts at that salt's root."""

    tokens = list(range(100, 112))
    t = _tracker()
    t.apply(_vllm_stored(["v1", "v2"], None, tokens[:8], extra_keys=[("tenant-a",), None]))
    t.apply(_vllm_stored(["v3"], "v2", tokens[8:12], extra_keys=[None]))
    held = t.digest(0.0).hashes()
    assert held == frozenset(block_hashes(tokens, BS, parent=salt_root("tenant-a")))
    assert held.isdisjoint(block_hashes(tokens, BS)) and held.isdisjoint(
        block_hashes(tokens, BS, parent=salt_root("tenant-b")))


def test_an_adapters_blocks_chain_from_the_adapters_own_root():
    """A LoRA adapter's blocks chain from chain_key(salt, adapter), as the router hashes its prompts; the adapter's
    name is never taken for a salt, and its chain is apart from the base model's and from another adapter's."""
    tokens = list(range(4))
    t = _tracker()
    t.apply(_vllm_stored(["v1"], None, tokens, extra_keys=[("my-lora",)], lora_name="my-lora"))
    t.apply(_vllm_stored(["v2"], None, tokens, extra_keys=[("my-lora", "tenant-a")], lora_name="my-lora"))
    held = t.digest(0.0).hashes()
    assert held == frozenset(block_hashes(tokens, BS, parent=salt_root(chain_key(None, "my-lora")))
                             + block_hashes(tokens, BS, parent=salt_root(chain_key("tenant-a", "my-lora"))))
    assert held.isdisjoint(block_hashes(tokens, BS)) and held.isdisjoint(
        block_hashes(tokens, BS, parent=salt_root(chain_key(None, "other-lora"))))


def test_cached_prefix_blocks_from_hashes_or_tokens():
    """The replica's own view of a prompt's cached prefix: from the router's hashes, or hashed up to the first miss."""
    tracker = _tracker()
    tokens = list(range(20))  # 5 blocks
    tracker.apply(BlockStored(["v0", "v1", "v2"], None, tokens[:12]))
    hashes = block_hashes(tokens, BS)
    assert tracker.cached_prefix_blocks(hashes, tokens) == 3
    assert tracker.cached_prefix_blocks((), tokens) == 3  # direct mode: nobody hashed it
    assert tracker.cached_prefix_blocks((), [99] + tokens[1:]) == 0  # first block differs
    assert tracker.cached_prefix_blocks((), tokens, cache_salt="tenant") == 0  # another tenant's chain
