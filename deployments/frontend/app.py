"""The OpenAI-compatible HTTP app: routes, API-key check, OpenAI-shaped errors.

    POST /v1/completions, /v1/chat/completions   (stream or not)   API key when keys are set
    POST /v1/responses, /v1/messages, /v1/chat/completions/batch,
         /inference/v1/generate, /generative_scoring, /v1/systemone
                                      (vLLM's layer answers them)    API key when keys are set
    POST /v1/messages/count_tokens, GET /v1/responses/{id},
         POST /v1/responses/{id}/cancel, POST /v1/{api}/render and
         /v1/{api}/derender  (vLLM's layer)                          API key when keys are set
    POST /inference/v1/abort_requests  (every engine's vLLM layer)   API key when keys are set
    GET  /v1/models, /v1/models/{id}                                 API key when keys are set
    POST /tokenize, /detokenize   (vLLM's shapes)                    API key when keys are set
    GET  /version                 (the serving vLLM's version)        open
    GET  /health  (liveness: the process answers)                    open, for probes
    GET  /ready   (an engine can serve)                              open, for probes

Every /v1 route hangs off one of two APIRouters whose dependency checks the key, so a route
added later cannot skip it (a unit test enumerates the app's routes). Unknown paths (404) and
wrong methods (405) answer in OpenAI's error shape too.

The generation POSTs (GENERATION_ROUTES) are dispatched ahead of FastAPI (`OpenAIApp`): each
is on a client's TTFT, which FastAPI's routing, dependency solving and middleware stack would
lengthen. They take the same key check (`_authorize`) and the same handler; every other
request (GETs, other paths and methods, a trailing slash) is FastAPI's.

Built per replica (`build_openai_app` is a Serve late-bound ASGI app: the replica's
`__serve_build_asgi_app__` calls it after its constructor), by an Ingress replica or by an
engine replica serving HTTP directly; the same routes either way.
"""

from __future__ import annotations

import os
import time
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtide.deployments.logs import replica_logger
from kvtide.config import KvtideConfig
from kvtide.deployments.frontend.admission import AdmissionLimits, admission_limits
from kvtide.deployments.frontend.auth import ApiKeys, authorize, load_api_keys
from kvtide.deployments.frontend.engine_client import EngineClient
from kvtide.deployments.frontend.pipeline import OpenAIFrontend, error_response
from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
from kvtide.deployments.frontend.metrics import FrontendMetrics
from kvtide.deployments.frontend import tokenize_api
from kvtide.deployments.frontend.prompts import PromptBuilder, load_tokenizer, parse_json_body
from kvtide.deployments.frontend.protocol import ApiError, error_body, validation_error_to_api
from kvtide.deployments.frontend.tenant_limits import TenantRateLimiter
from kvtide.deployments.tenancy import request_tenant, set_request_tenant
from kvtide.deployments.frontend.vllm_layer import vllm_layer_field

logger = replica_logger("openai_app")


def build_frontend(config: KvtideConfig, engine_client: Callable[[AdmissionLimits], EngineClient],
                   hot_prefixes: HotPrefixTracker | None, role: str) -> tuple[OpenAIFrontend, ApiKeys]:
    """The frontend and API keys of one replica (`role` names it in the log: ingress, engine server)."""
    limits = admission_limits(config)
    frontend = OpenAIFrontend(config, PromptBuilder(config, load_tokenizer(config)), engine_client(limits),
                              FrontendMetrics(), hot_prefixes)
    auth = config.frontend.auth
    api_keys = load_api_keys(auth.api_keys_env, auth.api_keys_file, auth.require_keys, os.environ)
    logger.info("%s: admits %d requests at once, deadline %s s, %s", role, limits.max_ongoing_requests,
                limits.request_timeout_s, f"API keys on ({len(api_keys)})" if api_keys.enabled else "API keys off")
    return frontend, api_keys


class _Unauthorized(Exception):
    def __init__(self, message: str):
        self.message = message


# POST path -> the frontend's endpoint name. All but completions and chat are vLLM's layer's
# alone (vllm_layer.VLLM_ONLY_ENDPOINTS: OpenAI's Responses API, Anthropic's Messages API, and
# vLLM's batch of chats, tokens-in/out generation, generative scoring and structured decisions),
# with kvtide's admission, deadline and metrics around them.
GENERATION_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                     "/v1/responses": "responses", "/v1/messages": "messages",
                     "/v1/chat/completions/batch": "chat_batch", "/inference/v1/generate": "generate",
                     "/generative_scoring": "generative_scoring", "/v1/systemone": "structured_decisions"}
