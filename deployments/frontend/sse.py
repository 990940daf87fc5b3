"""Server-sent events in OpenAI's streaming shape: one `data:` line per chunk, `data: [DONE]` last.

    chat         role chunk → content chunks → finish chunk → [usage chunk] → [DONE]
    completions  text chunks (the last carries finish_reason) → [usage chunk] → [DONE]
    failure      after the first byte a status can no longer change: an error event, then [DONE]

Pure: no engine, no Ray; the frontend feeds it engine deltas.
"""

from __future__ import annotations

import json
from typing import Any

from kvtide.deployments.messages import GenerateDelta
from kvtide.deployments.frontend.protocol import Usage, chat_chunk, completion_chunk, error_body, usage_chunk

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def error_event(message: str, code: str) -> bytes:
    return sse(error_body(message, "server_error", code=code))


class ChunkRenderer:
    """The events of one streamed response (its id, model and creation time fixed)."""

    def __init__(self, endpoint: str, request_id: str, model_name: str, created_s: int, include_usage: bool,
                 return_token_ids: bool = False, system_fingerprint: str | None = None):
        self.endpoint = endpoint
        self.request_id = request_id
        self.model_name = model_name
        self.created_s = created_s
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.system_fingerprint = system_fingerprint  # on the finishing chunk, as vLLM's server sends it

    def _chunk(self, body: Any, finish: str | None, token_ids: list[int] | None = None,
               stop_reason: int | str | None = None) -> dict[str, Any]:
        if self.endpoint == "chat":
            chunk = chat_chunk(self.request_id, self.model_name, self.created_s, body, finish, token_ids, stop_reason)
        else:
            chunk = completion_chunk(self.request_id, self.model_name, self.created_s, body, finish, token_ids,
                                     stop_reason)
        if finish is not None and self.system_fingerprint is not None:
            chunk["system_fingerprint"] = self.system_fingerprint
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def opening(self) -> bytes | None:
        """Chat streams open with the assistant's role; completions have no opening event."""
        if self.endpoint != "chat":
            return None
        return sse(self._chunk({"role": "assistant", "content": ""}, None))

    def delta(self, delta: GenerateDelta) -> bytes | None:
        """The event of one engine delta, or None when it carries no token, no text and no finish.

        A delta whose tokens decoded to no text yet (part of a multi-byte character) is still
        sent, with empty text, as vLLM's server sends it: a client sees each engine step when it
        happens, and its time to first token is the first token's, not the first character's.
        """
        if not (delta.text or delta.finish_reason or delta.token_ids):
            return None
        token_ids = list(delta.token_ids) if self.return_token_ids else None
        if self.endpoint == "chat":
            body: Any = {"content": delta.text} if delta.text or delta.token_ids else {}
        else:
            body = delta.text
        return sse(self._chunk(body, delta.finish_reason, token_ids, delta.stop_reason))

    def closing(self, usage: Usage) -> bytes:
        """The usage chunk (when asked for) and [DONE]."""
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        if not self.include_usage:
            return DONE
        chunk = usage_chunk(self.request_id, self.model_name, self.created_s, obj, usage)
        if self.system_fingerprint is not None:
            chunk["system_fingerprint"] = self.system_fingerprint
        return sse(chunk) + DONE
