"""Post-response hooks: what a decision leaves behind once its request is sent, and what is checked once served.

    book_routed        the request was sent to a replica (Ray's on_request_routed, or a pick-only
                       choice): its blocks count as cached there until a digest confirms or the
                       routing history expires them (PrefixIndex.on_routed), its prefix group's demand
                       grows (replication), and its session remembers the replica (sessions)
    record_prediction  the replica ranked first and the tokens the router counted as cached there go
                       into the request's decision slot; the frontend compares them with the engine's
                       own cached count once the response starts (deployments.routing.trust.compare:
                       the index's trust metric, and the exclusive hits a cache-aware scale-down weighs)
"""

from __future__ import annotations

from typing import Any, MutableMapping, Sequence

from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.replication import PrefixDemand, group_key
from kvtide.deployments.routing.sessions import SessionTable
from kvtide.deployments.routing.trust import write_prediction


def book_routed(index: PrefixIndex, demand: PrefixDemand, sessions: SessionTable, key_blocks: int,
                replica_id: str, request_hashes: Sequence[BlockHash], now_s: float,
                session_key: str | None = None) -> None:
    """Book a request sent to `replica_id`: routing history, its group's demand, its session."""
    index.on_routed(replica_id, request_hashes, now_s)
    demand.observe(group_key(request_hashes, key_blocks), request_hashes, now_s)
    if session_key is not None:
        sessions.remember(session_key, replica_id, now_s)


def record_prediction(slot: MutableMapping[str, Any] | None, ranked: Sequence[str], matched_tokens: int,
                      exclusive_tokens: int) -> None:
    """Write the prediction for the replica tried first into the request's decision slot (none: no slot or no
    replica); the frontend drops it if another replica served."""
    if slot is not None and ranked:
        write_prediction(slot, ranked[0], matched_tokens, exclusive_tokens)
