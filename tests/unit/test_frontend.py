"""The OpenAI app and request pipeline with fake engines: auth on every /v1 route, retries, SSE shape."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from fakes import FakeTokenizer

from kvtide.config import parse_config
from kvtide.deployments.frontend.admission import Deadline, admission_limits
from kvtide.deployments.frontend.auth import ApiKeys
from kvtide.deployments.internal_auth import sign_route
from kvtide.deployments.frontend.engine_client import HandleEngineClient, LocalEngineClient
from kvtide.deployments.frontend.pipeline import OpenAIFrontend
from kvtide.deployments.messages import GenerateDelta, GenerateRequest, SamplingSpec
from kvtide.deployments.frontend.app import build_openai_app
from kvtide.deployments.frontend.prompts import ROUTED_TOKENS_HEADER, PromptBuilder, encode_token_ids
from kvtide.deployments.frontend.protocol import ApiError
from kvtide.deployments.routing.trust import PREDICTED_CACHED_TOKENS_HEADER, Comparison, write_prediction

CONFIG = parse_config({"model": "/m", "served_model_name": "m", "engine": {"max_model_len": 64}})




class FakeMetrics:
    """Counts what the frontend reports, in place of Ray metrics."""

    def __init__(self) -> None:
        self.done: list[int] = []
        self.endpoints: list[tuple[str, int]] = []
        self.rejected: list[str] = []
        self.phases: list[tuple[float, float, float]] = []
        self.predictions: list[tuple[str, Comparison]] = []
        self.tenants: list[tuple[str, int]] = []
        self.ttft_s = self.itl_s = self.e2e_s = self.prompt_tokens = self.output_tokens = self

    def observe(self, *_: Any) -> None:
        pass

    def inc(self, *_: Any) -> None:
        pass

    def on_request_done(self, model: str, endpoint: str, status: int) -> None:
        self.done.append(status)
        self.endpoints.append((endpoint, status))

    def on_rejected(self, model: str, reason: str) -> None:
        self.rejected.append(reason)

    def on_ttft_phases(self, model: str, frontend_s: float, transport_s: float, engine_s: float) -> None:
        self.phases.append((frontend_s, transport_s, engine_s))

    def on_inter_token_latency(self, now_s: float, per_token_s: float, tags: dict[str, str]) -> None:
        pass

    def on_prediction(self, model: str, comparison: Comparison) -> None:
        self.predictions.append((model, comparison))

    def on_tenant_request(self, model: str, tenant: str, status: int) -> None:
        self.tenants.append((tenant, status))


def _deltas(n: int) -> list[GenerateDelta]:
    return [GenerateDelta(text=f"t{i}", num_output_tokens=i + 1, num_prompt_tokens=3,
                          finish_reason="length" if i == n - 1 else None,
                          engine_ttft_s=0.001 if i == 0 else None, replica_id="r1") for i in range(n)]


def _local_engine(n: int = 3) -> LocalEngineClient:
    async def generate(request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        for delta in _deltas(min(n, request.sampling.max_tokens)):
            yield delta

    return LocalEngineClient(generate, admission_limits(CONFIG))


async def _stand_in_vllm_layer(scope, receive, send) -> None:
    """vLLM's OpenAI app in place: 200 with the method, path and JSON body it was handed."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    payload = json.dumps({"method": scope["method"], "path": scope["path"],
                          "body": json.loads(body) if body else None}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload})


def _app(keys: list[str] | None = None, engine=None, metrics: FakeMetrics | None = None, vllm_app=None,
         fleet=None):
    metrics = metrics or FakeMetrics()
    frontend = OpenAIFrontend(CONFIG, PromptBuilder(CONFIG, FakeTokenizer()), engine or _local_engine(),
                              metrics, None)
    frontend.vllm_app = vllm_app
    frontend.fleet_vllm = fleet

    async def ready() -> bool:
        return True

    return TestClient(build_openai_app(frontend, ApiKeys(keys or []), ready)), metrics


