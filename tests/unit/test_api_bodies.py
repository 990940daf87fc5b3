"""Which API a body is for, and the prompt it routes on: Messages and Responses bodies become the chat vLLM
renders for them, tokens-in bodies the ids vLLM runs; pinned to vLLM's own converters."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvtide.config import parse_config
from kvtide.deployments.frontend.api_bodies import body_endpoint, chat_tools, messages_view, responses_view
from kvtide.deployments.frontend.prompts import PromptBuilder

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
SYSTEM = "You are a careful assistant. " * 20

MESSAGES_BODIES = [
    {"system": SYSTEM, "messages": [{"role": "user", "content": "hi"}]},
    {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"}, {"type": "text", "text": SYSTEM},
                {"type": "text", "text": "Second part."}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "one block"}]},
                  {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "again"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]},
                  {"role": "assistant", "content": []}, {"role": "user", "content": "after empties"}]},
    {"system": SYSTEM, "messages": [{"role": "user", "content": "weather?"}],
     "tools": [{"name": "get_weather", "description": "Weather now", "input_schema": SCHEMA},
               {"name": "no_type", "input_schema": {"properties": {}}, "strict": True}]},
    {"system": SYSTEM, "messages": [  # stops before the tool call: a prefix of vLLM's messages
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
     "tools": [{"name": "get_weather", "input_schema": SCHEMA}]},
    {"system": SYSTEM, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]},
]

RESPONSES_BODIES = [
    {"input": "hello"},
    {"instructions": SYSTEM, "input": "hello"},
    {"instructions": SYSTEM, "input": [{"role": "user", "content": "first"}, {"role": "system", "content": "s"},
                                       {"type": "message", "role": "user", "content": "second"}]},
    {"instructions": SYSTEM, "input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                       {"role": "user", "content": "q2"}]},
    {"instructions": SYSTEM, "input": [{"role": "user", "content": [{"type": "input_text", "text": "parts"}]}]},
    {"instructions": SYSTEM, "input": "weather?",
     "tools": [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": SCHEMA},
               {"type": "function", "name": "strict_one", "parameters": SCHEMA, "strict": True}]},
]


def _vllm_messages_view(body):
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    chat = AnthropicServingMessages.to_chat_completion_request(
        AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body}))
    return chat.messages, None if chat.tools is None else [tool.model_dump() for tool in chat.tools]


def _vllm_responses_view(body):
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    request = ResponsesRequest.model_validate({"model": "m", **body})
    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    return [{k: v for k, v in dict(m).items() if k != "type"} for m in messages], construct_tool_dicts(
        request.tools, request.tool_choice)


def _assert_as_vllm(view, theirs):
    """A complete view is vLLM's messages and tools; a partial one a leading run of its messages, same tools."""
    messages, tools = theirs
    assert view.tools == tools
    if view.complete:
        assert view.messages == messages
    else:
        assert view.messages == messages[:len(view.messages)] and len(view.messages) < len(messages)


@pytest.mark.parametrize("body", MESSAGES_BODIES)
def test_a_messages_body_converts_as_vllm_converts_it(body):
    """System (blocks joined, billing header dropped), text turns and tools as vLLM's Anthropic converter makes
    them; from a tool call or a content-part list on, nothing (the view is a prefix)."""
    assert body_endpoint({"model": "m", **body}) in ("messages", "chat")
    _assert_as_vllm(messages_view(body), _vllm_messages_view(body))


@pytest.mark.parametrize("body", RESPONSES_BODIES)
def test_a_responses_body_converts_as_vllm_converts_it(body):
    """instructions as the system message, string input items as turns, function tools in the chat format, as
    vLLM builds them; from an assistant turn or content parts on, nothing."""
    assert body_endpoint({"model": "m", **body}) == "responses"
    _assert_as_vllm(responses_view(body), _vllm_responses_view(body))


