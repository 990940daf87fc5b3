"""Chained hashes of full KV blocks: the unit the router and the engine agree on.

A prompt of token ids is cut into blocks of the engine's block size; each FULL block
gets a hash that depends on its tokens and on the hash of the block before it, so a
hash names a whole prefix, not just 32 tokens:

    tokens   [ t0 .. t31 ][ t32 .. t63 ][ t64 .. t95 ][ t96 .. t99 ]
    hashes       h0     ──►    h1     ──►    h2         (partial: not hashed)
    h0 = H(              tokens0)
    h1 = H(bytes(h0) ‖ tokens1)
    h2 = H(bytes(h1) ‖ tokens2)

H is blake2b with an 8-byte digest over the parent hash (8 bytes, little-endian; absent
for the first block) followed by the block's token ids packed as little-endian uint32.
The result must be equal in every process (the ingress computes it per request, the
engine replica recomputes it from vLLM's KV events), so Python's salted `hash()` is
never used. A trailing partial block is not hashed: vLLM only caches full blocks.

Cache salts (vLLM's `cache_salt`, one per tenant): a salted prompt's chain starts from
`salt_root(salt)` instead of nothing, so its hashes differ from every other salt's and
from unsalted ones at every block; vLLM likewise mixes the salt into its first block's
hash, and its `BlockStored` event names the salt in that block's extra keys, which is how
the engine side starts the same chain.

Invariant: `block_hashes(a + b, bs)[len(a) // bs:]` == `block_hashes(b, bs, parent=...)`
when `len(a)` is a multiple of `bs` -- the chain can be continued from any parent,
which is how the engine side translates `BlockStored(parent_block_hash, token_ids)`.
"""

from __future__ import annotations

import sys
from array import array
from hashlib import blake2b
from typing import Container, Iterator, NewType, Sequence

BlockHash = NewType("BlockHash", int)  # 64-bit, unsigned; never a token id

_HASH_BYTES = 8
_TOKEN_TYPECODE = "I"  # 4-byte unsigned on every platform CPython supports
assert array(_TOKEN_TYPECODE).itemsize == 4
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def _pack_tokens(token_ids: Sequence[int]) -> array:
    packed = array(_TOKEN_TYPECODE, token_ids)
    if _BIG_ENDIAN_HOST:  # the hash is defined over little-endian bytes everywhere
        packed.byteswap()
    return packed


def salt_root(salt: str | None) -> BlockHash | None:
    """The parent hash a prompt with this cache salt chains its first block from (None: unsalted)."""
    if not salt:
        return None
    digest = blake2b(b"kvtide-cache-salt\0" + salt.encode("utf-8"), digest_size=_HASH_BYTES).digest()
    return BlockHash(int.from_bytes(digest, "little"))


def chain_key(cache_salt: str | None, lora_name: str | None) -> str | None:
    """What a prompt's block chain starts from: its cache salt and its LoRA adapter.

    vLLM keys both into its block hashes (blocks computed under another adapter or salt are
    never reused), so the router's chains must part the same way; the result goes where a
    cache salt goes (salt_root). A prompt with an adapter counts as salted: its prefixes are
    not warmed into new replicas, whose warm-up prefills run without adapters.
    """
    if lora_name is None:
        return cache_salt
    return f"\0lora\0{lora_name}\0{cache_salt or ''}"


def _parent_bytes(parent: BlockHash | None) -> bytes:
    return b"" if parent is None else parent.to_bytes(_HASH_BYTES, "little")


def chain_hash(parent: BlockHash | None, block_token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block of a prompt).

    The engine replica uses this to translate vLLM KV events: a stored block comes with
    its token ids and its parent, so the replica extends its own chain block by block.
    """
    data = _parent_bytes(parent) + _pack_tokens(block_token_ids).tobytes()
    return BlockHash(int.from_bytes(blake2b(data, digest_size=_HASH_BYTES).digest(), "little"))


def _chained(token_ids: Sequence[int], block_size: int, parent: BlockHash | None) -> Iterator[BlockHash]:
    """The chained hashes of the full blocks of `token_ids`, lazily (a caller may stop at any block)."""
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return
    # Pack once, hash slices of one buffer, and chain on the raw digest bytes (they ARE
    # the parent's little-endian encoding): no per-block packing or int round trip.
    packed = _pack_tokens(token_ids[: num_blocks * block_size]).tobytes()
    step = block_size * 4
    from_bytes = int.from_bytes
    prev = _parent_bytes(parent)
    for start in range(0, num_blocks * step, step):
        prev = blake2b(prev + packed[start:start + step], digest_size=_HASH_BYTES).digest()
        yield BlockHash(from_bytes(prev, "little"))


def held_prefix_blocks(token_ids: Sequence[int], block_size: int, held: Container[BlockHash],
                       parent: BlockHash | None = None) -> int:
    """How many full blocks of `token_ids`, from the first, have their chained hash in `held`.

    `block_hashes` stopped at the first miss: a cold prompt costs one hash, a cached one
    the hashes of its cached part (the engine replica's pending-prefill estimate, in direct
    mode, where nobody hashed the prompt for it).
    """
    if block_size <= 0:
        return 0
    count = 0
    for block in _chained(token_ids, block_size, parent):
        if block not in held:
            break
        count += 1
    return count


def block_hashes(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is dropped)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return list(_chained(token_ids, block_size, parent))