def _recording_client(router_secret: bytes | None = None) -> tuple[TestClient, list[GenerateRequest]]:
    """An app over a one-token local engine that records every GenerateRequest it is sent."""
    seen: list[GenerateRequest] = []

    async def generate(request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        seen.append(request)
        for delta in _deltas(1):
            yield delta

    frontend = OpenAIFrontend(CONFIG, PromptBuilder(CONFIG, FakeTokenizer()),
                              LocalEngineClient(generate, admission_limits(CONFIG)), FakeMetrics(), None)
    frontend.router_secret = router_secret

    async def ready() -> bool:
        return True

    return TestClient(build_openai_app(frontend, ApiKeys([]), ready)), seen


def test_every_v1_route_needs_the_api_key():
    """Each /v1 route of the app and the tokenizer endpoints (enumerated, not listed by hand) answer 401 without
    a key, and the set is pinned; /version, /health and /ready stay open."""
    async def fleet(call):
        return [(200, b"")]

    client, _ = _app(keys=["sk-1"], vllm_app=_stand_in_vllm_layer, fleet=fleet)
    open_paths = ("/version", "/health", "/ready")
    routes = [(r.path.replace("{model_id:path}", "m").replace("{response_id}", "r"), m) for r in client.app.routes
              if hasattr(r, "endpoint") and r.path not in open_paths and not r.path.startswith(("/docs", "/openapi",
                                                                                                   "/redoc"))
              for m in getattr(r, "methods", ())]
    renders = [(f"/v1/{api}/render", "POST") for api in ("chat/completions", "completions", "messages", "responses")]
    derenders = [(f"/v1/{api}/derender", "POST") for api in ("chat/completions", "completions")]
    assert sorted(routes) == sorted([
        ("/detokenize", "POST"), ("/tokenize", "POST"), ("/v1/chat/completions", "POST"),
        ("/v1/completions", "POST"), ("/v1/messages", "POST"), ("/v1/messages/count_tokens", "POST"),
        ("/v1/models", "GET"), ("/v1/models/m", "GET"), ("/v1/responses", "POST"), ("/v1/responses/r", "GET"),
        ("/v1/responses/r/cancel", "POST"), ("/v1/chat/completions/batch", "POST"), ("/inference/v1/generate", "POST"),
        ("/generative_scoring", "POST"), ("/v1/systemone", "POST"), ("/inference/v1/abort_requests", "POST"),
        *renders, *derenders])
    assert {path for path in (r.path for r in client.app.routes)} >= {"/version", "/health", "/ready"}
    assert client.get("/version").status_code == 200
    for path, method in routes:
        body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}], "tokens": [1],
                "request_ids": ["r"]}
        resp = client.request(method, path, json=body)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", (path, resp.text)
        ok = client.request(method, path, json=body, headers={"Authorization": "Bearer sk-1"})
        assert ok.status_code == 200, (path, ok.text)
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200


def test_vllms_own_apis_are_handed_whole_to_its_layer_and_counted_under_their_endpoint():
    """The generation POSTs only vLLM's layer answers (Responses, Messages, a batch of chats, tokens in, scoring,
    decisions) reach it with their path and body and are counted under their endpoint; counting tokens, a stored
    response's GET and cancel, render and derender reach it uncounted."""
    from kvtide.deployments.frontend.app import GENERATION_ROUTES, VLLM_PASSTHROUGH_ROUTES

    metrics = FakeMetrics()
    client, _ = _app(metrics=metrics, vllm_app=_stand_in_vllm_layer)
    body = {"model": "m", "input": "hi", "max_tokens": 4}
    vllm_only = {path: endpoint for path, endpoint in GENERATION_ROUTES.items()
                 if endpoint not in ("chat", "completions")}
    for path in vllm_only:
        assert client.post(path, json=body).json() == {"method": "POST", "path": path, "body": body}
    for method, path, _ in VLLM_PASSTHROUGH_ROUTES:
        path = path.replace("{response_id}", "resp_1")
        assert client.request(method, path, json=body).json()["path"] == path
    assert metrics.endpoints == [(endpoint, 200) for endpoint in vllm_only.values()]


