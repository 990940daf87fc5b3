"""The OpenAI API through the official `openai` client, on a real 2-replica cluster."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from support import metric_sum, wait_for


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client, cluster, cluster_config):
    """GET /v1/models names the served model first, then its LoRA adapters, each with the context length."""
    models = client.models.list().data
    assert [m.id for m in models] == [cluster.model_name, *cluster_config.lora.adapters]
    assert all(m.model_extra["max_model_len"] == 4096 for m in models)


def test_completion_returns_text_usage_and_finish_reason(client, cluster):
    """A non-streamed completion honours max_tokens and reports usage and finish_reason."""
    resp = client.completions.create(model=cluster.model_name, prompt="def fibonacci(n):", max_tokens=7,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    assert isinstance(resp.choices[0].text, str) and resp.choices[0].text


def test_chat_applies_template_and_counts_prompt_tokens(client, cluster):
    """Chat messages are rendered with the model's chat template before tokenizing."""
    short = client.chat.completions.create(
        model=cluster.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_body={"ignore_eos": True})
    longer = client.chat.completions.create(
        model=cluster.model_name,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}],
        max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert short.choices[0].message.role == "assistant"
    assert short.usage.completion_tokens == 3 and longer.usage.completion_tokens == 3
    # The system turn adds its role marker, content and end marker on top of the user turn.
    assert longer.usage.prompt_tokens > short.usage.prompt_tokens + 3


