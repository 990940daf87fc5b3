"""The Python fallback balancer (rr_proxy), in process: round robin, pass-through of body and status, 502s."""

from __future__ import annotations

import asyncio

import httpx

from kvtide.benchmarks.rr_proxy import RoundRobinProxy

SSE = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n'


async def _chunks(*parts: bytes):
    """A streamed upstream body (a network response is not read ahead, unlike httpx.Response(content=...))."""
    for part in parts:
        yield part


def _through_proxy(handler, requests: list[tuple[str, str, bytes]], upstreams=("127.0.0.1:9001", "127.0.0.1:9002")):
    """Send (method, path, body) requests through the proxy app, whose upstream client is `handler`."""
    async def go():
        upstream = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        proxy = RoundRobinProxy(list(upstreams), client=upstream)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as client:
            return [await client.request(method, path, content=body) for method, path, body in requests]
    return asyncio.run(go())


def test_requests_go_round_robin_with_path_and_body():
    """Each request goes to the next upstream in turn, with its method, path, query and body unchanged."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.port, request.method, request.url.raw_path, request.content))
        return httpx.Response(200, content=_chunks(SSE[:20], SSE[20:]), headers={"content-type": "text/event-stream"})

    body = b'{"model":"m","stream":true}'
    responses = _through_proxy(handler, [("POST", "/v1/chat/completions", body)] * 3 + [("GET", "/v1/models?x=1", b"")])
    assert [(host, port) for host, port, *_ in seen] == [("127.0.0.1", 9001), ("127.0.0.1", 9002),
                                                         ("127.0.0.1", 9001), ("127.0.0.1", 9002)]
    assert seen[0][2:] == ("POST", b"/v1/chat/completions", body)
    assert seen[3][2:4] == ("GET", b"/v1/models?x=1")
    assert all(r.status_code == 200 and r.content == SSE for r in responses)
    assert responses[0].headers["content-type"] == "text/event-stream"


def test_upstream_status_passes_through():
    """An upstream error status (e.g. vLLM's 400) reaches the client unchanged, it is not the proxy's to judge."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, content=_chunks(b'{"error": "bad"}'), headers={"content-type": "application/json"})

    (response,) = _through_proxy(handler, [("POST", "/x", b"{}")])
    assert response.status_code == 400 and response.json() == {"error": "bad"}


def test_unreachable_upstream_is_a_502():
    """A connection failure to the chosen upstream answers 502 with an OpenAI-style error naming it."""
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    (response,) = _through_proxy(handler, [("POST", "/v1/completions", b"{}")])
    assert response.status_code == 502 and "127.0.0.1:9001" in response.json()["error"]["message"]