def test_a_malformed_body_for_vllms_layer_gets_kvtides_openai_error_not_fastapis_detail():
    """Render, count_tokens and abort bodies that are not JSON are kvtide's 400 with an error object (vLLM's app
    would answer FastAPI's {"detail": ...}); an empty body (a cancel) still reaches vLLM's layer."""
    async def fleet(call):
        return [(200, b"")]

    client, _ = _app(vllm_app=_stand_in_vllm_layer, fleet=fleet)
    for path in ("/v1/chat/completions/render", "/v1/messages/count_tokens", "/inference/v1/abort_requests"):
        resp = client.post(path, content=b"\xafd\r", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json", (path, resp.text)
    assert client.post("/v1/responses/resp_1/cancel").json()["path"] == "/v1/responses/resp_1/cancel"


def test_a_body_naming_its_request_id_keeps_it_over_haproxys_x_request_id():
    """HAProxy sets x-request-id on every request, and vLLM's layer prefers that header to the body's request_id
    (the engine's id an abort names): a body with a request_id reaches vLLM's layer without the header; one
    without keeps it."""
    seen = []

    async def layer(scope, receive, send):
        seen.append(dict(scope["headers"]).get(b"x-request-id"))
        await _stand_in_vllm_layer(scope, receive, send)

    client, _ = _app(vllm_app=layer)
    body = {"model": "m", "token_ids": [1], "sampling_params": {}}
    for extra in ({"request_id": "mine"}, {}):
        assert client.post("/inference/v1/generate", json={**body, **extra},
                           headers={"x-request-id": "haproxy-uuid"}).status_code == 200
    assert seen == [None, b"haproxy-uuid"]


def test_an_abort_reaches_every_engine_replica_and_is_answered_as_vllm_answers_it():
    """POST /inference/v1/abort_requests goes to every replica's vLLM layer with its path and body: 200 when all
    acted; a replica's refusal (vLLM's 400 or 403) is the answer; 503 (retry) when no replica answered. A body
    vLLM would not act on (not an object, no request_ids, ids not strings) is kvtide's 400 naming the field."""
    calls = []

    def fleet(answers):
        async def call(request):
            calls.append(request)
            return answers
        return call

    body = {"request_ids": ["generate-tokens-r1"]}
    client, _ = _app(fleet=fleet([(200, b""), RuntimeError("replica gone")]))
    resp = client.post("/inference/v1/abort_requests", json=body)
    assert (resp.status_code, resp.content) == (200, b"")
    assert (calls[0].path, json.loads(calls[0].body), calls[0].method) == ("/inference/v1/abort_requests", body, "POST")
    refusal = b'{"error": {"message": "Scale-out endpoints are disabled", "code": 403}}'
    client, _ = _app(fleet=fleet([(200, b""), (403, refusal)]))
    resp = client.post("/inference/v1/abort_requests", json=body)
    assert (resp.status_code, resp.content, resp.headers["content-type"]) == (403, refusal, "application/json")
    for bad, param in (([1], None), ({}, "request_ids"), ({"request_ids": [1]}, "request_ids")):
        resp = client.post("/inference/v1/abort_requests", json=bad)
        assert (resp.status_code, resp.json()["error"]["param"]) == (400, param), resp.text
    for unanswered in (fleet([RuntimeError("replica gone")]), None):
        client, _ = _app(fleet=unanswered)
        resp = client.post("/inference/v1/abort_requests", json=body)
        assert resp.status_code == 503 and resp.json()["error"]["type"], resp.text


def test_every_route_of_vllms_app_is_served_or_left_out_on_purpose():
    """vLLM's own app (the installed vLLM, built as kvtide builds it for a generative model) has no route kvtide
    neither serves nor names in VLLM_ROUTES_NOT_SERVED, and that table names no route vLLM lacks."""
    from vllm.entrypoints.launchers.app import build_app

    from kvtide.deployments.engine.vllm_openai import _parsed_server_args
    from kvtide.deployments.frontend.app import VLLM_ROUTES_NOT_SERVED

    args = _parsed_server_args("/m", [])
    args.disable_fastapi_docs = True
    theirs = {(m, r.path) for r in build_app(args, supported_tasks=("generate",)).routes
              for m in (getattr(r, "methods", None) or {"GET"}) if m != "HEAD"}
    client, _ = _app(vllm_app=_stand_in_vllm_layer)
    ours = {(m, r.path) for r in client.app.routes for m in getattr(r, "methods", ())}
    assert {(m, p) for m, p in theirs - ours if p not in VLLM_ROUTES_NOT_SERVED} == set()
    assert set(VLLM_ROUTES_NOT_SERVED) <= {p for _, p in theirs}


def test_responses_and_messages_before_vllms_layer_exists_are_a_retryable_503():
    """Without vLLM's layer (no engine yet) those endpoints answer the 503 a client retries, never kvtide's path."""
    metrics = FakeMetrics()
    client, _ = _app(metrics=metrics)
    for method, path in (("POST", "/v1/responses"), ("POST", "/v1/messages"), ("GET", "/v1/responses/resp_1")):
        resp = client.request(method, path, json={"model": "m", "input": "hi"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_unavailable", path
    assert metrics.endpoints == [("responses", 503), ("messages", 503)]


def test_generation_posts_skip_fastapi_and_everything_else_reaches_it():
    """The generation POSTs are served (key check included, 401 counted) without FastAPI; GETs, a trailing
    slash and other methods on those paths go to FastAPI."""
    client, metrics = _app(keys=["sk-1"])
    app = client.app
    fastapi_seen: list[tuple[str, str]] = []
    real_fastapi = app.fastapi_app

    async def recording_fastapi(scope, receive, send):
        if scope["type"] == "http":
            fastapi_seen.append((scope["method"], scope["path"]))
        await real_fastapi(scope, receive, send)

    app.fastapi_app = recording_fastapi
    key = {"Authorization": "Bearer sk-1"}
    assert client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=key).status_code == 200
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 401
    assert fastapi_seen == [] and metrics.done == [200, 401]
    assert client.get("/v1/models", headers=key).status_code == 200
    assert client.post("/v1/completions/", json={}, headers=key, follow_redirects=False).status_code == 307
    assert client.get("/v1/completions", headers=key).status_code == 405
    assert fastapi_seen == [("GET", "/v1/models"), ("POST", "/v1/completions/"), ("GET", "/v1/completions")]


def test_completion_json_carries_usage_and_the_ttft_breakdown_is_recorded():
    """A non-streamed completion returns every delta's text, usage, the replica header and one TTFT split."""
    client, metrics = _app()
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "abc", "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["text"] == "t0t1t2" and body["choices"][0]["finish_reason"] == "length"
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (4, 3)
    assert resp.headers["x-kvtide-replica"] == "r1"
    assert metrics.done == [200] and len(metrics.phases) == 1
    # The engine's share never exceeds what it reported, nor the time the frontend waited for it.
    frontend_s, transport_s, engine_s = metrics.phases[0]
    assert min(metrics.phases[0]) >= 0 and engine_s <= 0.001


def test_chat_stream_is_role_content_finish_usage_done():
    """A streamed chat: role chunk, content chunks, the finish on the last delta, a usage chunk, then [DONE]."""
    client, _ = _app()
    resp = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    events = [line[len("data: "):] for line in resp.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["t0", "t1"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def _silent_token_engine() -> LocalEngineClient:
    """Three engine steps whose middle token decodes to no text yet (half of a multi-byte character)."""
    texts = ["a", "", "b"]

    async def generate(request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        for i, text in enumerate(texts):
            yield GenerateDelta(text=text, num_output_tokens=i + 1, num_prompt_tokens=3, token_ids=(100 + i,),
                                finish_reason="length" if i == len(texts) - 1 else None, replica_id="r1")

    return LocalEngineClient(generate, admission_limits(CONFIG))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_return_token_ids_streams_a_chunk_for_every_token_even_without_text(endpoint):
    """Every engine step is a chunk, a textless token too, as vLLM sends it; vLLM's return_token_ids adds its token
    ids to each."""
    client, _ = _app(engine=_silent_token_engine())
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if endpoint == "chat"
                  else ("/v1/completions", {"prompt": "hi"}))

    def choices(extra: dict) -> list[dict]:
        resp = client.post(path, json={"model": "m", "max_tokens": 3, "stream": True, **body, **extra})
        events = [line[len("data: "):] for line in resp.text.splitlines() if line]
        assert resp.status_code == 200 and events[-1] == "[DONE]", resp.text
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        return [c for c in chunks if c.get("delta", {}).get("role") is None]

    with_ids = choices({"return_token_ids": True})
    assert [c["token_ids"] for c in with_ids] == [[100], [101], [102]]
    assert with_ids[-1]["finish_reason"] == "length"
    plain = choices({})
    assert len(plain) == 3 and all("token_ids" not in c for c in plain)
    texts = [c["delta"].get("content") if endpoint == "chat" else c["text"] for c in plain]
    assert "" in texts and "".join(texts) == "ab"


def test_return_token_ids_in_a_non_streamed_response():
    """A non-streamed completion with return_token_ids carries every output token id on its choice; without it, none."""
    client, _ = _app(engine=_silent_token_engine())
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3, "return_token_ids": True})
    assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == [100, 101, 102]
    assert resp.json()["choices"][0]["text"] == "ab"
    plain = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 3})
    assert plain.status_code == 200 and "token_ids" not in plain.json()["choices"][0]


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"model": "other", "prompt": "x"}, 404, "model_not_found"),
    ({"model": "m", "prompt": "x" * 70}, 400, "context_length_exceeded"),
    ({"model": "m", "prompt": "x", "max_tokens": "8"}, 400, None),
    ({"model": "m", "prompt": "x", "cache_salt": ""}, 400, None),
    ({"model": "m", "prompt": "x", "cache_salt": 7}, 400, None),
])
def test_client_mistakes_are_4xx_with_openai_bodies(body, status, code):
    """Unknown model, prompt over the context and a mistyped field answer 4xx with an OpenAI error body."""
    client, metrics = _app()
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == status and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert code is None or resp.json()["error"]["code"] == code
    assert metrics.done == [status]


