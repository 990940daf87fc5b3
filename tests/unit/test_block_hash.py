"""Block hashes: chained, stable across processes, full blocks only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtide.deployments.routing.block_hash import block_hashes, chain_hash, held_prefix_blocks

BS = 4
TOKENS = list(range(100, 118))  # 4 full blocks of 4 + 2 trailing tokens


def test_only_full_blocks_are_hashed():
    """A trailing partial block gets no hash (vLLM does not cache it)."""
    assert len(block_hashes(TOKENS, BS)) == 4
    assert block_hashes(TOKENS[:3], BS) == []


def test_chain_matches_block_by_block():
    """block_hashes equals chain_hash applied block by block from no parent."""
    expected, parent = [], None
    for i in range(0, 16, BS):
        parent = chain_hash(parent, TOKENS[i:i + BS])
        expected.append(parent)
    assert block_hashes(TOKENS, BS) == expected


def test_chain_continues_from_a_parent():
    """Hashing a suffix from its parent's hash continues the same chain (the engine-side translation)."""
    full = block_hashes(TOKENS, BS)
    assert block_hashes(TOKENS[8:], BS, parent=full[1]) == full[2:]


def test_same_block_different_parent_differs():
    """The same tokens under a different parent hash to a different value (hashes name prefixes)."""
    block = [7, 7, 7, 7]
    a = block_hashes([1, 2, 3, 4] + block, BS)[1]
    b = block_hashes([1, 2, 3, 5] + block, BS)[1]
    assert a != b
    assert chain_hash(None, block) != chain_hash(a, block)


def test_shared_prefix_shares_hashes():
    """Two prompts sharing 2 blocks share exactly their first 2 hashes."""
    a = block_hashes(TOKENS[:8] + [1, 1, 1, 1], BS)
    b = block_hashes(TOKENS[:8] + [2, 2, 2, 2], BS)
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.parametrize("tokens, block_size", [
    ([0, 1, 2, 3], 4),
    (list(range(32)), 32),
])
def test_hash_is_64_bit_int(tokens, block_size):
    """Hashes are non-negative ints below 2**64."""
    h = block_hashes(tokens, block_size)[0]
    assert isinstance(h, int) and 0 <= h < 2 ** 64


def test_stable_across_processes():
    """A fresh interpreter (different hash seed) computes the same hashes: no Python hash()."""
    code = ("from deployments.routing.block_hash import block_hashes;"
            f"print(block_hashes({TOKENS!r}, {BS}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PYTHONPATH": "."}).stdout
    assert out.strip() == str(block_hashes(TOKENS, BS))


def test_known_value_pins_the_encoding():
    """The first block of [0, 1, 2, 3] hashes to a fixed value (guards the byte layout against drift)."""
    import hashlib

    data = b"".join(t.to_bytes(4, "little") for t in [0, 1, 2, 3])
    expected = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert block_hashes([0, 1, 2, 3], 4) == [expected]


def test_block_size_must_be_positive():
    """A zero block size is rejected, not looped on."""
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0)


def test_salted_chains_differ_at_every_block_and_continue_like_unsalted_ones():
    """Two salts (and no salt) never share a block hash; a salted chain still continues from any parent."""
    from kvtide.deployments.routing.block_hash import salt_root

    tokens = list(range(64))
    chains = [block_hashes(tokens, 16, parent=salt_root(s)) for s in (None, "a", "b")]
    for i in range(4):
        assert len({chain[i] for chain in chains}) == 3
    assert salt_root(None) is None and salt_root("") is None
    salted = chains[1]
    assert block_hashes(tokens[32:], 16, parent=salted[1]) == salted[2:]


def test_held_prefix_blocks_stops_at_the_first_miss():
    """The count of leading full blocks whose chained hash is held, as block_hashes would name them."""
    tokens = list(range(40))  # 5 blocks of 8
    hashes = block_hashes(tokens, 8)
    assert held_prefix_blocks(tokens, 8, set(hashes[:3])) == 3
    assert held_prefix_blocks(tokens, 8, set(hashes)) == 5
    assert held_prefix_blocks(tokens, 8, set(hashes[1:])) == 0  # a chain needs its first block
    assert held_prefix_blocks(tokens[:7], 8, set(hashes)) == 0  # no full block
