"""Scorers: what each candidate would cost a request, in prefill-token equivalents.

One unit for every scorer, so their costs add without weights: a cost is the tokens of
prefill work (or its equivalent in waiting) the request meets on that replica. A replica
ranks by the sum, `prefix_cost + queue_cost`, lowest first (the picker).

    match        gpu(r)  the request's leading blocks r holds on GPU (engine truth ∪ this router's
                         routing history), from `PrefixIndex.match`
                 cpu(r)  the blocks right after those that r's CPU tier holds (vLLM's offloading
                         connector loads them on a GPU miss), engine truth only
    replication  a hot prefix group is credited as held on GPU, up to its shared prefix, on
                 k replicas chosen by rendezvous (deployments.routing.replication)
    prefix cost  (n − cached(r) − cpu'(r)) × block_size × uncached_weight     recompute
                 + cpu'(r) × block_size × cpu_block_weight(r)                 load from host
                 (cached(r): gpu(r), or the credit on a hot group's member; cpu'(r): the CPU-tier
                  blocks past it)
    queue cost   pend(r) + tokens_per_queued_request × load(r)               work ahead of it
    session      the replica of the session's last turn (the picker puts it first under the guard)

Why a CPU-tier block costs `block_size × cpu_block_weight` and not a recompute: vLLM loads it
over the host link instead of running the model on it; the weight is the load time of a block
relative to its prefill time (`cpu_block_weight`, from the engine's measured prefill and
onload rates), in (0, 1]. Its `uncached_weight` is 1: a load spends none of the fleet's
prefill capacity, only the request's wait. So GPU (0) < CPU (≤ block_size) < none
(block_size × uncached_weight ≥ block_size) per block, the order a request prefers them in,
and against load as every other cost.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.replication import (PrefixDemand, common_prefix_blocks, replica_count,
                                                     replica_set)
from kvtide.deployments.routing.sessions import SessionTable
from kvtide.deployments.routing.snapshot import ReplicaSnapshot

NOT_HOT: tuple[frozenset[str], int, int] = (frozenset(), 0, 1)
# A CPU-tier hit is never free: the request waits for the copy, and the blocks take GPU room.
# The floor keeps a replica holding the prefix on GPU ahead of one holding it on host memory
# even when an engine measures a very fast link.
MIN_CPU_BLOCK_WEIGHT = 0.01


def cpu_block_weight(prefill_tokens_per_s: float, onload_tokens_per_s: float) -> float:
    """The cost of loading one block from the CPU tier relative to prefilling it: prefill rate ÷ onload rate,
    in [MIN_CPU_BLOCK_WEIGHT, 1]; 1 (no better than a recompute) while either rate is unknown (0)."""
    if prefill_tokens_per_s <= 0 or onload_tokens_per_s <= 0:
        return 1.0
    return min(1.0, max(MIN_CPU_BLOCK_WEIGHT, prefill_tokens_per_s / onload_tokens_per_s))


def match_gpu(request_hashes: Sequence[BlockHash], ids: Sequence[str], index: PrefixIndex, now_s: float,
              prefix_match: Mapping[str, int] | None = None) -> list[int]:
    """Per candidate, the request's leading blocks held on GPU. `prefix_match`: the index's match when the
    caller has it already (the agreement check passes engine truth alone); None: `index.match`."""
    if prefix_match is None:
        prefix_match = index.match(request_hashes, now_s) if request_hashes else {}
    if not prefix_match:
        return [0] * len(ids)
    get = prefix_match.get
    return [get(rid, 0) for rid in ids]


def match_cpu(request_hashes: Sequence[BlockHash], ids: Sequence[str], gpu_blocks: Sequence[int],
              cpu_index: PrefixIndex | None) -> list[int] | None:
    """Per candidate, the blocks right after its GPU match that its CPU tier holds; None when no replica
    reported a CPU tier (the common case costs nothing)."""
    if cpu_index is None or not cpu_index.num_engine_blocks or not request_hashes:
        return None
    # The CPU tier's own prefix from block 0 (the index's chunked walk, one pass for every replica) gives the
    # run after the GPU match whenever it reaches that far: the offloading connector stores what the engine
    # computes, so a host tier usually holds at least what the GPU does. A tier that lost an early block
    # while the GPU kept it is walked from the GPU match on its own.
    from_start = cpu_index.match(request_hashes, 0.0, engine_only=True)
    get, run = from_start.get, cpu_index.run_held_by
    runs = []
    for rid, g in zip(ids, gpu_blocks):
        c = get(rid, 0)
        runs.append(c - g if c >= g else run(rid, request_hashes, g))
    return runs


def replication_credit(group: BlockHash, request_hashes: Sequence[BlockHash], ids: Sequence[str],
                       best_blocks: int, demand: PrefixDemand, snapshots: Sequence[ReplicaSnapshot],
                       tunables: RoutingConfig) -> tuple[frozenset[str], int, int]:
    """(the hot group's replica set, the blocks credited on it, k), or nobody/0/1 if the group is not hot.

    demand(g) = share(g) × Σ known(r);  k = ceil(demand / (replication_fill × limit')), 1 ≤ k ≤ max, N
    (known: each replica's load without pick-only guesses; limit': the guard's request limit of them).
    """
    share = demand.share(group)
    if share == 0.0:
        return NOT_HOT
    # Demand and capacity from the requests known to be in flight (no pick-only guesses).
    total_load = sum(s.num_confirmed_requests for s in snapshots)
    limit = tunables.load_guard_factor * (total_load / len(snapshots)) + tunables.load_guard_slack
    k = replica_count(share * total_load, tunables.replication_fill * limit, tunables.replication_max_replicas,
                      len(ids))
    if k < 2:
        return NOT_HOT
    # Credit the group's shared prefix only, and no more than some replica really holds:
    # a member is treated as a holder of what the group has in common, not of one
    # conversation's history, nor of blocks nobody has computed yet.
    shared = common_prefix_blocks(demand.shared_prefix(group), request_hashes)
    return replica_set(group, ids, k), min(shared, best_blocks), k


def credited(gpu_blocks: list[int], ids: Sequence[str], members: frozenset[str], credit: int) -> list[int]:
    """Per candidate, the blocks counted as on GPU: its match, or the hot group's credit on a member."""
    if not credit:
        return gpu_blocks
    return [credit if blocks < credit and rid in members else blocks for blocks, rid in zip(gpu_blocks, ids)]


def prefix_cost(num_blocks: int, cached: Sequence[int], gpu_blocks: Sequence[int], cpu_blocks: Sequence[int] | None,
                snapshots: Sequence[ReplicaSnapshot], block_size: int, tunables: RoutingConfig) -> list[float]:
    """Per candidate, the tokens the request must prefill (× uncached_weight) or load there (module docstring)."""
    new_prefill = tunables.uncached_weight * block_size
    if cpu_blocks is None:
        return [(num_blocks - c) * new_prefill for c in cached]
    # CPU-tier blocks past what counts as on GPU (the credit may cover some of them)
    loaded = [g + extra - c if g + extra > c else 0 for c, g, extra in zip(cached, gpu_blocks, cpu_blocks)]
    return [(num_blocks - c - n) * new_prefill + n * block_size * snap.cpu_block_weight
            for c, n, snap in zip(cached, loaded, snapshots)]


def queue_cost(loads: Sequence[int], pendings: Sequence[int], tunables: RoutingConfig) -> list[float]:
    """Per candidate, the work ahead of the request: prefill tokens pending + tokens_per_queued_request × queued."""
    per_request = tunables.tokens_per_queued_request
    return [pending + per_request * load for load, pending in zip(loads, pendings)]


def session_replica(sessions: SessionTable | None, session_key: str | None, now_s: float) -> str | None:
    """The replica of the session's last turn while it sticks (session_ttl_s), else None."""
    if sessions is None or session_key is None:
        return None
    return sessions.last_replica(session_key, now_s)
