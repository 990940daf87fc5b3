"""From an OpenAI request body to prompt token ids: read, validate, apply the chat template, tokenize.

One builder serves every place a prompt is tokenized, so they always agree on the tokens
(and therefore on the KV block hashes the router matches against the engines' caches):
the OpenAI frontend (an ingress replica, or an engine replica serving HTTP directly) and
the direct-mode routing peer, which tokenizes only to hash blocks.

    read_json (413, 400) → parse (400 per field, 404 model) → tokens (400: too many
    messages or characters, template errors, token ids out of vocabulary) → budget (400:
    prompt + max_tokens over the context)

Every refusal is an `ApiError` naming the field; nothing here talks to an engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvtide.config import KvtideConfig
from kvtide.deployments.admission import max_prompt_chars
from kvtide.deployments.protocol import ApiError, ChatCompletionRequest, CompletionRequest, validation_error_to_api

# Completions default to 16 output tokens, as OpenAI's legacy endpoint does.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# A JSON escape of a UTF-16 surrogate; only then can a parsed body hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class Prompt:
    """A validated request and what the engine needs from it."""

    request: CompletionRequest | ChatCompletionRequest
    token_ids: list[int]
    max_tokens: int


def parse_json_body(body: bytes) -> Any:
    """The body as JSON; 400 for anything else (including a lone UTF-16 surrogate)."""
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


def load_tokenizer(config: KvtideConfig) -> Any:
    """The served model's tokenizer (the same files vLLM loads, so the token ids agree)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model)


class PromptBuilder:
    """Validates and tokenizes requests for one served model (the tokenizer is injected)."""

    def __init__(self, config: KvtideConfig, tokenizer: Any):
        self.tokenizer = tokenizer
        self.model_name = config.model_name
        self.max_model_len = config.engine.max_model_len
        self.max_body_bytes = config.ingress.max_body_bytes
        self.max_messages = config.ingress.max_messages
        self.max_prompt_chars = max_prompt_chars(config)
        self.vocab_size = len(tokenizer)

    async def read_body(self, request: Any) -> bytes:
        """The raw body of a Starlette request, refused (413) past ingress.max_body_bytes."""
        declared = request.headers.get("content-length")
        limit = self.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        return bytes(body)

    def build(self, endpoint: str, data: Any) -> Prompt:
        """Validate a parsed body for `endpoint` ("completions" or "chat") and tokenize its prompt."""
        if endpoint == "chat":
            req = self._parse(data, ChatCompletionRequest)
            token_ids = self.chat_tokens(req)
            return Prompt(req, token_ids, self._budget(token_ids, req.max_output_tokens, None))
        req = self._parse(data, CompletionRequest)
        token_ids = self.completion_tokens(req)
        return Prompt(req, token_ids, self._budget(token_ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS))

    def routing_tokens(self, body: bytes) -> list[int]:
        """Best-effort prompt tokens of a raw body, for routing only: [] when it is not a valid request.

        The replica that serves the request validates it again and answers any error itself.
        """
        try:
            data = parse_json_body(body)
            endpoint = "chat" if isinstance(data, dict) and "messages" in data else "completions"
            return self.build(endpoint, data).token_ids
        except ApiError:
            return []

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

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        # Tokenizing runs on the event loop: a huge prompt is refused before it can stall it.
        if num_chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {num_chars} characters; the limit is {self.max_prompt_chars} "
                                "(ingress.max_prompt_chars)", param=param, code="prompt_too_long")

    def completion_tokens(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            self._check_prompt_chars(len(req.prompt), "prompt")
            return self.tokenizer.encode(req.prompt, add_special_tokens=True)
        bad = [t for t in req.prompt if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range; the vocabulary has {self.vocab_size} tokens",
                           param="prompt", code="invalid_value")
        return list(req.prompt)

    def chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        if len(req.messages) > self.max_messages:
            raise ApiError(400, f"the request has {len(req.messages)} messages; the limit is {self.max_messages} "
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
