"""Which KV blocks one engine holds, rebuilt from vLLM's own KV events (cache truth).

vLLM names blocks by its own hashes (salted per process, so no other process can
recompute them). The router names blocks by kvtide's chained hashes of token ids
(`deployments.routing.block_hash`). This tracker translates: a `BlockStored` event
carries the tokens of its blocks and the vLLM hash of the parent block, so each stored
block's kvtide hash is `chain_hash(kvtide_hash(parent), tokens)`.

    vLLM event                       tracker state
    BlockStored(parent, tokens, hs)  vllm_to_ours[h_i] = chain(ours(parent), tokens_i); held += ours
                                     (no parent: the chain starts at salt_root(the first
                                     block's cache salt, from the event's extra keys))
    BlockRemoved(hs)                 held -= vllm_to_ours.pop(h)
    AllBlocksCleared                 held = {}, vllm_to_ours = {}; remember "cleared"

Every change to `held` (a hash entering or leaving it, not each vLLM event: two vLLM
blocks can hold one hash) is also written to a `DigestJournal`, which builds the
digests: this period's delta plus the last few, and the full set now and then
(`deployments.routing.snapshot` has the protocol).

Tiers: with vLLM's KV offloading (`engine.kv_offload`) the OffloadingConnector stores blocks
to host memory and publishes them with `medium="CPU"`; the engine's own blocks come with
`medium="GPU"` (None from a vLLM that names no medium). Each tier keeps its own state above
(map, held counts, journal): a block moves GPU → CPU → evicted as two independent lives, a
BlockRemoved of one medium never touches the other's set. A CPU-tier block's parent may be
named only on GPU (its own CPU copy evicted, or not stored yet): a stored event's parent is
looked up in its own tier first, then in the other. The CPU tier's digest rides in the GPU
digest (`CacheDigest.cpu`), with its own sequence. Other media (vLLM's STORAGE tiers) are
ignored: the router's cost model knows host memory only.

Pure (no ZMQ, no Ray): `deployments.engine.kv_events` feeds it decoded events.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Sequence

from kvtide.deployments.routing.block_hash import BlockHash, chain_hash, chain_key, held_prefix_blocks, salt_root
from kvtide.deployments.routing.digest_journal import DEFAULT_DELTA_WINDOW, DEFAULT_FULL_EVERY, DigestJournal
from kvtide.deployments.routing.snapshot import CacheDigest


def first_block_salt(event: Any) -> str | None:
    """The cache salt of a `BlockStored` that starts a prompt, from its first block's extra keys.

    vLLM publishes each block's extra keys untagged: the LoRA name, (mm id, offset) pairs,
    the cache salt (first block only) and prompt-embedding digests. The LoRA name is the
    event's own field (chain_key adds it to the chain's root); (mm id, offset) pairs are
    tuples, so the one string that is not the LoRA name is the salt.
    """
    extra_keys = getattr(event, "extra_keys", None)
    if event.parent_block_hash is not None or not extra_keys or not extra_keys[0]:
        return None
    lora_name = getattr(event, "lora_name", None)
    salts = [key for key in extra_keys[0] if isinstance(key, str) and key != lora_name]
    return salts[0] if salts else None


MEDIUM_GPU = "GPU"  # vLLM's names (vllm.distributed.kv_events.MEDIUM_GPU / MEDIUM_CPU)
MEDIUM_CPU = "CPU"


class _Tier:
    """One medium's block set: vLLM hash → kvtide hash, holder counts, and its digest journal."""

    __slots__ = ("vllm_to_ours", "held", "journal")

    def __init__(self, journal: DigestJournal):
        self.vllm_to_ours: dict[Any, BlockHash] = {}
        # A hash can be stored by two vLLM blocks (same prefix recomputed): count holders.
        self.held: dict[BlockHash, int] = {}
        self.journal = journal

    def store(self, vllm_hash: Any, ours: BlockHash) -> None:
        if self.vllm_to_ours.get(vllm_hash) != ours:
            self.vllm_to_ours[vllm_hash] = ours
            count = self.held.get(ours, 0)
            self.held[ours] = count + 1
            if count == 0:
                self.journal.stored(ours)

    def remove(self, vllm_hash: Any) -> None:
        ours = self.vllm_to_ours.pop(vllm_hash, None)
        if ours is None:
            return
        left = self.held.get(ours, 0) - 1
        if left > 0:
            self.held[ours] = left
        elif self.held.pop(ours, None) is not None:
            self.journal.removed(ours)

    def clear(self) -> None:
        self.journal.cleared(self.held)
        self.vllm_to_ours.clear()
        self.held.clear()


