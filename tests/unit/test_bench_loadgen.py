"""Load generator pure parts: Poisson arrivals, the loopback guard, SSE parsing of one request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvtide.benchmarks.loadgen import arrival_times_s, check_loopback, send_one
from kvtide.benchmarks.workloads import BenchRequest

REQ = BenchRequest(({"role": "user", "content": "hi"},), 3, "g")


def test_arrivals_are_seeded_bounded_and_poisson():
    """Arrivals repeat per seed, stay below the duration and the count, and average the rate."""
    a = arrival_times_s(10_000, rate=50.0, duration_s=20.0, seed=1)
    assert a == arrival_times_s(10_000, rate=50.0, duration_s=20.0, seed=1)
    assert a == sorted(a) and a[-1] < 20.0
    assert 900 < len(a) < 1100
    assert len(arrival_times_s(5, rate=50.0, duration_s=20.0, seed=1)) == 5


@pytest.mark.parametrize("url, ok", [
    ("http://127.0.0.1:8000", True), ("http://localhost:8000/", True), ("http://[::1]:8000", True),
    ("http://10.0.0.5:8000", False), ("https://api.example.com", False), ("ftp://127.0.0.1", False),
])
def test_only_loopback_targets(url, ok):
    """The load generator refuses any non-loopback URL."""
    if ok:
        check_loopback(url)
    else:
        with pytest.raises(ValueError):
            check_loopback(url)


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _send(handler) -> object:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_one(client, "http://127.0.0.1/v1/chat/completions", REQ, "m", "chat", t0=0.0)
    return asyncio.run(go())


def test_stream_with_usage_is_timed_and_counted():
    """Text chunks give TTFT and ITL gaps; the usage chunk sets the output token count; the role chunk is not a token."""
    body = _sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
                {"choices": [{"delta": {"content": "c"}}]}, {"choices": [], "usage": {"completion_tokens": 3}},
                "[DONE]")
    r = _send(lambda request: httpx.Response(200, content=body))
    assert r.ok and r.num_output_tokens == 3 and len(r.itl_s) == 2 and r.ttft_s is not None


def test_textless_tokens_are_timed_by_their_token_ids():
    """A chunk whose token decoded to no text still counts as a token when it carries token_ids (return_token_ids)."""
    body = _sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"delta": {}, "token_ids": [7]}]}, {"choices": [{"delta": {}, "token_ids": [8]}]},
                {"choices": [{"delta": {"content": "x"}, "token_ids": [9]}]},
                {"choices": [], "usage": {"completion_tokens": 3}}, "[DONE]")
    r = _send(lambda request: httpx.Response(200, content=body))
    assert r.ok and r.ttft_s is not None and len(r.itl_s) == 2 and r.num_output_tokens == 3


def test_http_error_is_a_failed_result():
    """A 4xx/5xx becomes a failed result carrying the status, never an exception."""
    r = _send(lambda request: httpx.Response(503, json={"error": {"message": "busy"}}))
    assert not r.ok and r.error.startswith("HTTP 503")


def test_stream_error_event_is_a_failed_result():
    """An error object inside the stream fails the request."""
    r = _send(lambda request: httpx.Response(200, content=_sse({"error": {"message": "engine died"}})))
    assert not r.ok and "engine died" in r.error


def test_request_body_is_openai_chat_with_max_tokens():
    """The body is an OpenAI streaming chat request with the workload's max_tokens, asking for token ids (to time tokens, not text)."""
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=_sse("[DONE]"))

    _send(handler)
    assert seen["model"] == "m" and seen["max_tokens"] == 3 and seen["stream"] is True
    assert seen["messages"] == [{"role": "user", "content": "hi"}]
    assert seen["return_token_ids"] is True and seen["ignore_eos"] is True


def test_requests_in_flight_at_the_drain_bound_are_cut_as_errors():
    """_cut cancels what is still running and records each as a failed result of its group, never hangs."""
    from kvtide.benchmarks.loadgen import DRAIN_CUT_ERROR, _cut

    async def go():
        never = asyncio.Event()
        tasks = {asyncio.create_task(never.wait()): (REQ, 0.0) for _ in range(3)}
        results = await _cut(set(tasks), tasks, t0=0.0)
        return results, [t.cancelled() for t in tasks]

    results, cancelled = asyncio.run(go())
    assert len(results) == 3 and all(cancelled)
    assert all(not r.ok and r.error == DRAIN_CUT_ERROR and r.group == "g" and r.ttft_s is None for r in results)
