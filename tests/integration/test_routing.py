"""prefix_aware routing on a real cluster: shared prefixes stick to the replica holding their KV blocks.

The session app runs direct mode (the routing peer picks for HAProxy); the last test runs
ingress mode with two ingress replicas, whose routers must agree through the digests.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families
import pytest
from ray import serve
from support import deploy_app, generated_until_aborted, metric_sum, metric_values, wait_for

from kvtide.deployments.routing.response_pins import owner_of

INGRESS_APP = "kvtide-ingress-mode"

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def _prefix(seed: int, num_words: int = 700) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _ask(http, model: str, prefix: str, question: str, cache_salt: str | None = None) -> tuple[str, int]:
    body = {"model": model, "prompt": f"{prefix} {question}?", "max_tokens": 2}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvtide-replica"], resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _idle(metrics_url: str, model: str) -> bool:
    """The engines report nothing running or waiting (a test before may leave requests finishing)."""
    return all(metric_sum(metrics_url, name, model_name=model) == 0
               for name in ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting"))


def test_a_responses_conversation_with_a_session_header_stays_on_one_replica(http, cluster):
    """Responses API turns carrying one x-session-id are served by one replica (the peer routes that body by its
    session: it reads no prompt from it); the header is what holds them there."""
    wait_for(lambda: _idle(cluster.metrics_url, cluster.model_name), timeout_s=120, what="the engines to be idle")
    body = {"model": cluster.model_name, "input": "hello", "max_output_tokens": 2}
    replicas = set()
    for _ in range(3):
        resp = http.post("/v1/responses", json=body, headers={"x-session-id": "conversation-7"})
        assert resp.status_code == 200, resp.text
        replicas.add(resp.headers["x-kvtide-replica"])
    assert len(replicas) == 1, replicas


def test_a_stored_responses_follow_ups_reach_the_replica_that_holds_it(http, cluster):
    """serving.responses_store on a fleet of two: each stored response's id names the replica that made it; turns
    continuing it (previous_response_id) run there, and a GET or cancel of it is answered from its store whichever
    replica HAProxy hands the request (without the pin about half of them would be vLLM's 404)."""
    previous, ids, input_tokens = None, [], []
    for turn in range(5):
        body = {"model": cluster.model_name, "input": f"turn {turn}: go on", "max_output_tokens": 2,
                **({"previous_response_id": previous} if previous else {})}
        resp = http.post("/v1/responses", json=body)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert owner_of(answer["id"]) == resp.headers["x-kvtide-replica"], (answer["id"], resp.headers)
        previous = answer["id"]
        ids.append(previous)
        input_tokens.append(answer["usage"]["input_tokens"])
    assert len({owner_of(i) for i in ids}) == 1, ids  # every turn on the replica holding the conversation
    assert input_tokens == sorted(input_tokens) and input_tokens[-1] > input_tokens[0], input_tokens  # history kept
    receivers = set()
    for i in range(8):  # GETs skip the routing peer: HAProxy alternates them over both (least connections)
        got = http.get(f"/v1/responses/{ids[i % len(ids)]}")
        assert got.status_code == 200 and got.json()["id"] == ids[i % len(ids)], got.text
        receivers.add(got.headers["x-kvtide-replica"])
    assert len(receivers) == 2, receivers  # so the other replica's GETs were answered from the owner's store
    for response_id in ids[:2]:  # found (a finished response cannot be cancelled), not vLLM's 404
        cancel = http.post(f"/v1/responses/{response_id}/cancel")
        assert cancel.status_code == 400 and "synchronous" in cancel.json()["error"]["message"], cancel.text


def _ask_agent(http, model: str, api: str, system: str, question: str) -> tuple[str, int]:
    """One turn through the Anthropic Messages or OpenAI Responses API, or vLLM's tokens-in API (the chat rendered by
    /v1/chat/completions/render, then run by /inference/v1/generate), with `system` as its system prompt:
    (serving replica, prompt tokens the engine found cached)."""
    if api == "generate":
        rendered = http.post("/v1/chat/completions/render", json={"model": model, "max_tokens": 2,
                                                                  **_chat_with_system(system, question)})
        assert rendered.status_code == 200, rendered.text
        resp = http.post("/inference/v1/generate", json=rendered.json())
        assert resp.status_code == 200, resp.text
        return resp.headers["x-kvtide-replica"], resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    if api == "messages":
        resp = http.post("/v1/messages", json={"model": model, "max_tokens": 2, "system": system,
                                               "messages": [{"role": "user", "content": question}]})
        assert resp.status_code == 200, resp.text
        return resp.headers["x-kvtide-replica"], resp.json()["usage"].get("cache_read_input_tokens") or 0
    resp = http.post("/v1/responses", json={"model": model, "max_output_tokens": 2, "instructions": system,
                                            "input": question})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvtide-replica"], resp.json()["usage"]["input_tokens_details"]["cached_tokens"]


def _chat_with_system(system: str, question: str, **extra) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], **extra}


