"""Direct mode's routing peer: HAProxy asks it which engine replica should take a POST.

    HAProxy ─POST /internal/route (the request body)─► Router replica (one per HAProxy node)
        tokenize the prompt (prompts.PromptBuilder: the same tokens the replica will compute)
        → block hashes → engine handle.choose_replica(RoutingKey, _reserve=False)
          (runs the engine deployment's request router: kvtide's prefix_aware, or a baseline)
    ◄── {"replica_id": "SERVE_REPLICA::<app>#Engine#<id>",
         "request_headers": {vllm_layer.PATH_HEADER: "kvtide" | "vllm_layer",
                             prompts.ROUTED_TOKENS_HEADER: <the token ids>,
                             routing_key.ROUTED_HASHES_HEADER: <their block hashes>,
                             routing.trust.PREDICTED_CACHED_TOKENS_HEADER:
                                 <cached tokens>;<replica>;<exclusive tokens>,
                             internal_auth.ROUTE_SIGNATURE_HEADER: <HMAC of them and the body>}};
        HAProxy forwards the original request, with those headers, to that replica's own HTTP port

The first header is the one decision of the path that serves the request (vllm_layer.request_path):
kvtide's own, which takes the token ids and hashes (the replica tokenizes nothing), or vLLM's
serving layer (tools, Responses, Messages, ...), which renders the prompt itself: such a request
carries no token or hash headers, only the path and the prediction.

A body continuing a stored response (`previous_response_id`, serving.responses_store) is pinned
to the replica holding it (routing.response_pins): the RoutingKey carries that replica.

The third header is the router's prediction of the prompt tokens the picked replica has
cached (and of those, the ones no other replica holds) (prefix_aware writes it into the RoutingKey's `decision` slot); the replica compares
it with the engine's report when the request finishes (index-trust telemetry).

Ray Serve 2.60 wires it with `Application._with_ingress_request_router` (an internal hook
that Ray Serve LLM's direct streaming uses too) and HAProxy's Lua action; the body reaches
this peer only with RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 (KvtideConfig sets it).

Never fails a request: a body that is not a valid request routes with no hashes (a
load-only pick) and the replica answers the 400 itself. The peer also keeps the hot-prefix
tracker a new engine replica asks before it takes traffic (it sees every POST of its node).

No work for a stranger (internal_auth.py, tenancy.py): a consult without HAProxy's consult
token is refused before its body is read; a request without a valid API key is routed by load
without being parsed, rendered or tokenized (the replica answers its 401), and never feeds the
hot-prefix list. With a key, the request's tenant salts its block hashes as the replica salts
its prompt. The body is read up to HAProxy's buffer; tokenizing is bounded in time, and while
every tokenize thread has a backlog a request is routed by load at once instead of queueing
(requests keep flowing, at the cost of their cache affinity). The headers it returns are
signed; a replica uses them only under that signature.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from typing import Any, Awaitable, Callable

from ray import serve
from ray.serve.handle import DeploymentHandle

from kvtide.deployments.logs import replica_logger
from kvtide.config import KvtideConfig, parse_config
from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
from kvtide.deployments.messages import KVTIDE_PATH, VLLM_LAYER_PATH, RoutingKey
from kvtide.deployments.frontend.prompt_pool import PromptPool
from kvtide.deployments.routing.response_pins import previous_response_owner
from kvtide.deployments.frontend.prompts import SESSION_HEADER, Prompt, PromptBuilder, load_tokenizer, session_key
from kvtide.deployments.frontend.routing_key import PromptRouting, prompt_block_hashes
from kvtide.deployments.frontend.auth import authorize, load_api_keys
from kvtide.deployments.internal_auth import CONSULT_HEADER, consult_allowed, load_internal_secret, sign_route
from kvtide.deployments.tenancy import tenant_tag
from kvtide.deployments.routing.trust import prediction_header
from kvtide.deployments.frontend.vllm_layer import PATH_HEADER, answers_every_request
from kvtide.deployments.frontend.vllm_render import RenderSlot
from kvtide.deployments.engine.vllm_openai import build_chat_renderer

logger = replica_logger("router_peer")
# Tokenize calls a thread may have waiting or running before a new request is routed by load instead:
# a burst still tokenizes side by side, a flood (or one slow render) never queues without bound.
TOKENIZE_BACKLOG_PER_THREAD = 8
LOG_EVERY_S = 10.0


@serve.ingress()
class RouterPeer:
    """Picks an engine replica for HAProxy; holds the node's hot-prefix view."""

    num_routed_by_load = 0  # requests routed by load for want of tokenizing (saturated or too slow)
    logged_s = -LOG_EVERY_S  # when that was last logged (monotonic)

    def __init__(self, engine: DeploymentHandle, config_dict: dict):
        config: KvtideConfig = parse_config(config_dict)
        self.secret = load_internal_secret(os.environ)  # refuses to start without the cluster secret
        auth = config.frontend.auth
        self.api_keys = load_api_keys(auth.api_keys_env, auth.api_keys_file, auth.require_keys, os.environ)
        self.isolate_caches = auth.tenant_cache_isolation
        self.tokenize_timeout_s = config.http.router_tokenize_timeout_s
        self.engine = engine
        self.block_size = config.engine.block_size
        self.buffer_bytes = config.http.router_buffer_bytes
        tokenizer = load_tokenizer(config)
        self.prompts = PromptBuilder(config, tokenizer)
        self.vllm_answers_all = answers_every_request(config.serving)
        self.prompt_pool = PromptPool.for_config(config, tokenizer)  # None: tokenize on the event loop
        if config.serving.peer_renders_chat:  # vLLM's renderer for vLLM-layer chats, built in the background
            slot = RenderSlot()
            for builder in [self.prompts, *(self.prompt_pool.builders if self.prompt_pool else ())]:
                builder.vllm_render = slot
            slot.start(functools.partial(build_chat_renderer, config, config.model))
        self.routing = PromptRouting(config, tokenizer, HotPrefixTracker(self.block_size))

    def __serve_build_asgi_app__(self):
        return route_app(self.route, self.secret, self.buffer_bytes)

    async def route(self, body: bytes, session_header: str | None = None,
                    authorization: str | None = None) -> dict[str, Any]:
        """The replica HAProxy should pin this request to."""
        decision = authorize(self.api_keys, authorization)
        if not decision.ok:  # the replica answers the 401; nothing here parses, renders or books for it
            return {"replica_id": await self._pick(RoutingKey()), "request_headers": {}}
        tag = tenant_tag(decision.tenant)
        prompt, hashes, path = await self._prompt_and_hashes(body, tag)
        token_ids = prompt.token_ids if prompt is not None else []
        if prompt is not None:
            self.routing.observe(token_ids, hashes, prompt.request.cache_salt)
        key = RoutingKey(block_hashes=hashes,
                         session_key=session_key(prompt, session_header),
                         prompt=self.routing.prompt_text(token_ids),
                         pinned_replica=previous_response_owner(body, tag))
        replica_id = await self._pick(key)
        # HAProxy sets these headers on the request it forwards: the replica skips tokenizing
        # and hashing, and learns what the router expected it to have cached.
        room_bytes = self.buffer_bytes - len(body) - HEADER_HEADROOM_BYTES
        try:
            headers = sign_route(self.secret, body, route_headers(
                self.prompts, token_ids, key, room_bytes, path, prompt is not None and prompt.vllm_rendered))
        except Exception as exc:  # a bug on some input costs the replica a tokenization, never the request
            logger.warning("routing headers failed (%s); the replica tokenizes the request itself", type(exc).__name__)
            headers = {}
        return {"replica_id": replica_id, "request_headers": headers}

    async def _pick(self, key: RoutingKey) -> str:
        async with self.engine.choose_replica(key, _reserve=False) as selection:
            return selection._replica.replica_id.to_full_id_str()

    async def _prompt_and_hashes(self, body: bytes, tag: str | None) -> tuple[Prompt | None, tuple, str | None]:
        """The body's prompt, block hashes (salted for the tenant `tag`) and path (routing_prompt_and_hashes), or
        (None, (), None) to route by load: tokenize threads all backlogged, or tokenizing past its time bound."""
        tokenize = functools.partial(routing_prompt_and_hashes, body=body, block_size=self.block_size,
                                     tenant=tag, isolate_caches=self.isolate_caches,
                                     answers_all=self.vllm_answers_all)
        if self.prompt_pool is None:
            return tokenize(self.prompts)
        if self.prompt_pool.saturated(TOKENIZE_BACKLOG_PER_THREAD):
            self._by_load("every tokenize thread has a backlog")
            return None, (), None
        try:
            return await self.prompt_pool.run(tokenize, self.tokenize_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._by_load(f"tokenizing took over {self.tokenize_timeout_s} s")
            return None, (), None

    def _by_load(self, why: str) -> None:
        """Count a request routed by load for want of tokenizing; logged at most once per LOG_EVERY_S (a flood
        must not turn into a flood of log lines)."""
        self.num_routed_by_load += 1
        now_s = time.monotonic()
        if now_s - self.logged_s >= LOG_EVERY_S:
            self.logged_s = now_s
            logger.warning("%s: requests routed by load alone (%d so far)", why, self.num_routed_by_load)

    async def hot_prefixes(self, limit: int = 32) -> list[tuple[list[int], float]]:
        """Handle method (not HTTP): shared prefixes a new engine replica should prefill."""
        return self.routing.hottest(limit)


def routing_prompt_and_hashes(prompts: PromptBuilder, body: bytes, block_size: int, tenant: str | None = None,
                              isolate_caches: bool = True, answers_all: bool = False
                              ) -> tuple[Prompt | None, tuple, str | None]:
    """A body's prompt (None when it does not render), its block hashes, salted by its cache_salt (with the tag
    of the tenant `tenant` mixed in, as the replica mixes it, tenancy.py), and the path serving it
    (PromptBuilder.routing_view)."""
    prompt, path = prompts.routing_view(body, tenant, isolate_caches, answers_all)
    if prompt is None:
        return None, (), path
    return prompt, prompt_block_hashes(prompt.token_ids, block_size, prompt.request.cache_salt), path


ROUTE_PATH = "/internal/route"
_SESSION_HEADER_KEY = SESSION_HEADER.encode("latin-1")
_CONSULT_KEY = CONSULT_HEADER.encode("latin-1")


def route_app(route: Callable[[bytes, str | None, str | None], Awaitable[dict[str, Any]]], secret: bytes,
              max_body_bytes: int) -> Callable[..., Awaitable[None]]:
    """The peer's HTTP face, a bare ASGI callable: POST /internal/route → `route(body, session header,
    Authorization header)` as JSON.

    Only HAProxy's consults are answered (internal_auth.CONSULT_HEADER; 403 before the body is read).
    A body is read up to `max_body_bytes` (HAProxy's buffer, all it ever sends); past that it is
    routed as an empty one, by load.

    Every POST a client sends waits for this answer (HAProxy's Lua consults it before it
    forwards, and reads the answer until the peer closes the connection), so it skips
    FastAPI's routing, middleware and dependency solving for its one route: that work would
    sit on every request's time to first token (benchmarks/results/overhead-cpu-peer-asgi).
    """
    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                  send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":  # Serve runs the app's lifespan: nothing to start or stop
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
                   if name in (_SESSION_HEADER_KEY, _CONSULT_KEY, b"authorization")}
        if scope["method"] != "POST" or not scope["path"].endswith(ROUTE_PATH):
            status, answer = 404, {"error": f"the routing peer answers only POST {ROUTE_PATH}"}
        elif not consult_allowed(secret, headers.get(CONSULT_HEADER)):
            status, answer = 403, {"error": "the routing peer answers only its node's HAProxy"}
        else:
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size <= max_body_bytes:
                    chunks.append(chunk)
                if not message.get("more_body"):
                    break
            # HAProxy forwards the client's session header (Ray's RAY_SERVE_SESSION_ID_HEADER_KEY) and,
            # through kvtide's Lua (cluster/haproxy_shim.py), its Authorization header.
            status, answer = 200, await route(b"".join(chunks) if size <= max_body_bytes else b"",
                                              headers.get(SESSION_HEADER), headers.get("authorization"))
        body = json.dumps(answer, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


# What the forwarded request's other headers and HAProxy's rewrite reserve may take of its buffer.
HEADER_HEADROOM_BYTES = 16 << 10


def route_headers(prompts: PromptBuilder, token_ids: list[int], key: RoutingKey, room_bytes: int,
                  path: str | None = KVTIDE_PATH, vllm_rendered: bool = False) -> dict[str, str]:
    """The headers HAProxy sets on the forwarded request: the path that serves it (None: not decided, an invalid
    body), the token ids and their block hashes where that is kvtide's own path, the token ids alone where vLLM's
    renderer made them for its layer (`vllm_rendered`, vllm_render.py), and the router's prediction if any.

    The token ids and hashes only if they fit in `room_bytes`, what HAProxy's buffer has left
    beside the body: a header that does not fit fails HAProxy's rewrite, and the request with
    it (the replica tokenizes and hashes when the headers are absent).
    """
    if path == KVTIDE_PATH:
        tokens = prompts.routed_tokens_header(token_ids, key.block_hashes)
    elif path == VLLM_LAYER_PATH and vllm_rendered:
        tokens = prompts.routed_tokens_header(token_ids)
    else:
        tokens = {}
    if sum(len(k) + len(v) + 4 for k, v in tokens.items()) > room_bytes:
        tokens = {}
    return {**({PATH_HEADER: path} if path else {}), **tokens, **prediction_header(key.decision)}