# (method, path, endpoint) of vLLM's requests that generate nothing (count a message's tokens, a
# stored response, render a request to the engine prompt vLLM would run, token ids back to text):
# no admission, not counted.
VLLM_PASSTHROUGH_ROUTES = (("GET", "/v1/responses/{response_id}", "responses"),
                           ("POST", "/v1/responses/{response_id}/cancel", "responses"),
                           ("POST", "/v1/messages/count_tokens", "messages"),
                           ("POST", "/v1/chat/completions/render", "chat"),
                           ("POST", "/v1/completions/render", "completions"),
                           ("POST", "/v1/messages/render", "messages"),
                           ("POST", "/v1/responses/render", "responses"),
                           ("POST", "/v1/chat/completions/derender", "chat"),
                           ("POST", "/v1/completions/derender", "completions"))
# (method, path) of vLLM's requests every engine replica must act on: an abort names requests any
# replica may be running, so it is sent to all of them (pipeline.vllm_fleet).
VLLM_FLEET_ROUTES = (("POST", "/inference/v1/abort_requests"),)
# The routes of vLLM's own server (for a generative model) that kvtide does not serve, and why.
# Every other route of vLLM's app is served (a unit test compares with the installed vLLM's).
VLLM_ROUTES_NOT_SERVED = {
    "/metrics": "kvtide's metrics are exported on Ray's metrics port, fleet-wide (the chart scrapes it)",
    "/load": "one replica's in-flight count; the fleet's load is kvtide's own metrics",
    "/kv_event_sources": "the engines' KV event endpoints are internal to kvtide's routing",
    "/scale_elastic_ep": "elastic expert parallelism is an admin action; kvtide's autoscaler scales",
    "/is_scaling_elastic_ep": "elastic expert parallelism is an admin action; kvtide's autoscaler scales",
    "/ping": "SageMaker's container contract; kvtide's probes are /health and /ready",
    "/invocations": "SageMaker's container contract; kvtide deploys on Ray and KubeRay",
}


def _authorize(api_keys: ApiKeys, request: Request) -> None:
    """Raises _Unauthorized unless the request carries an accepted key (or keys are off); leaves the key's
    tenant on the request (tenancy.request_tenant)."""
    decision = authorize(api_keys, request.headers.get("authorization"))
    if not decision.ok:
        raise _Unauthorized(decision.message)
    set_request_tenant(request.scope, decision.tenant)


def _unauthorized_response(frontend: OpenAIFrontend, path: str, exc: _Unauthorized) -> JSONResponse:
    endpoint = GENERATION_ROUTES.get(path)
    if endpoint is not None:
        frontend.metrics.on_request_done(frontend.model_name, endpoint, 401)
    return error_response(ApiError(401, exc.message, code="invalid_api_key"))


class OpenAIApp:
    """The replica's ASGI app: the generation POSTs straight to the frontend, the rest through FastAPI."""

    def __init__(self, fastapi_app: FastAPI, frontend: OpenAIFrontend, api_keys: ApiKeys):
        self.fastapi_app = fastapi_app
        self.frontend = frontend
        self.api_keys = api_keys
        auth = frontend.config.frontend.auth
        self.tenant_limits = (TenantRateLimiter(auth.tenant_requests_per_s, auth.tenant_burst)
                              if auth.tenant_requests_per_s and api_keys.enabled else None)

    @property
    def routes(self) -> list[Any]:
        """FastAPI's routes: the generation POSTs are among them, with the same key check."""
        return self.fastapi_app.routes

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        path = get_route_path(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        endpoint = GENERATION_ROUTES.get(path) if path is not None else None
        if endpoint is None:
            await self.fastapi_app(scope, receive, send)
            return
        request = Request(scope, receive)
        tenant = "unauthenticated"
        try:
            _authorize(self.api_keys, request)
        except _Unauthorized as exc:
            response = _unauthorized_response(self.frontend, path, exc)
        else:
            tenant = request_tenant(request) or "none"
            limited = self._tenant_limited(tenant, endpoint)
            # every failure is an OpenAI body
            response = limited if limited is not None else await self.frontend.handle(request, endpoint)
        model = self.frontend.model_name

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.frontend.metrics.on_tenant_request(model, tenant, message["status"])
            await send(message)

        await response(scope, receive, counted)

    def _tenant_limited(self, tenant: str, endpoint: str) -> JSONResponse | None:
        """The 429 of a tenant past its rate (frontend.auth.tenant_requests_per_s), else None."""
        if self.tenant_limits is None:
            return None
        retry_after_s = self.tenant_limits.retry_after_s(tenant, time.monotonic())
        if retry_after_s is None:
            return None
        frontend = self.frontend
        frontend.metrics.on_rejected(frontend.model_name, "tenant_rate")
        frontend.metrics.on_request_done(frontend.model_name, endpoint, 429)
        return error_response(ApiError(
            429, "this API key is over its request rate; retry after the Retry-After delay", code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)}))