def test_messages_responses_and_tokens_in_turns_sharing_a_system_prompt_reach_its_cached_blocks(http, cluster):
    """A Messages `system` and a Responses `instructions` route as the system message vLLM renders them to, and a
    tokens-in request on its token ids: with two system prompts cached on different replicas (by chat requests),
    turns of any of these APIs with no session header each land where their system prompt's blocks are."""
    wait_for(lambda: _idle(cluster.metrics_url, cluster.model_name), timeout_s=120, what="the engines to be idle")
    systems = {"A": _prefix(5), "B": _prefix(6)}
    model = cluster.model_name
    # While a long chat with system A runs on one replica, B's first chat is placed on the other (by load).
    with ThreadPoolExecutor(1) as pool:
        long_a = pool.submit(lambda: http.post("/v1/chat/completions", json={
            "model": model, **_chat_with_system(systems["A"], "long?", max_tokens=2000, ignore_eos=True)}))
        wait_for(lambda: metric_sum(cluster.metrics_url, "ray_vllm_num_requests_running") >= 1,
                 timeout_s=60, what="the engines to report system A's long chat running")
        resp = http.post("/v1/chat/completions", json={"model": model, **_chat_with_system(systems["B"], "q?",
                                                                                           max_tokens=2)})
        assert resp.status_code == 200, resp.text
        first = {"B": resp.headers["x-kvtide-replica"]}
        resp = long_a.result()
        assert resp.status_code == 200, resp.text
        first["A"] = resp.headers["x-kvtide-replica"]
    assert first["A"] != first["B"]
    served = []  # (system, api, replica, cached tokens) per turn: a failure names where each one went
    for i in range(2):
        for name, system in systems.items():
            for api in ("responses", "messages", "generate"):
                replica, cached = _ask_agent(http, model, api, system, f"question {i}")
                served.append((name, api, replica, cached))
                assert cached >= 1024, f"a {api} turn prefilled system {name} (~1,800 tokens) cold: {served}"


AGENT_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"word": {"type": "string"}}}}}]


def _agent_turn(http, model: str, api: str, system: str, question: str) -> str:
    """One turn answered by vLLM's layer in the replica (a Messages, Responses, or chat-with-tools request); its replica."""
    if api == "chat_tools":
        resp = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, "tools": AGENT_TOOLS,
                                                       "tool_choice": "none", **_chat_with_system(system, question)})
        assert resp.status_code == 200, resp.text
        return resp.headers["x-kvtide-replica"]
    return _ask_agent(http, model, api, system, question)[0]


def _booked(metrics_url: str) -> dict[str, float]:
    return {"requests": metric_sum(metrics_url, "ray_kvtide_engine_booked_requests_total", path="vllm_layer"),
            "prefill_tokens": metric_sum(metrics_url, "ray_kvtide_engine_booked_prefill_tokens_total",
                                         path="vllm_layer"),
            "exclusive_hits": metric_sum(metrics_url, "ray_kvtide_engine_exclusive_hit_tokens_total",
                                         path="vllm_layer"),
            "true_hits": metric_sum(metrics_url, "ray_kvtide_router_predictions_total", outcome="true_hit")}


def test_agent_requests_answered_by_vllms_layer_are_booked_as_plain_chat_is(http, cluster):
    """Messages, Responses and chat-with-tools turns sharing a new system prompt (vLLM's layer answers each) move
    the engine's books as kvtide's path does: booked requests and pending-prefill tokens by path, the exclusive
    hits of the cache's worth, and the router's predictions checked against the engine (true hits)."""
    wait_for(lambda: _idle(cluster.metrics_url, cluster.model_name), timeout_s=120, what="the engines to be idle")
    before = _booked(cluster.metrics_url)
    system = _prefix(41)  # ~1,800 tokens no replica holds yet
    apis = ["messages", "responses", "chat_tools"] * 2
    replicas = {_agent_turn(http, cluster.model_name, api, system, f"turn {i}") for i, api in enumerate(apis)}
    assert len(replicas) == 1, replicas  # every turn where the system prompt's blocks are

    def moved() -> dict[str, float] | None:
        now = _booked(cluster.metrics_url)
        delta = {key: now[key] - before[key] for key in now}
        return delta if delta["requests"] == len(apis) and delta["exclusive_hits"] > 0 else None

    delta = wait_for(moved, timeout_s=30, interval_s=1.0, what="the vLLM-layer turns in the engine's books")
    # The first turn prefilled the system prompt cold; later ones booked only their uncached tail.
    assert delta["prefill_tokens"] >= 1024, delta
    # Turns after the first were predicted to hit the replica holding the prompt, and did.
    assert delta["true_hits"] >= len(apis) - 1, delta


