"""A stored response's id names the engine replica that made it (routing/response_pins.py says why).

With `serving.responses_store` the replica's vLLM layer is wrapped: a `POST /v1/responses` body
that names no `request_id` (vLLM's response id) gets one naming this replica.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from starlette._utils import get_route_path

from kvtide.deployments.tenancy import tag_of_scope
from kvtide.deployments.routing.response_pins import RESPONSES_PATH, tagged_response_id


def with_response_id(body: bytes, replica_id: str, tenant_tag: str | None = None) -> bytes:
    """A `POST /v1/responses` body with a `request_id` (vLLM's response id) naming this replica (and ending in
    the tenant's tag, tenancy.py), unless the client named one; a body that is not a JSON object is
    vLLM's to refuse, unchanged."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or "request_id" in data:
        return body
    data["request_id"] = tagged_response_id(replica_id, tenant_tag)
    return json.dumps(data).encode()


def tagging_app(app: Callable[..., Any], replica_id: str) -> Callable[..., Any]:
    """vLLM's ASGI app with each new response's id naming `replica_id`.

    Both hand-overs deliver the whole body in the first message (vllm_layer.VllmLayerResponse,
    EngineReplica.vllm_openai), so that message is read first and replayed rewritten.
    """
    async def tagged(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or get_route_path(scope) != RESPONSES_PATH:
            await app(scope, receive, send)
            return
        first = await receive()
        if first.get("type") == "http.request" and not first.get("more_body"):
            body = with_response_id(first.get("body", b""), replica_id, tag_of_scope(scope["headers"]))
            first = {**first, "body": body}
            scope = {**scope, "headers": [*((k, v) for k, v in scope["headers"] if k.lower() != b"content-length"),
                                          (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await app(scope, replay, send)

    return tagged
