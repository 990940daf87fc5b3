"""OpenAI-compatible ingress: validate, apply the chat template, tokenize ONCE, call an engine.

    POST /v1/completions, /v1/chat/completions   (stream or not)
    GET  /v1/models, /health (liveness), /ready (an engine replica answers)

Every client mistake is an OpenAI-style error JSON with a 4xx status: malformed JSON or
bad fields → 400 naming the field, unknown model → 404, prompt + max_tokens over the
context → 400 stating both numbers, body too large → 413. A client that disconnects
mid-stream cancels the handle call, which aborts the request inside the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray.serve.handle import DeploymentHandle

from cluster.config import KvtideConfig, parse_config
from deployments.ingress_metrics import IngressMetrics
from deployments.messages import GenerateDelta, GenerateRequest, SamplingSpec
from deployments.hot_prefixes import HotPrefixTracker
from deployments.routing.block_hash import block_hashes
from deployments.protocol import (
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
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None

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
                            seed=req.seed, stop=tuple(req.stop or ()))

    # ---- tokenization (once, here) -------------------------------------------------

    def _completion_tokens(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return self.tokenizer.encode(req.prompt, add_special_tokens=True)
        bad = [t for t in req.prompt if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range; the vocabulary has {self.vocab_size} tokens",
                           param="prompt", code="invalid_value")
        return list(req.prompt)

    def _chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may reject a role order; that is the client's input
            raise ApiError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages", code="invalid_value") from None
        # The template already holds BOS; adding special tokens again would double it.
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- the generation paths --------------------------------------------------------

    async def _stream_deltas(self, gen_req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        stream = self.engine.options(stream=True).generate.remote(gen_req)
        async for delta in stream:
            yield delta

    async def _run(self, endpoint: str, req: Any, prompt_ids: list[int], max_tokens: int) -> Any:
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
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(endpoint, rid, gen_req, include_usage, started_s),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        text, last, first_token_s = [], None, None
        try:
            async for delta in self._stream_deltas(gen_req):
                if first_token_s is None and delta.num_output_tokens:
                    first_token_s = time.perf_counter()
                text.append(delta.text)
                last = delta
        except Exception as exc:
            logger.warning("request %s failed in the engine: %s", rid, type(exc).__name__)
            self.metrics.on_request_done(self.model_name, endpoint, 503)
            return _error_response(ApiError(503, "the engine failed while generating; retry the request",
                                            code="engine_unavailable", headers={"Retry-After": "1"}))
        usage = Usage(len(prompt_ids), last.num_output_tokens if last else 0, last.num_cached_tokens if last else 0)
        self._observe(tags, started_s, first_token_s, usage, status=200)
        created = now_s()
        full = "".join(text)
        finish = last.finish_reason if last else None
        headers = {"x-kvtide-replica": last.replica_id} if last else None
        if endpoint == "chat":
            return JSONResponse(chat_response(rid, self.model_name, created, full, finish, usage), headers=headers)
        return JSONResponse(completion_response(rid, self.model_name, created, full, finish, usage), headers=headers)

    async def _stream(self, endpoint: str, rid: str, gen_req: GenerateRequest, include_usage: bool,
                      started_s: float) -> AsyncIterator[bytes]:
        created = now_s()
        tags = {"model": self.model_name, "endpoint": endpoint}
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

        def chunk(text_or_delta: Any, finish: str | None) -> dict[str, Any]:
            body = (chat_chunk(rid, self.model_name, created, text_or_delta, finish) if endpoint == "chat"
                    else completion_chunk(rid, self.model_name, created, text_or_delta, finish))
            if include_usage:
                body["usage"] = None  # OpenAI: null on every chunk but the last
            return body

        if endpoint == "chat":
            yield _sse(chunk({"role": "assistant", "content": ""}, None))
        last, first_token_s, prev_s, prev_tokens = None, None, None, 0
        status = 200
        try:
            async for delta in self._stream_deltas(gen_req):
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
                if delta.text or delta.finish_reason:
                    body = {"content": delta.text} if endpoint == "chat" else delta.text
                    if endpoint == "chat" and delta.finish_reason and not delta.text:
                        body = {}
                    yield _sse(chunk(body, delta.finish_reason))
        except asyncio.CancelledError:
            # Client went away: the cancellation propagates to the engine call (abort).
            self.metrics.on_request_done(self.model_name, endpoint, 499)
            raise
        except Exception as exc:
            logger.warning("stream %s failed in the engine: %s", rid, type(exc).__name__)
            status = 503
            yield _sse(error_body("the engine failed while generating; retry the request", "server_error",
                                  code="engine_unavailable"))
            yield _sse("[DONE]")
            self.metrics.on_request_done(self.model_name, endpoint, status)
            return
        usage = Usage(len(gen_req.prompt_token_ids), last.num_output_tokens if last else 0,
                      last.num_cached_tokens if last else 0)
        if include_usage:
            yield _sse(usage_chunk(rid, self.model_name, created, obj, usage))
        yield _sse("[DONE]")
        self._observe(tags, started_s, first_token_s, usage, status)

    def _observe(self, tags: dict[str, str], started_s: float, first_token_s: float | None, usage: Usage,
                 status: int) -> None:
        if first_token_s is not None:
            self.metrics.ttft_s.observe(first_token_s - started_s, tags)
        self.metrics.e2e_s.observe(time.perf_counter() - started_s, tags)
        self.metrics.output_tokens.inc(usage.completion_tokens, tags)
        self.metrics.on_request_done(tags["model"], tags["endpoint"], status)

    async def _handle(self, request: Request, endpoint: str) -> Any:
        try:
            data = await self._read_json(request)
            if endpoint == "chat":
                req = self._parse(data, ChatCompletionRequest)
                prompt_ids = self._chat_tokens(req)
                max_tokens = self._budget(prompt_ids, req.max_output_tokens, None)
            else:
                req = self._parse(data, CompletionRequest)
                prompt_ids = self._completion_tokens(req)
                max_tokens = self._budget(prompt_ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
        except ApiError as err:
            self.metrics.on_request_done(self.model_name, endpoint, err.status)
            return _error_response(err)
        return await self._run(endpoint, req, prompt_ids, max_tokens)

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
    async def models(self) -> dict[str, Any]:
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
