"""Stored responses (`serving.responses_store`): each lives in the engine replica that made it.

vLLM's Responses store (VLLM_ENABLE_RESPONSES_API_STORE) is in the memory of one vLLM server:
`previous_response_id`, `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` find a
response only on the server that made it. Behind kvtide every engine replica runs its own
vLLM layer, so a follow-up must reach the replica holding the response, or it is a 404.

Stateless, so every routing peer and ingress agrees without sharing a table: the replica
gives each response it stores an id that names the replica,

    resp_<replica>-<32 hex>[.<tenant tag>]     (vLLM's own ids are resp_<16 hex>)

(engine/response_ids.py), and whoever routes a request that names a response reads the replica
off the id and pins the request to it (`pinned_replica` on RoutingKey / VllmLayerCall;
routing.ray_router.pinned_rank). Where the replica is gone its store went with it, as when a
vLLM server restarts: the request is routed as any other and vLLM answers its 404. A `request_id`
the client names is kept as vLLM keeps it; such a response is found again only where routing
happens to send the follow-up (one replica: always; docs/architecture.md, decision 19).

As a bonus the pin keeps a conversation's turns on the replica whose KV cache holds its history.

With API keys, the id ends in its tenant's tag (tenancy.py) and a router pins a request
to the replica an id names only when the tag is the requester's: another tenant's id (which
names nothing for it) cannot steer its requests onto a replica regardless of load.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

RESPONSES_PATH = "/v1/responses"
# vLLM's switch for its in-memory Responses store (vllm.envs), set in each engine replica.
STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
# A Serve replica's unique id: lowercase letters and digits (ray.serve._private.common.ReplicaID).
# group 1: the replica; group 2: the tenant's tag (tenancy.py), absent while keys are off.
_TAGGED = r"resp_([a-z0-9]{1,32})-[0-9a-f]{32}(?:\.([0-9a-f]{12}))?"
_TAGGED_ID = re.compile(_TAGGED)
_PREVIOUS_ID = re.compile(rb'"previous_response_id"\s*:\s*"' + _TAGGED.encode() + rb'"')
_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(?:/cancel)?")


def tagged_response_id(replica_id: str, tenant_tag: str | None = None) -> str:
    """A new response id naming `replica_id` (the Serve replica's unique id), ending in the tenant's tag if any."""
    return f"resp_{replica_id}-{uuid.uuid4().hex}" + (f".{tenant_tag}" if tenant_tag else "")


def owner_of(response_id: Any) -> str | None:
    """The replica a response id names; None for an id kvtide did not make (vLLM's, a client's, junk)."""
    if not isinstance(response_id, str):
        return None
    match = _TAGGED_ID.fullmatch(response_id)
    return match.group(1) if match else None


def previous_response_owner(body: bytes, tenant_tag: str | None = None) -> str | None:
    """The replica holding the response a `POST /v1/responses` body continues (`previous_response_id`).

    Read off the bytes, not parsed: the routing peer may get the body cut at HAProxy's buffer, and
    the common body (no such field) costs one scan. A key inside a JSON string has its quotes
    escaped, so it never matches; the replica that gets the request reads the parsed body again.
    `tenant_tag`: the requester's; an id of another tenant's (or, with tenants, of none) pins nothing.
    """
    match = _PREVIOUS_ID.search(body)
    if match is None:
        return None
    id_tag = match.group(2).decode() if match.group(2) else None
    return match.group(1).decode() if id_tag == tenant_tag else None


def response_owner(path: str, body: bytes) -> str | None:
    """The replica a request for vLLM's layer must reach: a stored response's (by the path's id or the
    body's `previous_response_id`); None: any replica."""
    if path == RESPONSES_PATH:
        return previous_response_owner(body)
    match = _RESPONSE_PATH.fullmatch(path)
    return owner_of(match.group(1)) if match else None
