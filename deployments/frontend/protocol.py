"""The OpenAI wire format kvtide speaks: request schemas, error bodies, response chunks.

Pure data (pydantic + dicts), no Ray, so the frontend stays small and this is unit-tested.
Requests are strict about types and ranges (a bad field is a 400 naming it) but accept
unknown fields, as OpenAI and vLLM do, so SDK upgrades that send new optional keys keep
working; a field vLLM's server would act on and kvtide does not is refused (unsupported.py).
Strict means pydantic's strict mode: no coercion, so "stream": "false" or "max_tokens":
"8" or true is a 400 rather than a guess. Integers sent to the engine are bounded to what
vLLM and torch accept (a seed beyond int64 would fail inside the engine, as a 5xx).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtide.deployments.tenancy import CACHE_SALT_FORBIDDEN_CHARS, MAX_CACHE_SALT_CHARS


class ApiError(Exception):
    """A client-visible error: HTTP status + OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, param=self.param, code=self.code)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, err_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# Known fields are type-strict; unknown ones are accepted and ignored (see the docstring).
REQUEST_MODEL = ConfigDict(extra="allow", strict=True)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Output tokens one request may ask for, whatever the context: keeps arithmetic and
# vLLM's SamplingParams in range; the context-length check refuses anything too long first.
MAX_TOKENS_LIMIT = 2**31 - 1
# Most choices one request may ask for (n): each is a sequence in the engine's batch, so a
# larger n is one client taking the whole engine (vLLM itself sets no bound).
MAX_CHOICES = 128


class StreamOptions(BaseModel):
    model_config = REQUEST_MODEL
    include_usage: bool = False
    # vLLM's extension (usage in every chunk): declared so that asking for it is a 400, not ignored.
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous_usage(cls, value: bool) -> bool:
        if value:
            raise ValueError("continuous usage stats are not supported by this server (kvtide) yet")
        return value


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = REQUEST_MODEL

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    # n > 1 is answered by vLLM's layer (frontend/vllm_layer.py), up to MAX_CHOICES; kvtide's own path
    # sees n = 1 or a value no server should take.
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    user: str | None = None
    # vLLM's extension, honoured as bare vLLM does: keep generating past the EOS token.
    # Load generators need it so every request costs exactly max_tokens.
    ignore_eos: bool = False
    # vLLM's extension: prefix-cache isolation. Requests share cached KV blocks (and the
    # router matches them) only with requests of the same salt; typically one per tenant.
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's extension: each choice (and each stream chunk) carries its output token ids, and a
    # stream sends a chunk for every engine step that produced tokens, text or not. Clients that
    # time tokens need it: a token can decode to no text yet (part of a multi-byte character).
    return_token_ids: bool = False
    # Sampling controls vLLM's server passes to its SamplingParams; bounded as vLLM checks them,
    # so a bad value is a 400 here rather than an error inside the engine.
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # -1 and 0: no top-k
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt_as_vllm_takes_it(cls, value: str | None) -> str | None:
        if value is not None and CACHE_SALT_FORBIDDEN_CHARS & set(value):
            raise ValueError("must not contain '@', '/', '\\' or NUL (vLLM's rule for a cache salt)")
        return value

    @field_validator("n")
    @classmethod
    def _choices_in_range(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be an integer from 1 to {MAX_CHOICES}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _usage_needs_stream(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    # A string, or token ids. Batches of prompts are rejected (n=1 semantics).
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported; send a batch as separate requests")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise ValueError("token ids must be non-negative")
        return prompt


class TextPart(BaseModel):
    model_config = REQUEST_MODEL
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = REQUEST_MODEL
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)

    @property
    def max_output_tokens(self) -> int | None:
        # max_completion_tokens is the current name; max_tokens is deprecated but common.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def now_s() -> int:
    return int(time.time())


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     token_ids: list[int] | None = None, stop_reason: int | str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None,
               token_ids: list[int] | None = None, stop_reason: int | str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:  # vLLM's server says what stopped it on the finishing chunk
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: Usage) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage.as_dict()}


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                        usage: Usage, token_ids: list[int] | None = None, stop_reason: int | str | None = None,
                        system_fingerprint: str | None = None) -> dict[str, Any]:
    body = completion_chunk(rid, model, created, text, finish_reason, token_ids, stop_reason)
    body["usage"] = usage.as_dict()
    body["system_fingerprint"] = system_fingerprint
    return body


def chat_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                  usage: Usage, token_ids: list[int] | None = None, stop_reason: int | str | None = None,
                  system_fingerprint: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                              "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage.as_dict(), "system_fingerprint": system_fingerprint}


def validation_error_to_api(errors: list[dict[str, Any]]) -> ApiError:
    """First pydantic/FastAPI validation error → 400 naming the field, as OpenAI does."""
    if not errors:
        return ApiError(400, "invalid request")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Drop pydantic's union-branch markers ('str', 'list[int]', 'function-after[...]').
    loc = [p for p in loc if not (p in {"str", "int", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]"}
                                  or p.startswith("function-"))]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}",
                        code="invalid_json")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        return ApiError(400, f"missing required field '{param}'", param=param, code="missing_field")
    where = f"'{param}'" if param else "request body"
    return ApiError(400, f"invalid value for {where}: {msg}", param=param, code="invalid_value")
