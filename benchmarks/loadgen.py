"""Asyncio load generator for any OpenAI-compatible server (kvtide, bare vLLM, Ray Serve LLM).

Two arrival modes, both bounded by a duration and by the workload's request count:

    open loop    --rate R         Poisson arrivals (seeded exponential gaps); a request is
                                  sent at its time whether or not earlier ones finished
    closed loop  --concurrency C  C workers, each sends its next request when the last ends

Every request streams (SSE over httpx, no SDK: per-chunk JSON parsing stays cheap on a
2-core machine that also runs the server). Measured per request, from just before the
POST: TTFT (first chunk carrying text), ITL (gaps between text chunks), e2e, output
tokens (the final usage chunk when the server sends one, else the text-chunk count).

`drain_timeout_s` bounds how long requests still in flight after the last send are awaited;
those cut off are errors ("cut at the drain bound"). Past saturation a queue of minutes would
otherwise be drained at full cost, e.g. of a GPU's time, to learn only that it missed the SLO.

Only loopback targets are accepted: this tool generates load, and pointing it at
someone else's endpoint by a typo must not be possible.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import time
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlparse

import httpx

from kvtide.benchmarks.report import RequestResult
from kvtide.benchmarks.workloads import BenchRequest

DEFAULT_REQUEST_TIMEOUT_S = 300.0
DRAIN_CUT_ERROR = "cut at the drain bound: still running drain_timeout_s after the last send"
_LOOPBACK_NAMES = {"localhost"}


@dataclass(frozen=True)
class LoadResult:
    """What one load run produced: per-request results and its wall-clock span."""

    results: list[RequestResult]
    duration_s: float



def client_limits(max_in_flight: int | None) -> httpx.Limits:
    """Connection limits for a load generator's client: room for every request in flight (an
    open-loop load, None, must not queue in the client: that would be latency the server did not
    cause) and every connection kept alive for good, so httpcore's pool never closes a connection
    it has just handed to a waiting request (encode/httpcore#1110: that request hangs to its
    timeout or fails)."""
    return httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight,
                        keepalive_expiry=None)


def check_loopback(url: str) -> None:
    """Raise ValueError unless `url` is http(s) on a loopback address."""
    parsed = urlparse(url)
    host = parsed.hostname or ""
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"url {url!r}: only http(s) URLs are supported")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in _LOOPBACK_NAMES
    if not loopback:
        raise ValueError(f"url {url!r}: the load generator only targets loopback (127.0.0.1, ::1, localhost)")


def arrival_times_s(num_requests: int, rate: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrival offsets (seconds from start) below `duration_s`, at most `num_requests`."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    while len(times) < num_requests:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        times.append(t)
    return times


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of GET /v1/models."""
    resp = await client.get(f"{base_url.rstrip('/')}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def _body(request: BenchRequest, model: str, endpoint: str) -> dict:
    # ignore_eos and return_token_ids are vLLM extensions (kvtide, bare vLLM and Ray Serve LLM
    # honor them; servers that do not know them ignore them). ignore_eos: every request costs
    # max_tokens. return_token_ids: a chunk for every token, text or not, so TTFT and ITL time
    # tokens; a random-weight model's tokens mostly decode to no text (partial UTF-8), and timed
    # by text its first "token" came a random number of tokens late (~4 text chunks per 64 tokens).
    common = {"model": model, "max_tokens": request.max_tokens, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
    if endpoint == "chat":
        return {**common, "messages": list(request.messages)}
    return {**common, "prompt": request.as_prompt()}


def chunk_has_tokens(chunk: dict) -> bool:
    """Whether a stream chunk delivers output tokens: token ids (return_token_ids) or text."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if choice.get("token_ids"):
        return True
    if "delta" in choice:
        return bool((choice["delta"] or {}).get("content"))
    return bool(choice.get("text"))


async def send_one(client: httpx.AsyncClient, url: str, request: BenchRequest, model: str, endpoint: str,
                   t0: float) -> RequestResult:
    """POST one streaming request and time it; never raises for server or network errors."""
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    num_text_chunks = 0
    usage_tokens = None
    error = None
    try:
        async with client.stream("POST", url, json=_body(request, model, endpoint)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread())[:200].decode(errors="replace")
                error = f"HTTP {resp.status_code}: {body}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = f"stream error: {str(chunk['error'])[:200]}"
                        break
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    if chunk_has_tokens(chunk):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                        num_text_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    end = time.perf_counter()
    return RequestResult(
        ok=error is None, start_s=start - t0, e2e_s=end - start,
        ttft_s=None if first is None else first - start, itl_s=tuple(gaps),
        num_output_tokens=usage_tokens if usage_tokens is not None else num_text_chunks,
        error=error, group=request.group,
    )


async def run_load(base_url: str, requests: Sequence[BenchRequest], *, duration_s: float,
                   rate: float | None = None, concurrency: int | None = None, model: str | None = None,
                   endpoint: str = "chat", seed: int = 0, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                   progress: bool = True, drain_timeout_s: float | None = None) -> LoadResult:
    """Send `requests` in order, open loop (`rate`) or closed loop (`concurrency`), for at most `duration_s`.

    Requests still in flight at the deadline are awaited (each bounded by `request_timeout_s`),
    so every sent request has a result; nothing new is sent after the deadline.
    """
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate (open loop) or concurrency (closed loop)")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be 'chat' or 'completions', got {endpoint!r}")
    check_loopback(base_url)
    from tqdm import tqdm

    base = base_url.rstrip("/")
    url = f"{base}/v1/chat/completions" if endpoint == "chat" else f"{base}/v1/completions"
    limits = client_limits(concurrency or None)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = model or await discover_model(client, base)
        if rate is not None:
            planned = len(arrival_times_s(len(requests), rate, duration_s, seed))
        else:
            planned = len(requests)
        bar = tqdm(total=planned, unit="req", disable=not progress, dynamic_ncols=True)
        t0 = time.perf_counter()
        results: list[RequestResult] = []

        async def timed(request: BenchRequest) -> None:
            result = await send_one(client, url, request, model, endpoint, t0)
            results.append(result)
            bar.update(1)
            if not result.ok:
                bar.set_postfix(errors=sum(not r.ok for r in results))

        if rate is not None:
            tasks: dict[asyncio.Task, tuple[BenchRequest, float]] = {}
            for request, at_s in zip(requests, arrival_times_s(len(requests), rate, duration_s, seed)):
                delay = at_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks[asyncio.create_task(timed(request))] = (request, time.perf_counter())
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
                results.extend(await _cut(pending, tasks, t0))
        else:
            pending = iter(requests)

            async def worker() -> None:
                for request in pending:  # one shared iterator: each request is sent once
                    if time.perf_counter() - t0 >= duration_s:
                        return
                    await timed(request)

            await asyncio.gather(*(worker() for _ in range(concurrency)))  # type: ignore[arg-type]
        duration = time.perf_counter() - t0
        bar.close()
    results.sort(key=lambda r: r.start_s)
    return LoadResult(results, duration)


async def _cut(pending: set[asyncio.Task], sent: dict[asyncio.Task, tuple[BenchRequest, float]],
               t0: float) -> list[RequestResult]:
    """Cancel the requests still in flight at the drain bound; one error result each."""
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    now = time.perf_counter()
    return [RequestResult(ok=False, start_s=sent[t][1] - t0, e2e_s=now - sent[t][1], error=DRAIN_CUT_ERROR,
                          group=sent[t][0].group) for t in pending]