class FakeResponse:
    """A streaming handle response: raises `error` at the first delta, or yields `deltas`."""

    def __init__(self, deltas: list[GenerateDelta], error: BaseException | None):
        self.deltas, self.error, self.cancelled = list(deltas), error, False

    def __aiter__(self) -> "FakeResponse":
        return self

    async def __anext__(self) -> GenerateDelta:
        if self.error is not None:
            raise self.error
        if not self.deltas:
            raise StopAsyncIteration
        return self.deltas.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """A DeploymentHandle whose successive calls fail with `errors` in turn, then stream."""

    def __init__(self, errors: list[BaseException]):
        self.errors = list(errors)
        self.calls: list[str] = []
        self.responses: list[FakeResponse] = []

    def options(self, **_: Any) -> "FakeHandle":
        return self

    @property
    def generate(self) -> "FakeHandle":
        return self

    def remote(self, request: GenerateRequest) -> FakeResponse:
        self.calls.append(request.request_id)
        response = FakeResponse(_deltas(2), self.errors.pop(0) if self.errors else None)
        self.responses.append(response)
        return response


def _open(handle: FakeHandle, max_retries: int = 2):
    config = parse_config({"frontend": {"admission": {"max_retries": max_retries}}})
    client = HandleEngineClient(handle, admission_limits(config))
    request = GenerateRequest("req", [1, 2], SamplingSpec(max_tokens=2))
    rejected: list[str] = []
    return asyncio.run(client.open(request, Deadline(None, 0.0), rejected.append)), rejected