def build_openai_app(frontend: OpenAIFrontend, api_keys: ApiKeys,
                     is_ready: Callable[[], Awaitable[bool]]) -> OpenAIApp:
    """The app one replica serves; `is_ready` says whether an engine can take a request now."""
    # The API's own description (/docs, /redoc, /openapi.json) only where frontend.openapi_docs asks for it:
    # open to anyone, it maps the attack surface.
    docs = frontend.config.frontend.openapi_docs
    app = FastAPI(title="kvtide", description="OpenAI-compatible LLM serving on Ray Serve",
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error_to_api(list(exc.errors())))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(request: Request, exc: _Unauthorized) -> JSONResponse:
        return _unauthorized_response(frontend, get_route_path(request.scope), exc)

    def require_api_key(request: Request) -> None:
        _authorize(api_keys, request)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    # vLLM's tokenizer endpoints and its routes outside /v1: behind the key like /v1 (vLLM leaves some
    # open; any that tokenizes or generates costs the fleet CPU or GPU).
    keyed = APIRouter(dependencies=[Depends(require_api_key)])

    def generation(endpoint: str) -> Callable[[Request], Awaitable[Any]]:
        async def handler(request: Request) -> Any:
            return await frontend.handle(request, endpoint)
        return handler

    def vllm_passthrough(endpoint: str) -> Callable[[Request], Awaitable[Any]]:
        async def handler(request: Request) -> Any:
            return await frontend.vllm_passthrough(request, endpoint)
        return handler

    for path, endpoint in GENERATION_ROUTES.items():
        keyed.add_api_route(path, generation(endpoint), methods=["POST"])
    for method, path, endpoint in VLLM_PASSTHROUGH_ROUTES:
        keyed.add_api_route(path, vllm_passthrough(endpoint), methods=[method])

    async def vllm_fleet(request: Request) -> Any:
        return await frontend.vllm_fleet(request)

    for method, path in VLLM_FLEET_ROUTES:
        keyed.add_api_route(path, vllm_fleet, methods=[method])

    @v1.get("/models")
    async def models() -> Any:
        return frontend.models()

    @v1.get("/models/{model_id:path}")  # :path: a served name may hold '/' (org/model)
    async def model(model_id: str) -> Any:
        return frontend.model(model_id)

    app.include_router(v1)

    @keyed.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        body = await frontend.prompts.read_body(request)
        data = parse_json_body(body)
        chat = isinstance(data, dict) and "messages" in data
        if frontend.vllm_app is not None and ((chat and frontend.vllm_answers_all) or vllm_layer_field(
                data, "tokenize_chat" if chat else "tokenize", frontend.prompts.adapters)):
            # tools, template options or an adapter: vLLM renders and tokenizes
            return frontend.via_vllm(body, "tokenize", counted=False)
        return tokenize_api.tokenize(frontend.prompts, data)

    @keyed.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return tokenize_api.detokenize(frontend.prompts, parse_json_body(await frontend.prompts.read_body(request)))

    app.include_router(keyed)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return tokenize_api.version()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Any:
        if not await is_ready():
            return JSONResponse(error_body("no engine replica is serving yet", "server_error", code="not_ready"),
                                status_code=503)
        return {"status": "ready"}

    return OpenAIApp(app, frontend, api_keys)
