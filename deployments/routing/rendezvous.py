"""Rendezvous (highest-random-weight) hashing: routers that share no state agree on replicas.

Every router instance (one per ingress replica, one per routing peer) ranks the same
replica ids for the same key the same way, with no coordination:

    weight(key, r) = mix64(key) XOR id64(r), times a 64-bit odd constant, mod 2^64
    order(key)     = replica ids by weight, highest first

Why rendezvous and not a hash ring: adding or removing one replica changes the first
choice of only the keys that replica wins or held (about 1/N of them), and it needs no
ring state to keep in sync. Why this weight: it is two integer operations per replica,
paid for every candidate at every decision, where a full mixing round per replica would
cost several times more. The key is mixed once per decision and replica ids are hashed
once per process (blake2b, as block hashes are, never Python's salted `hash()`), so both
sides of the XOR are well spread and one multiply suffices: each replica is the first
choice about 1/N of the time and each ordered first/second pair about 1/(N(N-1))
(tests/unit/test_routing_agreement.py pins the first choices' spread). The weight must be equal in every process, so nothing here is salted.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Iterable, Sequence

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # odd: multiplication by it is a bijection mod 2^64
_MAX_CACHED_IDS = 4096  # replica ids seen by one process; cleared when exceeded (ids churn on restarts)
_id_hashes: dict[str, int] = {}


def hash_str(text: str) -> int:
    """A 64-bit, process-independent hash of a string (session keys, replica ids)."""
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "little")


def id_hash(replica_id: str) -> int:
    """`hash_str(replica_id)`, cached: a router sees the same few replica ids every decision."""
    h = _id_hashes.get(replica_id)
    if h is None:
        if len(_id_hashes) >= _MAX_CACHED_IDS:
            _id_hashes.clear()
        h = _id_hashes[replica_id] = hash_str(replica_id)
    return h


def mix64(key: int) -> int:
    """splitmix64's finalizer: spreads a key's entropy over all 64 bits (once per decision)."""
    x = key & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def weights(key: int, replica_ids: Iterable[str]) -> dict[str, int]:
    """Rendezvous weight of each replica for `key` (higher wins)."""
    mixed = mix64(key)
    get = _id_hashes.get
    return {rid: ((mixed ^ (get(rid) or id_hash(rid))) * _GOLDEN64) & _MASK64 for rid in replica_ids}


def top(key: int, replica_ids: Sequence[str], k: int) -> list[str]:
    """The `k` replicas with the highest weight for `key`, highest first."""
    w = weights(key, replica_ids)
    return sorted(w, key=w.__getitem__, reverse=True)[:k]