def test_seeded_sampling_is_reproducible(client, cluster):
    """The same seed and temperature give the same text; the engine honours the seed."""
    kwargs = dict(model=cluster.model_name, prompt="import os", max_tokens=12, temperature=1.0, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second


def test_chat_stream_with_usage_matches_openai_shape(client, cluster):
    """A streamed chat yields a role delta, content deltas, a finish chunk, then one usage chunk."""
    stream = client.chat.completions.create(
        model=cluster.model_name, messages=[{"role": "user", "content": "Tell me about lists."}],
        max_tokens=10, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def test_completion_stream_ends_with_done(cluster, http):
    """Raw SSE: every event is a `data:` line and the stream ends with `data: [DONE]`."""
    body = {"model": cluster.model_name, "prompt": "class Foo:", "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 2


def test_return_token_ids_carries_every_output_token_of_the_real_engine(cluster, http):
    """With vLLM's return_token_ids a stream's chunks carry all max_tokens output ids (textless ones too), as does a non-streamed reply."""
    body = {"model": cluster.model_name, "prompt": "def f(x):", "max_tokens": 12, "ignore_eos": True,
            "return_token_ids": True}
    whole = http.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert len(whole.json()["choices"][0]["token_ids"]) == 12
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line[len("data: "):] for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert all(c["token_ids"] for c in choices)
    assert sum(len(c["token_ids"]) for c in choices) == 12


def test_stop_sequence_ends_generation(client, cluster):
    """A stop string found in the output ends the choice with finish_reason 'stop' and is not returned."""
    probe = client.completions.create(model=cluster.model_name, prompt="x = [", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = probe.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2] or text[:1]
    resp = client.completions.create(model=cluster.model_name, prompt="x = [", max_tokens=24, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "stop"
    assert stop not in resp.choices[0].text
    assert text.startswith(resp.choices[0].text)


def test_32_concurrent_streams_all_complete(cluster):
    """32 concurrent streaming chats all finish with their full token count."""
    client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=cluster.model_name, messages=[{"role": "user", "content": f"request number {i}"}],
            # ignore_eos: the random demo model may sample EOS early; the count must be exact.
            max_tokens=16, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main() -> list[int]:
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    assert asyncio.run(main()) == [16] * 32


def test_health_and_ready(http):
    """/health is liveness; /ready answers 200 once an engine replica serves."""
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


def test_a_client_cannot_supply_the_routed_tokens_header(cluster, http):
    """Through HAProxy a client's copy of the peer-only token header is dropped: the prompt is the body's."""
    from kvtide.deployments.frontend.prompts import ROUTED_TOKENS_HEADER, encode_token_ids

    body = {"model": cluster.model_name, "prompt": "def fibonacci(n):", "max_tokens": 1, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body)
    forged = http.post("/v1/completions", json=body, headers={ROUTED_TOKENS_HEADER: encode_token_ids([5])})
    assert plain.status_code == forged.status_code == 200, (plain.text, forged.text)
    assert forged.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] > 1


def test_min_tokens_holds_generation_to_its_length_on_the_real_engine(client, cluster):
    """min_tokens reaches vLLM: with min_tokens = max_tokens the engine cannot stop at EOS, so every token comes."""
    for _ in range(3):
        resp = client.completions.create(model=cluster.model_name, prompt="print(", max_tokens=12,
                                         extra_body={"min_tokens": 12})
        assert resp.usage.completion_tokens == 12 and resp.choices[0].finish_reason == "length"


def test_stop_token_ids_end_generation_at_that_token_on_the_real_engine(cluster, http):
    """stop_token_ids reaches vLLM: greedy generation stops at the first occurrence of the named token."""
    body = {"model": cluster.model_name, "prompt": "for i in range(", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    ids = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    stop_at = ids.index(ids[3])  # the token may occur earlier: generation ends at its first occurrence
    resp = http.post("/v1/completions", json={**body, "stop_token_ids": [ids[3]]}).json()
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert resp["usage"]["completion_tokens"] == stop_at + 1, (ids, resp)


def test_a_field_only_vllms_layer_answers_is_served_through_haproxy_with_kvtides_metrics(cluster, http):
    """Through HAProxy and the routing peer, n=2 and a batch of prompts (answered by vLLM's own layer on the
    replica) return what they ask for, and count in kvtide's request counter."""
    before = metric_sum(cluster.metrics_url, "ray_kvtide_requests_total", endpoint="completions", status="200")
    two = http.post("/v1/completions", json={"model": cluster.model_name, "prompt": "def", "max_tokens": 2, "n": 2})
    assert sorted(c["index"] for c in two.json()["choices"]) == [0, 1], two.text
    batch = http.post("/v1/completions", json={"model": cluster.model_name, "prompt": ["def", "class"], "max_tokens": 2})
    assert sorted(c["index"] for c in batch.json()["choices"]) == [0, 1], batch.text
    wait_for(lambda: metric_sum(cluster.metrics_url, "ray_kvtide_requests_total", endpoint="completions",
                                status="200") >= before + 2, timeout_s=60, what="both requests counted")


def test_models_retrieve_tokenize_and_version_through_haproxy(client, cluster, http):
    """models.retrieve names the served model; /tokenize counts what a completion's usage counts; /detokenize
    returns the prompt; /version names the serving vLLM."""
    assert client.models.retrieve(cluster.model_name).id == cluster.model_name
    prompt = "def fibonacci(n):"
    tokens = http.post("/tokenize", json={"model": cluster.model_name, "prompt": prompt}).json()
    usage = client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=1).usage
    assert tokens["count"] == len(tokens["tokens"]) == usage.prompt_tokens
    # (a BOS, where the tokenizer adds one, decodes to its own text in front)
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"].endswith(prompt)
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"][0].isdigit()


DEFAULTS_APP = "kvtide-defaults"


@pytest.fixture(scope="module")
def defaults_app(cluster, cluster_config):
    """A one-engine app whose model default is greedy sampling, set through engine.extra_args."""
    from ray import serve
    from support import deploy_app

    deploy_app(cluster_config, DEFAULTS_APP, [
        "replicas.num_replicas=1", "engine.extra_args.override_generation_config={temperature: 0.0}"])
    try:
        yield cluster.base_url + f"/{DEFAULTS_APP}"
    finally:
        serve.delete(DEFAULTS_APP)


def test_extra_engine_args_and_the_models_sampling_defaults_reach_the_real_engine(defaults_app):
    """engine.extra_args reaches vLLM (override_generation_config), and its sampling default applies where a
    request sets no temperature: any seed then gives the greedy text."""
    import httpx

    body = {"model": DEFAULTS_APP, "prompt": "while True:", "max_tokens": 10, "ignore_eos": True}
    with httpx.Client(base_url=defaults_app, timeout=120) as http:
        greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        unset = [http.post("/v1/completions", json={**body, "seed": seed}).json()["choices"][0]["text"]
                 for seed in (1, 2)]
    assert unset == [greedy, greedy]
