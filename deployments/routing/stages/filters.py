"""Filters: which replicas may take a request, and which side of the load guard each is on.

Two filters remove candidates before any scoring: a standby takes no requests (`serving`),
and a request pinned to the replica holding the stored response it names goes there alone
(`pinned`). The load guard does not remove: it splits the candidates into those under it
and those over it, and the picker ranks every replica under the guard before every replica
over it (bounded-load hashing: affinity never overrides the guard).

    work(r)  = pend(r) + tokens_per_queued_request × load(r)                       (tokens)
    limit    = load_guard_factor × mean(work) + load_guard_slack × tokens_per_queued_request
               + the prompt's tokens
    over(r)  = work(r) > limit
               or (r.kv_usage_perc >= kv_usage_guard_perc and r holds < half the prompt on GPU)

Invariant: `limit >= mean(work) >= min(work)` when factor >= 1 and slack >= 0 (RoutingConfig's
bounds), so the work guard leaves at least one replica under it. The KV guard can mark every
replica; then all rank by cost alone.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.snapshot import ReplicaSnapshot

T = TypeVar("T")


def serving(candidates: Sequence[T], is_standby: Callable[[T], bool]) -> list[T]:
    """The candidates that take requests: standbys left out, unless every candidate is one.

    All standby (a moment in a fleet's life, e.g. the last active replica just died): all stay,
    and a sleeping one answers with a retryable error rather than the request having nowhere to go.
    """
    taking = [c for c in candidates if not is_standby(c)]
    return taking or list(candidates)


def pinned(candidates: Sequence[T], pinned_id: str | None, id_of: Callable[[T], str],
           is_standby: Callable[[T], bool]) -> T | None:
    """The candidate a pinned request must go to, whatever the policy and its load; None when the policy
    routes it (no pin, or the pinned replica is gone or set aside as a standby, its store with it)."""
    if pinned_id is None:
        return None
    for candidate in candidates:
        if id_of(candidate) == pinned_id and not is_standby(candidate):
            return candidate
    return None


def load_guard(snapshots: Sequence[ReplicaSnapshot], work_tokens: Sequence[float], gpu_blocks_of: Sequence[int],
               num_blocks: int, block_size: int, tunables: RoutingConfig) -> list[bool]:
    """Per replica, whether it is over the load guard (module docstring). `work_tokens`: the queue cost scorer's
    work ahead of the request on each replica; `gpu_blocks_of`: the request's blocks each holds on GPU (a
    CPU-tier hit still needs GPU blocks to load into, so the KV guard counts GPU only)."""
    # The guard weighs work in tokens: a replica with many cached (cheap) requests queued
    # is less loaded than one with a few cold prefills. Work moves in steps of a prompt, so
    # one prompt like this one is slack too: neither a report caught mid-prefill nor the
    # picks a pick-only router still counts (finished or not) may cost a replica its
    # affinity at low load.
    work_limit = (tunables.load_guard_factor * (sum(work_tokens) / len(work_tokens))
                  + tunables.load_guard_slack * tunables.tokens_per_queued_request + num_blocks * block_size)
    kv_guard = tunables.kv_usage_guard_perc
    # A full KV cache bars new prefills, not hits: a replica holding at least half the
    # prompt needs few new blocks for it, and sending it elsewhere means a cold prefill
    # that evicts another prefix there.
    return [w > work_limit or (snap.kv_usage_perc >= kv_guard and 2 * held < num_blocks)
            for snap, w, held in zip(snapshots, work_tokens, gpu_blocks_of)]