def test_handle_client_retries_a_dead_replica_before_the_first_token():
    """A replica dying before any token is retried under a new request id; the stream then starts normally."""
    handle = FakeHandle([RayActorError()])
    stream, _ = _open(handle)
    assert handle.calls == ["req", "req-1"] and stream.first.text == "t0"
    assert handle.responses[0].cancelled


def test_handle_client_gives_503_after_max_retries_and_429_on_backpressure():
    """Retries stop at max_retries (503 + Retry-After); a full handle queue is a 429, never retried."""
    with pytest.raises(ApiError) as info:
        _open(FakeHandle([RayActorError()] * 3), max_retries=1)
    assert info.value.status == 503 and "Retry-After" in info.value.headers
    handle = FakeHandle([BackPressureError(num_queued_requests=1, max_queued_requests=1)])
    with pytest.raises(ApiError) as info:
        _open(handle)
    assert info.value.status == 429 and handle.calls == ["req"]


ROUTER_SECRET = b"s" * 32
ROUTED_BODY = json.dumps({"model": "m", "prompt": "abc", "max_tokens": 1}).encode()


@pytest.mark.parametrize(("replica_secret", "signer_secret", "signed_body", "expected_prompt_tokens"), [
    (ROUTER_SECRET, ROUTER_SECRET, ROUTED_BODY, [7, 8, 9]),  # the routing peer's, signed for this body
    (ROUTER_SECRET, None, ROUTED_BODY, [1, 97, 98, 99]),  # unsigned: sent to the replica's port straight
    (ROUTER_SECRET, b"x" * 32, ROUTED_BODY, [1, 97, 98, 99]),  # signed with another secret
    (ROUTER_SECRET, ROUTER_SECRET, ROUTED_BODY.replace(b"abc", b"abd"), [1, 97, 98, 99]),  # lifted from another body
    (None, ROUTER_SECRET, ROUTED_BODY, [1, 97, 98, 99]),  # ingress mode: no router headers at all
])
def test_routed_tokens_header_is_used_only_under_the_peers_signature(replica_secret, signer_secret, signed_body,
                                                                     expected_prompt_tokens):
    """Direct mode tokenizes once (the routing peer's signed header); a forged, unsigned or replayed one is ignored."""
    client, seen = _recording_client(replica_secret)
    headers = {ROUTED_TOKENS_HEADER: encode_token_ids([7, 8, 9])}
    if signer_secret is not None:
        headers = sign_route(signer_secret, signed_body, headers)
    resp = client.post("/v1/completions", content=ROUTED_BODY, headers={**headers, "content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert [list(request.prompt_token_ids) for request in seen] == [expected_prompt_tokens]


def test_a_salted_request_carries_its_salt_and_salted_hashes_and_is_never_a_hot_prefix():
    """cache_salt reaches the engine, the routing hashes start at its root, and the hot-prefix tracker never sees it."""
    from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
    from kvtide.deployments.routing.block_hash import block_hashes, salt_root

    seen: list[GenerateRequest] = []

    async def generate(request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        seen.append(request)
        for delta in _deltas(1):
            yield delta

    class RoutingEngine(LocalEngineClient):
        routes_requests = True

    tracker = HotPrefixTracker(CONFIG.engine.block_size)
    frontend = OpenAIFrontend(CONFIG, PromptBuilder(CONFIG, FakeTokenizer()),
                              RoutingEngine(generate, admission_limits(CONFIG)), FakeMetrics(), tracker)

    async def ready() -> bool:
        return True

    client = TestClient(build_openai_app(frontend, ApiKeys([]), ready))
    prompt = "y" * 40  # 41 tokens: two full blocks of 16
    for salt in ("tenant-a", None):
        body = {"model": "m", "prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        assert client.post("/v1/completions", json=body).status_code == 200
    salted, plain = seen
    tokens = [1] + [ord("y")] * 40
    assert salted.cache_salt == "tenant-a" and plain.cache_salt is None
    assert salted.block_hashes == tuple(block_hashes(tokens, 16, parent=salt_root("tenant-a")))
    assert plain.block_hashes == tuple(block_hashes(tokens, 16))
    assert [prefix for prefix, _ in tracker.hottest(time.monotonic(), min_hits=0.0)] == [tokens[:32]]


@pytest.mark.parametrize(("headers", "user", "expected"), [
    ({"x-session-id": "conv-1"}, "alice", "conv-1"),  # the session header wins
    ({}, "alice", "alice"),                           # else the OpenAI `user` field
    ({}, None, None),                                  # else no session
])
def test_the_session_key_reaches_the_router(headers, user, expected):
    """Multi-turn affinity: the x-session-id header, else `user`, travels with the request to the router."""
    client, seen = _recording_client()
    body = {"model": "m", "prompt": "abc", "max_tokens": 1, **({"user": user} if user else {})}
    assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
    assert seen[0].session_key == expected


# 40 characters: 41 tokens with the BOS, so two full blocks of 16 are cacheable by the engine.
TRUST_BODY = {"model": "m", "prompt": "x" * 40, "max_tokens": 2}


def _cached_deltas(cached_tokens: int, replica_id: str = "r1") -> list[GenerateDelta]:
    return [GenerateDelta(text=f"t{i}", num_output_tokens=i + 1, num_prompt_tokens=41, num_cached_tokens=cached_tokens,
                          finish_reason="length" if i == 1 else None, replica_id=replica_id) for i in range(2)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("trusted", "header", "expected"), [
    (True, "32;r1", [("m", Comparison("true_hit", -16))]),
    (False, "32;r1", []),  # unsigned: a client's copy of the router's header is ignored
    (True, "32;r2", []),  # predicted for another replica (HAProxy redispatched): not compared
    (True, None, []),  # another policy, or a route without hashes: no prediction, nothing recorded
])
def test_predicted_cached_tokens_header_is_compared_only_where_trusted(stream, trusted, header, expected):
    """Direct mode: the peer's prediction is compared with the engine's cached tokens when the request ends."""
    async def generate(request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        for delta in _cached_deltas(16):
            yield delta

    metrics = FakeMetrics()
    frontend = OpenAIFrontend(CONFIG, PromptBuilder(CONFIG, FakeTokenizer()),
                              LocalEngineClient(generate, admission_limits(CONFIG)), metrics, None)
    frontend.router_secret = ROUTER_SECRET

    async def ready() -> bool:
        return True

    client = TestClient(build_openai_app(frontend, ApiKeys([]), ready))
    body = json.dumps({**TRUST_BODY, "stream": stream}).encode()
    headers = {PREDICTED_CACHED_TOKENS_HEADER: header} if header else {}
    if trusted:  # the routing peer's header, signed; else a client's copy, unsigned
        headers = sign_route(ROUTER_SECRET, body, headers)
    resp = client.post("/v1/completions", content=body, headers={**headers, "content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert metrics.done == [200] and metrics.predictions == expected


class RoutingHandle(FakeHandle):
    """A handle whose router (in this process, as in ingress mode) writes its prediction into the request."""

    def __init__(self, predicted_replica: str, cached_tokens: int):
        super().__init__([])
        self.predicted_replica, self.cached_tokens = predicted_replica, cached_tokens

    def remote(self, request: GenerateRequest) -> FakeResponse:
        write_prediction(request.decision, self.predicted_replica, 32)
        self.calls.append(request.request_id)
        return FakeResponse(_cached_deltas(self.cached_tokens), None)


@pytest.mark.parametrize(("predicted_replica", "expected"), [
    ("r1", [("m", Comparison("false_hit", -32))]),
    ("r0", []),  # Ray sent it to the next rank after the first rejected: the prediction was for r0
])
def test_ingress_mode_compares_the_slot_its_router_wrote(predicted_replica, expected):
    """Ingress mode: the request's own decision slot carries the prediction; no header is needed or trusted."""
    client, metrics = _app(engine=HandleEngineClient(RoutingHandle(predicted_replica, 0), admission_limits(CONFIG)))
    resp = client.post("/v1/completions", json=TRUST_BODY)
    assert resp.status_code == 200, resp.text
    assert metrics.predictions == expected


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"model": "m", "prompt": "x" * 70}, "prompt"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x" * 70}]}, "messages"),
])
def test_a_prompt_alone_over_the_context_names_the_field_that_holds_it(path, body, param):
    """context_length_exceeded for the prompt alone points at `prompt` on completions and `messages` on chat."""
    client, _ = _app()
    err = client.post(path, json=body).json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param


@pytest.mark.parametrize(("accepted", "with_tokens", "expect_routed"), [
    (True, True, True), (True, False, False), (False, True, False)])
def test_the_engine_gets_the_routing_peers_block_hashes_instead_of_hashing_again(accepted, with_tokens, expect_routed):
    """Direct mode: the peer's hashes (with its token ids) reach the engine as the request's block_hashes;
    without its token ids, or where router headers are not accepted, the hashes header is ignored."""
    from kvtide.deployments.frontend.routing_key import ROUTED_HASHES_HEADER, encode_block_hashes

    client, seen = _recording_client(ROUTER_SECRET if accepted else None)
    routed_ids = list(range(2, 2 + 2 * CONFIG.engine.block_size + 3))  # two full blocks
    headers = {ROUTED_HASHES_HEADER: encode_block_hashes((11, 22))}
    if with_tokens:
        headers[ROUTED_TOKENS_HEADER] = encode_token_ids(routed_ids)
    headers = sign_route(ROUTER_SECRET, ROUTED_BODY, headers)
    resp = client.post("/v1/completions", content=ROUTED_BODY, headers={**headers, "content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert seen[0].block_hashes == ((11, 22) if expect_routed else ())


def test_models_retrieve_answers_the_served_model_and_404_for_another():
    """GET /v1/models/{id} (the openai SDK's models.retrieve): the served model's entry; another id is a 404."""
    client, _ = _app()
    assert client.get("/v1/models/m").json() == client.get("/v1/models").json()["data"][0]
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_gives_the_tokens_a_generation_request_gets():
    """/tokenize (prompt or chat messages) counts the very tokens /v1 generation would use; /detokenize inverts it."""
    client, _ = _app()
    prompt = client.post("/tokenize", json={"model": "m", "prompt": "abc"}).json()
    assert prompt == {"count": 4, "max_model_len": CONFIG.engine.max_model_len, "tokens": [1, 97, 98, 99],
                      "token_strs": None}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == PromptBuilder(CONFIG, FakeTokenizer()).build(
        "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}).token_ids
    bare = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                          "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"]
    assert client.post("/detokenize", json={"tokens": [97, 98, 99]}).json() == {"prompt": "abc"}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", [1, 2], 400, None),
])
def test_tokenizer_endpoints_refuse_bad_input_naming_the_field(path, body, status, param):
    """Bad input to /tokenize and /detokenize is an OpenAI-shaped 4xx naming the field, never a 500."""
    client, _ = _app()
    resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize(("endpoint", "empty_body"), [("chat", {"content": ""}), ("completions", "")])
def test_a_token_with_no_text_yet_is_still_a_chunk_as_vllm_sends_it(endpoint, empty_body):
    """Per engine step, as vLLM's server: a delta with tokens but no text yet is sent with empty text; one with
    nothing at all (no token, text or finish) is not."""
    from kvtide.deployments.frontend.sse import ChunkRenderer

    renderer = ChunkRenderer(endpoint, "id-1", "m", 0, include_usage=False)
    event = renderer.delta(GenerateDelta(text="", num_output_tokens=1, num_prompt_tokens=3, token_ids=(200,)))
    choice = json.loads(event.decode().removeprefix("data: "))["choices"][0]
    assert choice["delta" if endpoint == "chat" else "text"] == empty_body and "token_ids" not in choice
    assert renderer.delta(GenerateDelta(text="", num_output_tokens=1, num_prompt_tokens=3)) is None


def _tenant_app(config=None, vllm_app=_stand_in_vllm_layer):
    """An app with two tenants' keys (team-a: sk-a, team-b: sk-b) over a stand-in vLLM layer."""
    config = config or CONFIG
    metrics = FakeMetrics()
    frontend = OpenAIFrontend(config, PromptBuilder(config, FakeTokenizer()), _local_engine(), metrics, None)
    frontend.vllm_app = vllm_app

    async def ready() -> bool:
        return True

    return TestClient(build_openai_app(frontend, ApiKeys(["team-a sk-a", "team-b sk-b"]), ready)), metrics


def test_a_tenants_request_reaches_vllms_layer_with_its_ids_and_salt_made_its_own():
    """Behind a key, vLLM's layer sees the body's request_id, previous_response_id and cache_salt and a stored
    response's path scoped to the tenant (tenancy.py); the tenant is counted with the status it got."""
    from kvtide.deployments.tenancy import tenant_tag

    client, metrics = _tenant_app()
    a = tenant_tag("team-a")
    body = {"model": "m", "input": "hi", "request_id": "mine", "previous_response_id": "resp_x", "cache_salt": "s"}
    seen = client.post("/v1/responses", json=body, headers={"Authorization": "Bearer sk-a"}).json()
    assert seen["body"]["request_id"] == f"mine.{a}" and seen["body"]["previous_response_id"] == f"resp_x.{a}"
    assert seen["body"]["cache_salt"] == f"{a}:s"
    got = client.get("/v1/responses/resp_x", headers={"Authorization": "Bearer sk-a"}).json()
    assert got["path"] == f"/v1/responses/resp_x.{a}"
    assert client.post("/v1/responses", json=body).status_code == 401
    assert metrics.tenants == [("team-a", 200), ("unauthenticated", 401)]


def test_a_tenant_over_its_rate_gets_429_with_retry_after_and_others_are_not_held_back():
    """frontend.auth.tenant_requests_per_s: past a tenant's burst its requests are 429 (Retry-After); another
    tenant's still pass."""
    config = CONFIG.model_copy(update={"frontend": CONFIG.frontend.model_copy(update={"auth": CONFIG.frontend.auth.
                               model_copy(update={"tenant_requests_per_s": 0.001, "tenant_burst": 2})})})
    client, metrics = _tenant_app(config)
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    codes = [client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-a"}) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert codes[2].json()["error"]["code"] == "rate_limit_exceeded" and int(codes[2].headers["Retry-After"]) >= 1
    assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-b"}).status_code == 200
    assert metrics.rejected == ["tenant_rate"]


def test_the_api_description_is_served_only_when_asked_for():
    """/docs, /redoc and /openapi.json answer 404 by default; frontend.openapi_docs turns them on."""
    client, _ = _app()
    assert [client.get(p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404, 404, 404]
    config = CONFIG.model_copy(update={"frontend": CONFIG.frontend.model_copy(update={"openapi_docs": True})})
    frontend = OpenAIFrontend(config, PromptBuilder(config, FakeTokenizer()), _local_engine(), FakeMetrics(), None)

    async def ready() -> bool:
        return True

    client = TestClient(build_openai_app(frontend, ApiKeys([]), ready))
    assert [client.get(p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [200, 200, 200]


@pytest.mark.parametrize(("dead_at_hand_over", "status", "code"), [
    (True, 503, "engine_unavailable"),  # the engine was gone before: another replica serves it (HAProxy retries 503)
    (False, 500, "engine_failed"),  # it died holding this request, maybe because of it: never replayed elsewhere
])
def test_a_local_engine_failing_before_the_first_token_is_retried_only_if_it_was_dead_before(dead_at_hand_over,
                                                                                              status, code):
    """Direct mode's engine client answers the retryable 503 only for an engine dead at hand-over, else a 500."""
    async def generate(request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        raise RuntimeError("EngineDeadError")
        yield  # an async generator

    engine = LocalEngineClient(generate, admission_limits(CONFIG), engine_dead=lambda: dead_at_hand_over)
    client, metrics = _app(engine=engine)
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
    assert resp.status_code == status and resp.json()["error"]["code"] == code
    assert ("Retry-After" in resp.headers) is (status == 503)