def test_a_chat_the_peer_rendered_with_vllms_renderer_gets_the_answer_vllm_gives_when_it_renders_itself(http, cluster):
    """serving.peer_renders_chat (on in the session's config): once the peer's vLLM renderer is built, a tools chat
    reaches vLLM's layer with the peer's token ids (the reuse counter moves) and gets, token for token, the greedy
    answer and usage of the same chat that vLLM renders itself (the client's own kv_transfer_params keeps the peer's
    ids out of it: eligible_chat)."""
    body = {"model": cluster.model_name, "max_tokens": 8, "temperature": 0, "tools": AGENT_TOOLS,
            "tool_choice": "none", **_chat_with_system(_prefix(43, 300), "Which word comes first?")}
    counted = lambda: metric_sum(cluster.metrics_url, "ray_kvtide_vllm_prompts_reused_total")  # noqa: E731
    start = counted()

    def handed_over() -> bool:
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return counted() > start

    # Built once, the renderer stays: every eligible chat from here on is handed over.
    wait_for(handed_over, timeout_s=180, interval_s=1.0, what="the peer's vLLM renderer to hand a chat over")
    reused = http.post("/v1/chat/completions", json=body)
    rendered = http.post("/v1/chat/completions", json={**body, "kv_transfer_params": {}})
    assert reused.status_code == rendered.status_code == 200, (reused.text, rendered.text)
    assert reused.json()["choices"] == rendered.json()["choices"]
    assert reused.json()["usage"]["prompt_tokens"] == rendered.json()["usage"]["prompt_tokens"]


def test_the_agentic_workloads_sessions_run_whole_through_all_three_apis_each_on_one_replica(cluster):
    """The benchmark's agentic sessions (benchmarks/agentic.py) against the real fleet: every turn of a chat-with-tools,
    a Messages and a Responses session (tool calls and results resent, or previous_response_id) is answered, and each
    session's follow-ups reach the replica holding its context."""
    import asyncio

    from kvtide.benchmarks.agentic import AgenticParams, build_agentic, run_sessions, turns_report

    wait_for(lambda: _idle(cluster.metrics_url, cluster.model_name), timeout_s=120, what="the engines to be idle")
    tool_sets, sessions = build_agentic(AgenticParams(num_sessions=3, num_tool_sets=1, tool_set_tokens=900,
                                                      tools_per_set=3, min_turns=3, max_turns=3, output_tokens=4),
                                        seed=2)
    results = asyncio.run(run_sessions(cluster.base_url, cluster.model_name, tool_sets, sessions,
                                       max_sessions_in_flight=3, request_timeout_s=120))
    report = turns_report(results)
    assert report["all"] == {**report["all"], "turns": 9, "errors": 0}, [r for r in results if not r.ok]
    assert report["same_replica_share"] == 1.0, [(r.session_id, r.turn, r.replica) for r in results]
    assert all(r.ttft_s is not None for r in results if r.api != "messages"), results


def test_salted_tenants_never_share_cached_blocks_and_each_keeps_its_affinity(http, cluster):
    """cache_salt end to end: the same prompt under another salt (or none) is a cold prefill; each tenant hits its own cache."""
    # Affinity on an idle fleet: the load guard moves a request off a busy holder by design.
    wait_for(lambda: _idle(cluster.metrics_url, cluster.model_name), timeout_s=120, what="the engines to be idle")
    prefix = _prefix(3)
    wait_for(lambda: _ask(http, cluster.model_name, prefix, "warm", cache_salt="tenant-a")[1] > 0,
             timeout_s=30, what="tenant A's prefix to be cached")
    # Tenant A's ~1,800 prompt tokens are cached somewhere; neither B nor an unsalted
    # request may reuse them, wherever the router sends it.
    assert _ask(http, cluster.model_name, prefix, "warm", cache_salt="tenant-b")[1] == 0
    assert _ask(http, cluster.model_name, prefix, "warm")[1] == 0
    served = []  # (salt, replica, cached tokens) per request: a failure names where each one went
    for i in range(3):
        for salt in ("tenant-a", "tenant-b"):
            replica, cached = _ask(http, cluster.model_name, prefix, f"q{i}", cache_salt=salt)
            served.append((salt, replica, cached))
            assert cached >= 1024, f"{salt} request {i} prefilled cold: {served}"


