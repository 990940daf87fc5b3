"""Which API a body is for, and Anthropic Messages and OpenAI Responses bodies as the chat vLLM
renders for them, for routing.

vLLM's layer answers `/v1/messages` by converting the Anthropic body to a chat request
(`AnthropicServingMessages.to_chat_completion_request`) and `/v1/responses` by building chat
messages from `instructions` and `input` (`construct_input_messages`) with its function tools
in the chat format (`construct_tool_dicts`); either is then rendered with the model's chat
template. The routing peer renders the same messages and tools, so that a long shared system
prompt, `instructions` or tool list routes to the replica that holds its KV blocks.

Pure Python on purpose: importing vLLM's converters costs a routing peer ~5 s and ~500 MB
(vLLM pulls in torch). tests/unit/test_api_bodies.py pins these conversions to vLLM's own.

Only a leading run of messages is converted, up to the first one whose rendering here could
differ from vLLM's (content parts, images, tool calls and results, reasoning, an inline system
message): the view is then `complete=False` and is rendered without the generation prompt,
a prefix of what vLLM renders, which is all routing needs. Every conversion is best effort:
None where the body is not one vLLM would render this way (vLLM answers it itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Claude Code's per-request attribution block: vLLM drops it from the system prompt (it would
# defeat prefix caching), so routing must drop it too.
_BILLING_HEADER = "x-anthropic-billing-header"
# Content blocks only the Anthropic API has: a body with one is a Messages request.
_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "image", "document", "thinking", "redacted_thinking",
                               "tool_reference"})
_TOOL_CHANGES = frozenset({"tool_addition", "tool_removal"})
_INVALID = object()  # a `system` shape vLLM refuses


@dataclass(frozen=True)
class ChatView:
    """The chat messages and tool dicts vLLM renders for a body; `complete`: all of its messages."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    complete: bool


def body_endpoint(data: Any) -> str:
    """Which endpoint a body is for, read from its shape (the peer gets no path): "generate" (vLLM's
    tokens-in API: `token_ids` and `sampling_params`), "generative_scoring" (`query` and `items`),
    "responses" (an `input`, no `messages` or `prompt`), "chat_batch" (`messages` a list of
    conversations), "messages" (Anthropic-only fields or blocks), "chat" or "completions". A
    Messages body with none of those renders as the same chat (string contents)."""
    if not isinstance(data, dict):
        return "completions"
    if "messages" not in data:
        if "token_ids" in data and "sampling_params" in data:
            return "generate"
        if "query" in data and "items" in data:
            return "generative_scoring"
        return "responses" if "input" in data and "prompt" not in data else "completions"
    messages = data["messages"]
    if isinstance(messages, list) and messages and isinstance(messages[0], list):
        return "chat_batch"
    return "messages" if _anthropic_shaped(data) else "chat"


def _anthropic_shaped(data: dict[str, Any]) -> bool:
    if "system" in data or "stop_sequences" in data:
        return True
    tools = data.get("tools")
    if isinstance(tools, list) and any(isinstance(t, dict) and "input_schema" in t for t in tools):
        return True
    return _has_block(data.get("messages"), _ANTHROPIC_BLOCKS)


def _has_block(messages: Any, types: frozenset[str]) -> bool:
    """Whether any message's content-block list holds a block of one of `types`."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(b, dict) and b.get("type") in types for b in m["content"])
        for m in messages)


def chat_view(endpoint: str, data: dict[str, Any]) -> ChatView | None:
    """The messages and tools vLLM renders for a "chat", "chat_batch", "messages" or "responses" body
    (a batch: its first conversation, which is all one replica serves and routing needs)."""
    if endpoint == "messages":
        return messages_view(data)
    if endpoint == "responses":
        return responses_view(data)
    messages = data["messages"][0] if endpoint == "chat_batch" else data["messages"]
    return ChatView(messages, chat_tools(data.get("tools")), True)


def tool_dict(function: dict[str, Any], defer_loading: Any = None) -> dict[str, Any]:
    """A tool as vLLM's ChatCompletionToolsParam dumps it for the chat template: name, description and
    parameters always (None when absent), strict and defer_loading only when set."""
    out: dict[str, Any] = {"name": function["name"], "description": function.get("description"),
                           "parameters": function.get("parameters")}
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    # The tool's defer_loading is copied into its function unless the function sets its own.
    deferred = function.get("defer_loading") if function.get("defer_loading") is not None else defer_loading
    if deferred is not None:
        out["defer_loading"] = deferred
    tool: dict[str, Any] = {"type": "function", "function": out}
    if defer_loading is not None:
        tool["defer_loading"] = defer_loading
    return tool


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A chat body's tools as vLLM passes them to the template (None: none, or not all function tools)."""
    if not isinstance(tools, list) or not tools:
        return None
    if not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
               and isinstance(t["function"].get("name"), str) for t in tools):
        return None
    return [tool_dict(t["function"], t.get("defer_loading")) for t in tools]


