"""OpenAI-compatible ingress: validate, apply the chat template, tokenize ONCE, call an engine.

    POST /v1/completions, /v1/chat/completions   (stream or not)
    GET  /v1/models, /health (liveness), /ready (an engine replica answers)

A request's path through one ingress replica, each step refusing with an OpenAI-style body:

    auth (401) → admission gate (429) → read + validate (400/404/413) → tokenize once
      → open the engine stream: first delta, retried on another replica while none came
        (429 engine queue full, 503 no replica, 504 deadline)
      → respond: JSON, or SSE; a failure after the first byte is an SSE error event + [DONE]

Every client mistake is an OpenAI-style error JSON with a 4xx status: malformed JSON or
bad fields → 400 naming the field, unknown model → 404, prompt + max_tokens over the
context → 400 stating both numbers, body too large → 413, too many messages or too many
prompt characters (checked before tokenizing) → 400. Overload and deadlines follow
deployments.admission; API keys follow deployments.auth (/health and /ready stay open).
A client that disconnects mid-stream cancels the handle call, which aborts the request
inside the engine.

Retry rule: a request is retried on another engine replica only while it has produced no
token (its first delta has not arrived), so a client never sees text twice; after that a
replica failure ends the stream with an error event. Prompts and keys are never logged:
log lines carry request ids and exception class names only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import time
import traceback
import uuid
import weakref
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray.serve.handle import DeploymentHandle

from kvtide.config import KvtideConfig, parse_config
from kvtide.deployments.admission import AdmissionGate, Deadline, admission_limits, max_prompt_chars
from kvtide.deployments.auth import authorize, load_api_keys
from kvtide.deployments.ingress_metrics import IngressMetrics
from kvtide.deployments.messages import GenerateDelta, GenerateRequest, SamplingSpec
from kvtide.deployments.hot_prefixes import HotPrefixTracker
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    now_s,
    usage_chunk,
    validation_error_to_api,
)

logger = logging.getLogger("kvtide.ingress")

# Completions default to 16 output tokens, as OpenAI's legacy endpoint does.
DEFAULT_COMPLETION_MAX_TOKENS = 16
READY_TIMEOUT_S = 5.0
# A JSON escape of a UTF-16 surrogate; only then can a parsed body hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")

app = FastAPI(title="kvtide", description="OpenAI-compatible LLM serving on Ray Serve")


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown paths (404) and wrong methods (405) still answer in OpenAI's error shape.
    err = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _error_response(validation_error_to_api(list(exc.errors())))


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _engine_failure_kind(exc: BaseException) -> str | None:
    """How an engine call failed: "backpressure" (Serve's handle queue is full), "replica"
    (the replica or its engine died: another replica may serve it), or None (anything else)."""
    if isinstance(exc, BackPressureError):
        return "backpressure"
    if isinstance(exc, (RayActorError, ReplicaUnavailableError)):
        return "replica"
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BackPressureError):
            return "backpressure"
        if isinstance(cause, (RayActorError, ReplicaUnavailableError)):
            return "replica"
        # vLLM's engine core died under a live actor: check_health will replace the replica.
        if type(cause).__name__ in ("EngineDeadError", "EngineGenerateError"):
            return "replica"
    return None


class _Ticket:
    """One admitted request's hold on the gate; released exactly once, however the request ends."""

    __slots__ = ("_gate", "_held")

    def __init__(self, gate: AdmissionGate):
        self._gate, self._held = gate, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gate.leave()


class _Stream:
    """An engine call whose first delta has arrived (`first`), or that ended with none."""

    def __init__(self, response: Any):
        self.response = response
        self.iterator = response.__aiter__()
        self.first: GenerateDelta | None = None

    def cancel(self) -> None:
        # Cancelling the handle call aborts the request inside the engine (its KV is freed).
        try:
            self.response.cancel()
        except Exception:  # already finished, or its replica is gone
            pass


@serve.ingress(app)
class Ingress:
    """One ingress replica: owns the tokenizer and the engine handle."""

    def __init__(self, engine: DeploymentHandle, config_dict: dict):
        from transformers import AutoTokenizer

        self.config: KvtideConfig = parse_config(config_dict)
        self.engine = engine
        self.model_name = self.config.model_name
        self.max_model_len = self.config.engine.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.vocab_size = len(self.tokenizer)
        self.metrics = IngressMetrics()
        self.block_size = self.config.engine.block_size
        self.routing_policy = self.config.routing.policy
        self.hot_prefixes_tracker = HotPrefixTracker(self.block_size)
        self.limits = admission_limits(self.config)
        self.gate = AdmissionGate(self.limits.max_ongoing_requests)
        self.max_prompt_chars = max_prompt_chars(self.config)
        auth = self.config.ingress.auth
        self.api_keys = load_api_keys(auth.api_keys_env, auth.api_keys_file, auth.require_keys, os.environ)
        logger.info("ingress: admits %d requests at once, deadline %s s, %s", self.limits.max_ongoing_requests,
                    self.limits.request_timeout_s,
                    f"API keys on ({len(self.api_keys)})" if self.api_keys.enabled else "API keys off")

    # ---- plumbing ---------------------------------------------------------------

    async def _read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        limit = self.config.ingress.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
        if _SURROGATE_ESCAPE.search(body):
            # Paired surrogates decode to one character; a lone one can be neither tokenized nor sent on.
            try:
                json.dumps(data, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "a string in the request body holds a lone UTF-16 surrogate (U+D800..U+DFFF)",
                               code="invalid_value") from None
        return data

    def _parse(self, data: Any, model_cls: type) -> Any:
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_value")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error_to_api(exc.errors()) from None
        if req.model != self.model_name:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return req

    def _budget(self, prompt_ids: list[int], requested: int | None, default: int | None) -> int:
        """Output tokens for this request; 400 if prompt + max_tokens cannot fit the context."""
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise ApiError(400, "the prompt is empty: it has no tokens", param="prompt", code="invalid_value")
        room = self.max_model_len - num_prompt
        if room <= 0:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; "
                                f"the prompt has {num_prompt} tokens", param="messages", code="context_length_exceeded")
        max_tokens = requested if requested is not None else (default or room)
        if num_prompt + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; you requested "
                                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                                f"completion). Reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def _sampling(self, req: Any, max_tokens: int) -> SamplingSpec:
        return SamplingSpec(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                            seed=req.seed, stop=tuple(req.stop or ()), ignore_eos=req.ignore_eos)

    # ---- tokenization (once, here) -------------------------------------------------

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {num_chars} characters; the limit is {self.max_prompt_chars} "
                                "(ingress.max_prompt_chars)", param=param, code="prompt_too_long")

    def _completion_tokens(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            self._check_prompt_chars(len(req.prompt), "prompt")
            return self.tokenizer.encode(req.prompt, add_special_tokens=True)
        bad = [t for t in req.prompt if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range; the vocabulary has {self.vocab_size} tokens",
                           param="prompt", code="invalid_value")
        return list(req.prompt)

    def _chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        limit = self.config.ingress.max_messages
        if len(req.messages) > limit:
            raise ApiError(400, f"the request has {len(req.messages)} messages; the limit is {limit} "
                                "(ingress.max_messages)", param="messages", code="too_many_messages")
        conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
        self._check_prompt_chars(sum(len(m["content"]) for m in conversation), "messages")
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may reject a role order; that is the client's input
            raise ApiError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages", code="invalid_value") from None
        # The template already holds BOS; adding special tokens again would double it.
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- the generation paths --------------------------------------------------------

    async def _next(self, stream: _Stream, deadline: Deadline) -> GenerateDelta:
        """The next delta within the request's deadline (TimeoutError past it)."""
        remaining_s = deadline.remaining_s(time.monotonic())
        if remaining_s is None:
            return await stream.iterator.__anext__()
        return await asyncio.wait_for(stream.iterator.__anext__(), remaining_s)

    async def _open_stream(self, gen_req: GenerateRequest, deadline: Deadline) -> _Stream:
        """Call an engine and wait for its first delta, retrying on another replica while none came.

        Serve's router drops a replica whose actor died from its candidates, so a retry
        lands on a survivor. Raises ApiError: 429 (engine handle queue full), 503 (no
        replica could serve it), 504 (deadline).
        """
        retry_after = {"Retry-After": str(self.limits.retry_after_s)}
        attempt = 0
        while True:
            call = gen_req if attempt == 0 else dataclasses.replace(gen_req, request_id=f"{gen_req.request_id}-{attempt}")
            stream = _Stream(self.engine.options(stream=True).generate.remote(call))
            try:
                stream.first = await self._next(stream, deadline)
                return stream
            except StopAsyncIteration:
                return stream
            except (asyncio.TimeoutError, TimeoutError):
                stream.cancel()
                self.metrics.on_rejected(self.model_name, "timeout")
                raise ApiError(504, f"the request did not start within its deadline of "
                                    f"{self.limits.request_timeout_s} s", code="timeout") from None
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except Exception as exc:
                stream.cancel()
                kind = _engine_failure_kind(exc)
                if kind == "backpressure":
                    self.metrics.on_rejected(self.model_name, "engine_queue_full")
                    raise ApiError(429, "the engines are at capacity; retry after the Retry-After delay",
                                   code="rate_limit_exceeded", headers=retry_after) from None
                if kind != "replica" or attempt >= self.limits.max_retries:
                    logger.warning("request %s failed before its first token (attempt %d): %s",
                                   gen_req.request_id, attempt + 1, type(exc).__name__)
                    raise ApiError(503, "no engine replica could serve the request; retry it",
                                   code="engine_unavailable", headers=retry_after) from None
                logger.info("request %s: engine replica failed before its first token (%s); retrying",
                            gen_req.request_id, type(exc).__name__)
                attempt += 1

    async def _run(self, endpoint: str, req: Any, prompt_ids: list[int], max_tokens: int,
                   deadline: Deadline, ticket: _Ticket) -> Any:
        started_s = time.perf_counter()
        rid_prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        rid = f"{rid_prefix}-{uuid.uuid4().hex}"
        hashes = tuple(block_hashes(prompt_ids, self.block_size))
        self.hot_prefixes_tracker.observe(prompt_ids, hashes, time.monotonic())
        gen_req = GenerateRequest(
            request_id=rid, prompt_token_ids=prompt_ids, sampling=self._sampling(req, max_tokens),
            block_hashes=hashes,
            prompt=self.tokenizer.decode(prompt_ids) if self.routing_policy == "ray_prefix" else None)
        tags = {"model": self.model_name, "endpoint": endpoint}
        self.metrics.prompt_tokens.inc(len(prompt_ids), tags)
        stream = await self._open_stream(gen_req, deadline)
        first = stream.first
        first_token_s = time.perf_counter() if first is not None and first.num_output_tokens else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(endpoint, rid, gen_req, stream, include_usage, started_s, first_token_s,
                                deadline, ticket)
            # The body releases the gate when it ends; should the server drop the response
            # without iterating it (the client left first), collection releases it instead.
            weakref.finalize(body, ticket.release)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if first is not None:
                headers["x-kvtide-replica"] = first.replica_id
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        text, last = ([first.text], first) if first is not None else ([], None)
        try:
            while last is not None and last.finish_reason is None:
                delta = await self._next(stream, deadline)
                if first_token_s is None and delta.num_output_tokens:
                    first_token_s = time.perf_counter()
                text.append(delta.text)
                last = delta
        except StopAsyncIteration:
            pass
        except (asyncio.TimeoutError, TimeoutError):
            stream.cancel()
            self.metrics.on_rejected(self.model_name, "timeout")
            self.metrics.on_request_done(self.model_name, endpoint, 504)
            return _error_response(ApiError(504, f"the request did not finish within its deadline of "
                                                 f"{self.limits.request_timeout_s} s", code="timeout"))
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as exc:
            stream.cancel()
            logger.warning("request %s failed in the engine: %s", rid, type(exc).__name__)
            self.metrics.on_request_done(self.model_name, endpoint, 503)
            return _error_response(ApiError(503, "the engine failed while generating; retry the request",
                                            code="engine_unavailable",
                                            headers={"Retry-After": str(self.limits.retry_after_s)}))
        usage = Usage(len(prompt_ids), last.num_output_tokens if last else 0, last.num_cached_tokens if last else 0)
        self._observe(tags, started_s, first_token_s, usage, status=200)
        created = now_s()
        full = "".join(text)
        finish = last.finish_reason if last else None
        headers = {"x-kvtide-replica": last.replica_id} if last else None
        if endpoint == "chat":
            return JSONResponse(chat_response(rid, self.model_name, created, full, finish, usage), headers=headers)
        return JSONResponse(completion_response(rid, self.model_name, created, full, finish, usage), headers=headers)

    async def _stream(self, endpoint: str, rid: str, gen_req: GenerateRequest, stream: _Stream,
                      include_usage: bool, started_s: float, first_token_s: float | None, deadline: Deadline,
                      ticket: _Ticket) -> AsyncIterator[bytes]:
        created = now_s()
        tags = {"model": self.model_name, "endpoint": endpoint}
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

        def chunk(text_or_delta: Any, finish: str | None) -> dict[str, Any]:
            body = (chat_chunk(rid, self.model_name, created, text_or_delta, finish) if endpoint == "chat"
                    else completion_chunk(rid, self.model_name, created, text_or_delta, finish))
            if include_usage:
                body["usage"] = None  # OpenAI: null on every chunk but the last
            return body

        def event(delta: GenerateDelta) -> bytes | None:
            if not (delta.text or delta.finish_reason):
                return None
            body = {"content": delta.text} if endpoint == "chat" else delta.text
            if endpoint == "chat" and delta.finish_reason and not delta.text:
                body = {}
            return _sse(chunk(body, delta.finish_reason))

        last = stream.first
        prev_s, prev_tokens = first_token_s, (last.num_output_tokens if last is not None else 0)
        try:
            if endpoint == "chat":
                yield _sse(chunk({"role": "assistant", "content": ""}, None))
            if last is not None and (data := event(last)) is not None:
                yield data
            while last is not None and last.finish_reason is None:
                try:
                    delta = await self._next(stream, deadline)
                except StopAsyncIteration:
                    break
                now = time.perf_counter()
                if delta.num_output_tokens > prev_tokens:
                    if first_token_s is None:
                        first_token_s = now
                    elif prev_s is not None:
                        # Spread the gap over the tokens it delivered: ITL per token.
                        per_token_s = (now - prev_s) / (delta.num_output_tokens - prev_tokens)
                        self.metrics.itl_s.observe(per_token_s, tags)
                    prev_s, prev_tokens = now, delta.num_output_tokens
                last = delta
                if (data := event(delta)) is not None:
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
            yield _sse(error_body(f"the request did not finish within its deadline of "
                                  f"{self.limits.request_timeout_s} s", "server_error", code="timeout"))
            yield _sse("[DONE]")
            return
        except Exception as exc:
            stream.cancel()
            ticket.release()
            logger.warning("stream %s failed in the engine: %s", rid, type(exc).__name__)
            self.metrics.on_request_done(self.model_name, endpoint, 503)
            yield _sse(error_body("the engine failed while generating; retry the request", "server_error",
                                  code="engine_unavailable"))
            yield _sse("[DONE]")
            return
        finally:
            ticket.release()
        usage = Usage(len(gen_req.prompt_token_ids), last.num_output_tokens if last else 0,
                      last.num_cached_tokens if last else 0)
        if include_usage:
            yield _sse(usage_chunk(rid, self.model_name, created, obj, usage))
        yield _sse("[DONE]")
        self._observe(tags, started_s, first_token_s, usage, status=200)

    def _observe(self, tags: dict[str, str], started_s: float, first_token_s: float | None, usage: Usage,
                 status: int) -> None:
        if first_token_s is not None:
            self.metrics.ttft_s.observe(first_token_s - started_s, tags)
        self.metrics.e2e_s.observe(time.perf_counter() - started_s, tags)
        if usage.completion_tokens:  # Ray counters refuse increments of 0
            self.metrics.output_tokens.inc(usage.completion_tokens, tags)
        self.metrics.on_request_done(tags["model"], tags["endpoint"], status)

    async def _handle(self, request: Request, endpoint: str) -> Any:
        """auth → admission → validate and tokenize → generate; every refusal an OpenAI error body."""
        decision = authorize(self.api_keys, request.headers.get("authorization"))
        if not decision.ok:
            self.metrics.on_request_done(self.model_name, endpoint, 401)
            return _error_response(ApiError(401, decision.message, code="invalid_api_key"))
        if not self.gate.try_enter():
            self.metrics.on_rejected(self.model_name, "ingress_full")
            self.metrics.on_request_done(self.model_name, endpoint, 429)
            return _error_response(ApiError(
                429, f"this server is at capacity ({self.gate.limit} requests in flight per ingress replica); "
                     "retry after the Retry-After delay", code="rate_limit_exceeded",
                headers={"Retry-After": str(self.limits.retry_after_s)}))
        ticket = _Ticket(self.gate)
        deadline = Deadline(self.limits.request_timeout_s, time.monotonic())
        streaming = False
        try:
            if endpoint == "chat":
                req = self._parse(await self._read_json(request), ChatCompletionRequest)
                prompt_ids = self._chat_tokens(req)
                max_tokens = self._budget(prompt_ids, req.max_output_tokens, None)
            else:
                req = self._parse(await self._read_json(request), CompletionRequest)
                prompt_ids = self._completion_tokens(req)
                max_tokens = self._budget(prompt_ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
            response = await self._run(endpoint, req, prompt_ids, max_tokens, deadline, ticket)
            streaming = isinstance(response, StreamingResponse)
            return response
        except ApiError as err:
            self.metrics.on_request_done(self.model_name, endpoint, err.status)
            return _error_response(err)
        except Exception as exc:  # a bug, not the client's fault: still an OpenAI body, never a hang
            # Frames only: an exception's message may quote the prompt, which is never logged.
            logger.error("request on %s failed unexpectedly: %s\n%s", endpoint, type(exc).__name__,
                         "".join(traceback.format_tb(exc.__traceback__)))
            self.metrics.on_request_done(self.model_name, endpoint, 500)
            return _error_response(ApiError(500, "internal error; retry the request", code="internal_error"))
        finally:
            if not streaming:  # a stream's body releases the gate when it ends
                ticket.release()

    async def hot_prefixes(self, limit: int = 32) -> list[tuple[list[int], float]]:
        """Handle method (not HTTP): shared prefixes a new engine replica should prefill."""
        return self.hot_prefixes_tracker.hottest(time.monotonic(), limit=limit)

    # ---- routes ------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._handle(request, "chat")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        decision = authorize(self.api_keys, request.headers.get("authorization"))
        if not decision.ok:
            return _error_response(ApiError(401, decision.message, code="invalid_api_key"))
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "kvtide",
            "max_model_len": self.max_model_len,
        }]}

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self) -> Any:
        try:
            ok = await asyncio.wait_for(self.engine.ready.remote(), timeout=READY_TIMEOUT_S)
        except Exception:
            ok = False
        if not ok:
            return JSONResponse(error_body("no engine replica is serving yet", "server_error", code="not_ready"),
                                status_code=503)
        return {"status": "ready"}