def test_chat_tools_are_dumped_as_vllm_dumps_them_for_the_template():
    """A chat body's tools: description and parameters always present, strict only when set (vLLM's model_dump)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    tools = [{"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g", "parameters": SCHEMA, "strict": True}},
             {"type": "function", "function": {"name": "h", "description": "d"}, "defer_loading": True}]
    assert chat_tools(tools) == [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]


@pytest.mark.parametrize(("body", "endpoint"), [
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat"),
    ({"model": "m", "max_tokens": 4, "system": "s", "messages": []}, "messages"),
    ({"model": "m", "messages": [], "tools": [{"name": "f", "input_schema": {}}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"model": "m", "input": "hi"}, "responses"),
    ({"model": "m", "prompt": "hi"}, "completions"),
    ({"model": "m", "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]},
     "chat_batch"),
    ({"model": "m", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}, "generate"),
    ({"model": "m", "query": "q", "items": ["a"], "label_token_ids": [1]}, "generative_scoring"),
    ({"model": "m", "state": "s", "questions": {}}, "completions"),  # no prompt to route on: load alone
    ("junk", "completions"),
])
def test_the_endpoint_is_read_from_the_bodys_shape(body, endpoint):
    """The routing peer gets no path: Anthropic-only fields or blocks mean Messages, an input Responses, a list of
    conversations a batch of chats, token ids with sampling params vLLM's tokens-in API, a query and items scoring."""
    assert body_endpoint(body) == endpoint


@pytest.fixture(scope="module")
def prompts(demo_tokenizer):
    return PromptBuilder(parse_config({"model": "/m", "served_model_name": "m", "engine": {"max_model_len": 4096}}),
                         demo_tokenizer)


def _routed(prompts, body):
    prompt = prompts.routing_prompt(json.dumps({"model": "m", **body}).encode())
    return None if prompt is None else prompt.token_ids


def test_a_messages_or_responses_body_routes_on_the_prompt_of_its_chat(prompts):
    """With the demo chat template: a Messages body's system and a Responses body's instructions route as the same
    chat's system message (the blocks the engine caches); a partial view routes on a prefix of that prompt."""
    chat = _routed(prompts, {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
                             "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert chat and _routed(prompts, {"max_tokens": 4, "system": SYSTEM,
                                      "messages": [{"role": "user", "content": "hi"}]}) == chat
    assert _routed(prompts, {"instructions": SYSTEM, "input": "hi"}) == chat
    system_only = _routed(prompts, {"instructions": SYSTEM, "input": [{"role": "assistant", "content": "a"}]})
    assert system_only and chat[:len(system_only)] == system_only and len(system_only) < len(chat)


def test_a_body_with_nothing_to_render_routes_by_load(prompts):
    """No instructions and no convertible first turn, or tools vLLM would filter: None (load and session)."""
    assert _routed(prompts, {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}) is None
    assert _routed(prompts, {"input": "hi", "tools": [{"type": "web_search"}]}) is None
    assert _routed(prompts, {"max_tokens": 4, "system": 5, "messages": [{"role": "user", "content": "hi"}]}) is None


def test_a_batch_of_chats_routes_on_its_first_conversation(prompts):
    """vLLM renders each conversation of /v1/chat/completions/batch as a chat: the batch routes as its first one."""
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    chat = _routed(prompts, {"messages": first})
    assert chat and _routed(prompts, {"messages": [first, [{"role": "user", "content": "other"}]]}) == chat


def test_a_tokens_in_body_routes_on_the_token_ids_the_engine_runs(prompts):
    """/inference/v1/generate: the ids as sent; ids outside the vocabulary (vLLM's 400) route by load."""
    ids = list(range(5, 300))
    assert _routed(prompts, {"token_ids": ids, "sampling_params": {"max_tokens": 4}}) == ids
    assert _routed(prompts, {"token_ids": [1, 10 ** 9], "sampling_params": {}}) is None
    assert _routed(prompts, {"token_ids": "text", "sampling_params": {}}) is None


@pytest.mark.parametrize("shape", [
    {"query": SYSTEM, "items": [" yes", " no"]},
    {"query": SYSTEM, "items": [" yes"], "add_special_tokens": False},
    {"query": SYSTEM, "items": [" yes"], "item_first": True},
    {"query": [5, 6, 7], "items": [[8, 9], [10]]},
])
def test_a_generative_scoring_body_routes_on_its_first_items_engine_prompt(prompts, demo_tokenizer, shape):
    """/generative_scoring: the query and first item as vLLM's scorer concatenates them for the engine."""
    from vllm.entrypoints.generate.generative_scoring.serving import (GenerativeScoringRequest,
                                                                       ServingGenerativeScoring)

    request = GenerativeScoringRequest.model_validate({"label_token_ids": [1], **shape})
    inputs, _ = asyncio.run(ServingGenerativeScoring._build_prompts(None, request, demo_tokenizer, 4096))
    assert _routed(prompts, {"label_token_ids": [1], **shape}) == inputs[0]["prompt_token_ids"]
