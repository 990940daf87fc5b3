"""A tiny round-robin HTTP reverse proxy: the `bare` baseline's balancer when no HAProxy binary is found.

    python -m kvtide.benchmarks.rr_proxy --port 8000 --upstream 127.0.0.1:8301 --upstream 127.0.0.1:8302

Each request goes to the next upstream in turn (no health checks, no retries: the
fleet's servers are all up before it starts); the response streams back chunk by chunk
as the upstream sends it, so SSE token streams keep their timing. A raw ASGI app on
uvicorn, forwarding with one pooled httpx client. Loopback only.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any, Awaitable, Callable, Sequence

import httpx

# Per-connection headers (RFC 9110 §7.6.1) and the ones the forwarding layer rewrites.
_DROPPED_REQUEST_HEADERS = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                            b"transfer-encoding", b"upgrade", b"host", b"content-length"}
_DROPPED_RESPONSE_HEADERS = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                             b"transfer-encoding", b"upgrade"}

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class RoundRobinProxy:
    """ASGI app: forward each HTTP request to the next of `upstreams` ("host:port"), streaming the response."""

    def __init__(self, upstreams: Sequence[str], client: httpx.AsyncClient | None = None):
        if not upstreams:
            raise ValueError("the proxy needs at least one upstream")
        self._upstreams = itertools.cycle(upstreams)
        # No read timeout: a queued request may wait long for its first token; the load
        # generator bounds each request itself. No pool cap: concurrency is the load's.
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                                   limits=httpx.Limits(max_connections=None,
                                                                       max_keepalive_connections=None))

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        upstream = next(self._upstreams)
        query = scope.get("query_string") or b""
        url = f"http://{upstream}{scope['path']}" + (f"?{query.decode('latin-1')}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROPPED_REQUEST_HEADERS]
        request = self._client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await _send_error(send, 502, f"upstream {upstream}: {type(exc).__name__}: {exc}")
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw
                                    if k.lower() not in _DROPPED_RESPONSE_HEADERS]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Also on a client disconnect: closing the upstream stream makes vLLM abort the request.
            await response.aclose()


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_error(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "bad_gateway"}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="listen on 127.0.0.1:PORT")
    parser.add_argument("--upstream", action="append", required=True, help="host:port (repeatable, in order)")
    args = parser.parse_args(argv)
    uvicorn.run(RoundRobinProxy(args.upstream), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
