"""vLLM's own chat renderer in the routing peer: the prompt vLLM's layer would build, built once.

A chat request that vLLM's layer answers (tools, response_format, logprobs, ...) is rendered
twice without this: by the routing peer, to hash its blocks for routing, and by vLLM's layer on
the replica, to run it. vLLM lets a caller hand it the prompt's token ids instead
(`kv_transfer_params["prompt_token_ids"]`, its decode-side token reuse: vLLM then skips the chat
template and the tokenizer, and still validates the ids and runs the request's other checks),
but only ids that are exactly what it would have rendered are safe to hand over: a prompt that
differs by one token is a different request. So the peer renders such a chat with vLLM's own
`OnlineRenderer`, built the way vLLM's GPU-less render server builds it
(`vllm.entrypoints.launchers.render`; engine.vllm_openai.build_chat_renderer) from the replica's
engine arguments and vLLM server arguments: the same template, content
format, tool handling and tokenizer. The ids route the request (its block hashes are the
engine's exactly) and travel to the replica in the signed routed-tokens header; the replica puts
them in the body it hands to vLLM's layer (`with_prompt_token_ids`).

What stays rendered twice: Messages and Responses bodies (vLLM converts them inside its layer;
the peer routes on its own rendering of them, api_bodies.py), batches of chats, chats with
non-text content or `echo` (vLLM renders those itself even when ids are given), and any chat
while the renderer is still being built (importing vLLM takes seconds; the peer serves meanwhile).

Threads: the peer renders on its tokenize threads (prompt_pool.py). vLLM's renderer is written
for an event loop (its tokenizer runs in its own executor), so each thread drives it on an event
loop of its own; the renderer keeps no loop-bound state between calls.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

from kvtide.deployments.logs import replica_logger

logger = replica_logger("vllm_render")

KV_TRANSFER_PARAMS = "kv_transfer_params"
PROMPT_TOKEN_IDS = "prompt_token_ids"


def eligible_chat(data: Any) -> bool:
    """A chat body vLLM's layer would run on handed-over ids: one conversation of messages without
    non-text content, no `echo`, and no kv_transfer_params of the client's own (vLLM's to honour)."""
    if not isinstance(data, dict) or data.get(KV_TRANSFER_PARAMS) is not None or data.get("echo"):
        return False
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return False
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(not isinstance(part, dict) or part.get("type") != "text"
                                             for part in content):
            return False
    return True


def with_prompt_token_ids(data: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
    """`data` with the prompt's token ids handed to vLLM (kv_transfer_params.prompt_token_ids)."""
    return {**data, KV_TRANSFER_PARAMS: {PROMPT_TOKEN_IDS: list(token_ids)}}


class VllmChatRender:
    """vLLM's OnlineRenderer for one served model (built by engine.vllm_openai.build_chat_renderer, as vLLM's
    render server builds it) and the request model it renders."""

    def __init__(self, online_renderer: Any, request_cls: Any):
        self.online_renderer = online_renderer
        self.request_cls = request_cls
        self._local = threading.local()

    def prompt_ids(self, data: Any) -> list[int] | None:
        """The token ids vLLM's layer would run for chat body `data`; None where it is not eligible
        (eligible_chat) or vLLM would refuse it (the replica's vLLM answers that itself)."""
        if not eligible_chat(data):
            return None
        loop = getattr(self._local, "loop", None)
        if loop is None:
            loop = self._local.loop = asyncio.new_event_loop()
        try:
            request = self.request_cls.model_validate(data)
            rendered = loop.run_until_complete(self.online_renderer.render_chat(request))
        except Exception:
            return None
        if not isinstance(rendered, tuple):  # an ErrorResponse
            return None
        _, engine_inputs = rendered
        if len(engine_inputs) != 1:
            return None
        ids = engine_inputs[0].get(PROMPT_TOKEN_IDS) if isinstance(engine_inputs[0], dict) else None
        return list(ids) if ids else None


class RenderSlot:
    """Where the peer's builders find vLLM's renderer: empty until a background thread has built it."""

    def __init__(self) -> None:
        self.render: VllmChatRender | None = None

    def prompt_ids(self, data: Any) -> list[int] | None:
        render = self.render
        return None if render is None else render.prompt_ids(data)

    def start(self, build: Callable[[], tuple[Any, Any]]) -> threading.Thread:
        """Build the renderer on a daemon thread (`build`: (online renderer, request model)); a failure is
        logged and leaves the slot empty (the peer renders with its own path, the replica's vLLM renders again)."""
        def run() -> None:
            started = time.monotonic()
            try:
                self.render = VllmChatRender(*build())
                logger.info("vLLM's chat renderer ready in %.1f s: vLLM-layer chats reach the replica rendered",
                            time.monotonic() - started)
            except Exception as exc:
                logger.warning("vLLM's chat renderer could not be built (%s: %s); the replica renders such chats",
                               type(exc).__name__, exc)

        thread = threading.Thread(target=run, name="kvtide-vllm-render", daemon=True)
        thread.start()
        return thread