class KvCacheTracker:
    """Block sets of one engine replica (GPU, and the CPU tier when offloading), in kvtide hashes; digested
    for `record_routing_stats`."""

    def __init__(self, replica_id: str, epoch: int, block_size: int, *, delta_window: int = DEFAULT_DELTA_WINDOW,
                 full_every: int = DEFAULT_FULL_EVERY):
        self.replica_id = replica_id
        self.epoch = epoch
        self.block_size = block_size
        self._gpu = _Tier(DigestJournal(replica_id, epoch, delta_window=delta_window, full_every=full_every))
        self._cpu = _Tier(DigestJournal(replica_id, epoch, delta_window=delta_window, full_every=full_every))
        self._held = self._gpu.held  # the GPU tier's: what a request's prefix hit reads
        self._cpu_seen = False  # a CPU-tier event arrived: digests carry the tier from then on

    @property
    def num_blocks(self) -> int:
        """GPU-tier blocks held."""
        return len(self._gpu.held)

    @property
    def num_cpu_blocks(self) -> int:
        """CPU-tier (offloaded) blocks held."""
        return len(self._cpu.held)

    def _tier(self, medium: str | None) -> _Tier | None:
        if medium is None or medium == MEDIUM_GPU:
            return self._gpu
        if medium == MEDIUM_CPU:
            self._cpu_seen = True
            return self._cpu
        return None

    def on_stored(self, vllm_hashes: Iterable[Any], parent_vllm_hash: Any | None, token_ids: list[int],
                  cache_salt: str | None = None, medium: str | None = None) -> None:
        tier = self._tier(medium)
        if tier is None:
            return
        if parent_vllm_hash is None:
            parent = salt_root(cache_salt)
        else:
            parent = tier.vllm_to_ours.get(parent_vllm_hash)
            if parent is None:
                other = self._cpu if tier is self._gpu else self._gpu
                parent = other.vllm_to_ours.get(parent_vllm_hash)
        if parent_vllm_hash is not None and parent is None:
            # The parent was stored before we subscribed (or is unknown): the chain
            # cannot be named in kvtide hashes, so these blocks are not advertised.
            return
        bs = self.block_size
        for i, vllm_hash in enumerate(vllm_hashes):
            tokens = token_ids[i * bs:(i + 1) * bs]
            if len(tokens) < bs:
                break
            ours = chain_hash(parent, tokens)
            tier.store(vllm_hash, ours)
            parent = ours

    def on_removed(self, vllm_hashes: Iterable[Any], medium: str | None = None) -> None:
        tier = self._tier(medium)
        if tier is None:
            return
        for vllm_hash in vllm_hashes:
            tier.remove(vllm_hash)

    def on_all_cleared(self) -> None:
        # vLLM's reset clears its GPU prefix cache (reset_prefix_cache); an offloading connector
        # that resets its store publishes its own removals.
        self._gpu.clear()

    def apply(self, event: Any) -> None:
        """Apply one decoded vLLM KV event (BlockStored / BlockRemoved / AllBlocksCleared)."""
        kind = type(event).__name__
        if kind == "BlockStored":
            self.on_stored(event.block_hashes, event.parent_block_hash, list(event.token_ids),
                           chain_key(first_block_salt(event), getattr(event, "lora_name", None)),
                           getattr(event, "medium", None))
        elif kind == "BlockRemoved":
            self.on_removed(event.block_hashes, getattr(event, "medium", None))
        elif kind == "AllBlocksCleared":
            self.on_all_cleared()

    def digest(self, now_s: float) -> CacheDigest:
        """This report period's digest (deltas; the full set when due): one call per report, it advances the sequence.

        The CPU tier's digest rides in it once the engine has published a CPU-tier event (an
        engine without offloading sends exactly the digest it sent before tiers existed).
        """
        gpu = self._gpu.journal.digest(self._gpu.held, now_s)
        if not self._cpu_seen:
            return gpu
        return replace(gpu, cpu=self._cpu.journal.digest(self._cpu.held, now_s))

    def cached_prefix_blocks(self, hashes: Sequence[BlockHash], token_ids: Sequence[int],
                             cache_salt: str | None = None) -> int:
        """How many of a prompt's full blocks, from the first, this replica holds.

        From its chained `hashes` when the request carries them (hashed by the router's side:
        the Ingress frontend, or the routing peer in direct mode), else hashed from `token_ids`
        up to the first miss (a prompt too long for the peer's header). Read from the event loop while the
        listener thread writes: a dict lookup is atomic under the GIL, and an answer one
        event old only shifts an estimate.
        """
        held = self._held
        if not hashes:
            return held_prefix_blocks(token_ids, self.block_size, held, salt_root(cache_salt))
        count = 0
        for block in hashes:
            if block not in held:
                break
            count += 1
        return count