def _ask_model(http, model: str, prefix: str, question: str) -> tuple[str, int]:
    resp = http.post("/v1/completions", json={"model": model, "prompt": f"{prefix} {question}?", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvtide-replica"], resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_lora_adapters_requests_are_routed_to_its_own_cached_blocks(http, cluster):
    """An adapter's prompt is cached apart from the base model's and another adapter's (vLLM keys the adapter into
    its blocks), and every later request for that adapter reaches a replica holding its prefix, counted under
    the adapter's name."""
    prefix = _prefix(4)
    before = metric_sum(cluster.metrics_url, "ray_kvtide_requests_total", model="demo-sql", status="200")
    wait_for(lambda: _ask_model(http, "demo-sql", prefix, "warm")[1] > 0, timeout_s=30,
             what="the adapter's prefix to be cached")
    assert _ask_model(http, "demo-chat", prefix, "warm")[1] == 0
    assert _ask_model(http, cluster.model_name, prefix, "warm")[1] == 0
    served = [_ask_model(http, "demo-sql", prefix, f"q{i}") for i in range(4)]
    assert all(cached >= 1024 for _, cached in served), f"(replica, cached tokens) per request: {served}"
    wait_for(lambda: metric_sum(cluster.metrics_url, "ray_kvtide_requests_total", model="demo-sql",
                                status="200") >= before + 5, timeout_s=60, what="requests counted under the adapter")


def test_groups_with_distinct_prefixes_split_and_keep_affinity(http, cluster):
    """Two prefix groups land on different replicas, then every later request of a group hits a replica holding its prefix."""
    prefixes = {"A": _prefix(1), "B": _prefix(2)}
    hits_before = metric_sum(cluster.metrics_url, "ray_vllm_prefix_cache_hits_total")

    # Placement of new prefixes is by load: while a long request of group A runs on one
    # replica (and the engines have reported it), group B's first request goes elsewhere.
    with ThreadPoolExecutor(1) as pool:
        long_a = pool.submit(lambda: http.post("/v1/completions", json={
            "model": cluster.model_name, "prompt": f"{prefixes['A']} long?", "max_tokens": 2000, "ignore_eos": True}))
        wait_for(lambda: metric_sum(cluster.metrics_url, "ray_vllm_num_requests_running") >= 1,
                 timeout_s=60, what="the engines to report group A's long request running")
        first = {"B": _ask(http, cluster.model_name, prefixes["B"], "q0")[0]}
        resp = long_a.result()
        assert resp.status_code == 200, resp.text
        first["A"] = resp.headers["x-kvtide-replica"]
    assert first["A"] != first["B"]

    # The router learns placement from its own picks and the engines' digests (~1 s period).
    # A probe routed before it heard of the prefix may prefill it on the other replica too;
    # from then on either holder is a correct, cache-hitting choice.
    wait_for(lambda: all(_ask(http, cluster.model_name, prefixes[g], "probe")[1] > 0 for g in prefixes),
             timeout_s=30, what="both groups to hit the prefix cache")
    for i in range(1, 6):
        for group, prefix in prefixes.items():
            _, cached = _ask(http, cluster.model_name, prefix, f"q{i}")
            # Every request lands where its ~1,800-token prefix is cached: never a cold prefill.
            assert cached >= 1024, f"group {group} request {i} prefilled cold ({cached} cached tokens)"

    wait_for(lambda: metric_sum(cluster.metrics_url, "ray_vllm_prefix_cache_hits_total") >= hits_before + 10 * 1024,
             timeout_s=60, what="engine prefix-cache hits to rise")


@pytest.fixture(scope="module")
def ingress_mode_app(cluster, cluster_config):
    # One engine behind two ingress replicas: two routers, one cache to agree on.
    deploy_app(cluster_config, INGRESS_APP, ["http.mode=ingress", "frontend.num_replicas=2",
                                             "replicas.num_replicas=1", "serving.enable_scale_out=true",
                                             "serving.responses_store=true"])
    try:
        yield cluster.base_url + f"/{INGRESS_APP}"
    finally:
        serve.delete(INGRESS_APP)


def _cache_hits_by_router(metrics_url: str) -> dict[str, float]:
    """cache_hit decisions per router process (Ray's WorkerId label), from one scrape."""
    hits: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=30).text):
        for sample in family.samples:
            if sample.name == "ray_kvtide_router_decisions_total" and sample.labels.get("outcome") == "cache_hit":
                worker = sample.labels.get("WorkerId", "")
                hits[worker] = hits.get(worker, 0.0) + sample.value
    return hits