def messages_view(data: dict[str, Any]) -> ChatView | None:
    """An Anthropic Messages body as vLLM's `to_chat_completion_request` converts it."""
    system = _system_text(data.get("system"))
    if system is _INVALID or not isinstance(data.get("messages"), list):
        return None
    converted: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    complete = True
    for message in data["messages"]:
        one = _anthropic_message(message)
        if one is None:
            complete = False
            break
        if one:
            converted.append(one)
    tools = None
    if data.get("tools"):
        if not isinstance(data["tools"], list) or not all(
                isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("input_schema"), dict)
                for t in data["tools"]):
            return None
        if _has_block(data["messages"], _TOOL_CHANGES):
            return None  # vLLM resolves the tools in effect at the conversation's end
        # vLLM's AnthropicTool gives a schema without a type the type "object".
        tools = [tool_dict({"name": t["name"], "description": t.get("description"),
                            "parameters": t["input_schema"] if "type" in t["input_schema"]
                            else {**t["input_schema"], "type": "object"},
                            "strict": t.get("strict"), "defer_loading": t.get("defer_loading")})
                 for t in data["tools"]]
    return ChatView(converted, tools, complete)


def _system_text(system: Any) -> Any:
    """The top-level `system` as vLLM joins it: a string, or its text blocks joined without a separator
    (the billing header dropped); "" for none, _INVALID for a shape vLLM refuses."""
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        return _INVALID
    parts = []
    for block in system:
        if not isinstance(block, dict) or block.get("type") != "text":
            return _INVALID
        text = block.get("text")
        if isinstance(text, str) and text and not text.startswith(_BILLING_HEADER):
            parts.append(text)
    return "".join(parts)


def _anthropic_message(message: Any) -> dict[str, Any] | None:
    """One message as vLLM converts it when that is a plain role and text: {} for one vLLM drops (a user
    message with no text), None where this module stops (anything else)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        return None
    content = message.get("content")
    if isinstance(content, str):
        return {"role": message["role"], "content": content}
    if not isinstance(content, list) or not all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return None
    texts = [b["text"] for b in content if isinstance(b.get("text"), str) and b["text"]]
    if len(texts) > 1:
        return None  # a list of content parts: the template's content format decides how it renders
    if not texts:
        return {} if message["role"] == "user" else {"role": "assistant"}
    return {"role": message["role"], "content": texts[0]}


def responses_view(data: dict[str, Any]) -> ChatView | None:
    """An OpenAI Responses body as vLLM's `construct_input_messages` and `construct_tool_dicts` render it
    (no stored history: kvtide runs vLLM's response store off)."""
    instructions, given = data.get("instructions"), data.get("input")
    if instructions is not None and not isinstance(instructions, str):
        return None
    converted: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    complete = True
    if isinstance(given, str):
        converted.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if not (isinstance(item, dict) and item.get("type", "message") == "message"
                    and item.get("role") in ("user", "system") and isinstance(item.get("content"), str)):
                complete = False  # assistant turns, tool calls and content parts merge or normalize in vLLM
                break
            converted.append({"role": item["role"], "content": item["content"]})
    else:
        return None
    tools = None
    if data.get("tools"):
        if not isinstance(data["tools"], list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
                for t in data["tools"]):
            return None  # built-in and namespace tools: vLLM filters or flattens them
        tools = [tool_dict({k: v for k, v in t.items() if k != "type"}) for t in data["tools"]]
    return ChatView(converted, tools, complete)
