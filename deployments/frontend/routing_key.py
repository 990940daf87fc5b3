"""What a router needs from a prompt, computed the same way wherever a prompt is routed.

Two places route a prompt before an engine sees it, and both take the same steps:

    routing peer (direct mode, the default)      Ingress replica's frontend (ingress mode)
    HAProxy consults it before every POST        its Ray request router runs in-process
                      │                                        │
                      └──────────── PromptRouting ─────────────┘
        block hashes    chained from the prompt's cache_salt root (salt_root), full blocks only
        hot prefixes    an unsalted prompt is counted by the node's HotPrefixTracker; a salted
                        (tenant-private) prefix is never warmed into a new replica's shared cache
        prompt text     only for the ray_prefix baseline (Ray's prefix router matches on text)

The hashes then travel with the request, so the engine replica never hashes the prompt
again: in ingress mode inside `GenerateRequest.block_hashes`, in direct mode in the
router-owned header `ROUTED_HASHES_HEADER` beside the token ids (prompts.py).
"""

from __future__ import annotations

import base64
import binascii
import sys
import time
from array import array
from typing import Any, Sequence

from kvtide.config import KvtideConfig
from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
from kvtide.deployments.tenancy import is_tenant_salt
from kvtide.deployments.routing.block_hash import BlockHash, block_hashes, salt_root

# In HAProxy's `x-serve-router-` namespace: stripped from client requests before the routing
# peer's headers are applied, so only the peer can set it (as ROUTED_TOKENS_HEADER).
ROUTED_HASHES_HEADER = "x-serve-router-kvtide-block-hashes"
_HASH_TYPECODE = "Q"
assert array(_HASH_TYPECODE).itemsize == 8
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> tuple[BlockHash, ...]:
    """The chained hashes of a prompt's full blocks, salted by its cache_salt (pure: any thread)."""
    return tuple(block_hashes(token_ids, block_size, parent=salt_root(cache_salt)))


def encode_uints(values: Sequence[int], typecode: str) -> str:
    """Unsigned ints as a header value: base64 of their little-endian `array(typecode)` bytes."""
    packed = array(typecode, values)
    if _BIG_ENDIAN_HOST:  # the header is little-endian on every host
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def decode_uints(value: str | None, typecode: str) -> array | None:
    """The ints of an `encode_uints` value; None when absent or malformed."""
    if not value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    packed = array(typecode)
    if len(raw) % packed.itemsize:
        return None
    packed.frombytes(raw)
    if _BIG_ENDIAN_HOST:
        packed.byteswap()
    return packed


def encode_block_hashes(hashes: Sequence[BlockHash]) -> str:
    """Block hashes as a header value (uint64 each), in prompt order."""
    return encode_uints(hashes, _HASH_TYPECODE)


def decode_block_hashes(value: str | None, num_prompt_tokens: int, block_size: int) -> tuple[BlockHash, ...] | None:
    """The hashes of an `encode_block_hashes` value; None when absent, malformed or not one per full block.

    The count check ties the header to the prompt it came with: a mismatch means the
    replica hashes for itself rather than trusting hashes of some other prompt.
    """
    packed = decode_uints(value, _HASH_TYPECODE)
    if packed is None or len(packed) != num_prompt_tokens // block_size:
        return None
    return tuple(BlockHash(h) for h in packed)


class PromptRouting:
    """The routing steps the routing peer and an Ingress replica's frontend share (see module doc)."""

    def __init__(self, config: KvtideConfig, tokenizer: Any, hot_prefixes: HotPrefixTracker | None):
        self.block_size = config.engine.block_size
        self.tokenizer = tokenizer
        self.hot_prefixes = hot_prefixes
        self.sends_prompt_text = config.routing.policy == "ray_prefix"

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> tuple[BlockHash, ...]:
        return prompt_block_hashes(token_ids, self.block_size, cache_salt)

    def observe(self, token_ids: Sequence[int], hashes: Sequence[BlockHash], cache_salt: str | None) -> None:
        """Count a routed prompt toward the hot prefixes: an unsalted one, or one salted only by its tenant
        (tenancy.py: a new replica prefills it under that salt, so only that tenant reuses it); never one the
        client salted itself or an adapter's (warm-up runs without adapters)."""
        if self.hot_prefixes is not None and hashes and (cache_salt is None or is_tenant_salt(cache_salt)):
            self.hot_prefixes.observe(token_ids, hashes, time.monotonic(), cache_salt)

    def prompt_text(self, token_ids: Sequence[int]) -> str | None:
        """The prompt as text for a router that matches on text (ray_prefix); None for the others."""
        return self.tokenizer.decode(token_ids) if self.sends_prompt_text else None

    def hottest(self, limit: int) -> list[tuple[list[int], float]]:
        """The shared prefixes a new engine replica should prefill (empty without a tracker)."""
        if self.hot_prefixes is None:
            return []
        return self.hot_prefixes.hottest(time.monotonic(), limit=limit)