def test_ingress_mode_serves_and_both_routers_make_cache_hit_decisions(ingress_mode_app, cluster):
    """Ingress mode answers OpenAI requests, and each ingress replica's own router routes by cache affinity."""
    before = _cache_hits_by_router(cluster.metrics_url)  # routers of other apps (the session's peer) stay flat meanwhile
    prefix = _prefix(3)
    with httpx.Client(base_url=ingress_mode_app, timeout=120) as http:
        _ask(http, INGRESS_APP, prefix, "warm")
        cached = [_ask(http, INGRESS_APP, prefix, f"again {i}")[1] for i in range(12)]
    # One engine: every request after the first reuses its ~1,800-token prefix, whichever ingress took it.
    assert min(cached) >= 1024, f"cached prompt tokens per request: {cached}"

    def routers_with_new_hits() -> set[str]:
        grew = {w for w, n in _cache_hits_by_router(cluster.metrics_url).items() if n > before.get(w, 0.0)}
        return grew if len(grew) >= 2 else set()

    wait_for(routers_with_new_hits, timeout_s=60, what="cache_hit decisions from two routers")
    assert metric_values(cluster.metrics_url, "ray_kvtide_router_decision_latency_seconds_count")


def test_ingress_mode_hands_what_its_own_path_lacks_to_an_engines_vllm_layer(ingress_mode_app, cluster):
    """In ingress mode a request with logprobs and n=2 (and a batch of prompts) is answered by vLLM's layer on an
    engine replica, reached over the engine handle, streamed or not; so are the Responses, Messages and tokens-in
    APIs, an abort of a running tokens-in request, and a GET of a stored response."""
    body = {"model": INGRESS_APP, "prompt": "def fibonacci(n):", "max_tokens": 3, "n": 2, "logprobs": 2}
    with httpx.Client(base_url=ingress_mode_app, timeout=120) as http:
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1]
        assert all(len(c["logprobs"]["tokens"]) == 3 for c in choices)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        tokens_by_choice: dict[int, int] = {}
        for event in events[:-1]:
            for choice in json.loads(event[6:])["choices"]:
                tokens_by_choice[choice["index"]] = (tokens_by_choice.get(choice["index"], 0)
                                                     + len(choice["logprobs"]["tokens"]))
        assert tokens_by_choice == {0: 3, 1: 3}, events  # vLLM may merge steps into one event; tokens add up
        response = http.post("/v1/responses", json={"model": INGRESS_APP, "input": "hi", "max_output_tokens": 3})
        assert response.status_code == 200 and response.json()["object"] == "response", response.text
        message = http.post("/v1/messages", json={"model": INGRESS_APP, "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "hi"}]})
        assert message.status_code == 200 and message.json()["type"] == "message", message.text
        generated = http.post("/inference/v1/generate", json={"model": INGRESS_APP, "token_ids": [5, 6, 7],
                                                              "sampling_params": {"max_tokens": 3, "ignore_eos": True}})
        assert generated.status_code == 200 and len(generated.json()["choices"][0]["token_ids"]) == 3, generated.text
        tokens, reasons = generated_until_aborted(http, INGRESS_APP, "abort-ingress", 4000)
        assert tokens < 4000 and "abort" in reasons, (tokens, reasons)  # the abort reached the engine running it
        # A stored response's follow-up and GET reach the engine holding it (pinned by the id it names).
        follow_up = http.post("/v1/responses", json={"model": INGRESS_APP, "input": "and then?", "max_output_tokens": 2,
                                                     "previous_response_id": response.json()["id"]})
        assert follow_up.status_code == 200, follow_up.text
        stored = http.get(f"/v1/responses/{follow_up.json()['id']}")
        assert stored.status_code == 200 and stored.json()["previous_response_id"] == response.json()["id"], stored.text
        # A GET reaches the engine's vLLM layer as a GET: its answer for an unknown id, as in direct mode.
        missing = http.get("/v1/responses/resp_missing")
        direct = httpx.get(f"{cluster.base_url}/v1/responses/resp_missing", timeout=60)
        assert (missing.status_code, missing.json()["error"]["type"]) == (direct.status_code,
                                                                          direct.json()["error"]["type"]), missing.text

