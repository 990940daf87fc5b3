"""Every client mistake gets an OpenAI-style error with the right 4xx; a disconnect aborts in the engine."""

from __future__ import annotations

import pytest
from support import metric_sum, wait_for


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


def test_malformed_json_is_400(http):
    """A body that is not JSON is a 400 invalid_json, not a 500."""
    err = _error(http.post("/v1/chat/completions", content=b"{not json",
                           headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json" and err["type"] == "invalid_request_error"


def test_non_object_body_is_400(http):
    """A JSON array where an object belongs is a 400."""
    _error(http.post("/v1/completions", json=[1, 2, 3]), 400)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi"}, "model"),
    ({"model": "M"}, "prompt"),
    ({"model": "M", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "M", "prompt": "hi", "temperature": 9}, "temperature"),
    ({"model": "M", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "M", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "M", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "M", "prompt": "hi", "stream_options": {"include_usage": True}}, None),
    ({"model": "M", "prompt": [1, -5]}, "prompt"),
])
def test_invalid_completion_fields_are_400_naming_the_field(http, cluster, body, param):
    """Each invalid completions field gives a 400 whose `param` names that field."""
    body = {k: (cluster.model_name if v == "M" else v) for k, v in body.items()}
    err = _error(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "M", "messages": []}, "messages"),
    ({"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": "M", "messages": [{"content": "x"}]}, "messages.0.role"),
    ({"model": "M", "messages": "hello"}, "messages"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
])
def test_invalid_chat_fields_are_400_naming_the_field(http, cluster, body, param):
    """Each invalid chat field gives a 400 whose `param` names that field."""
    body = {k: (cluster.model_name if v == "M" else v) for k, v in body.items()}
    err = _error(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param


def test_unknown_model_is_404(http):
    """Asking for a model that is not served is a 404 model_not_found."""
    err = _error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]


def test_prompt_plus_max_tokens_over_context_is_400_with_both_numbers(http, cluster):
    """Over-long requests are refused before the engine, stating the limit and the request."""
    err = _error(http.post("/v1/completions", json={
        "model": cluster.model_name, "prompt": list(range(10, 110)), "max_tokens": 4000}), 400)
    assert err["code"] == "context_length_exceeded"
    assert "4096" in err["message"] and "4100" in err["message"]
    assert "100 in the prompt" in err["message"] and "4000 for the completion" in err["message"]


def test_prompt_alone_over_context_is_400(http, cluster):
    """A prompt that alone exceeds the context is refused with both numbers."""
    err = _error(http.post("/v1/completions", json={
        "model": cluster.model_name, "prompt": [11] * 5000}), 400)
    assert "4096" in err["message"] and "5000" in err["message"]


def test_out_of_vocabulary_token_id_is_400(http, cluster):
    """Token ids beyond the vocabulary are a client error, not an engine crash."""
    err = _error(http.post("/v1/completions", json={"model": cluster.model_name, "prompt": [5, 10**9]}), 400)
    assert err["param"] == "prompt"


def test_body_over_limit_is_413(http, cluster, cluster_config):
    """A body larger than frontend.max_body_bytes is a 413 before parsing."""
    big = "x" * (cluster_config.frontend.max_body_bytes + 10)
    err = _error(http.post("/v1/completions", json={"model": cluster.model_name, "prompt": big}), 413)
    assert err["code"] == "body_too_large"


def test_a_body_past_haproxys_routing_buffer_reaches_the_replica_whole(http, cluster, cluster_config):
    """A body larger than http.router_buffer_bytes (cut for the routing peer) is forwarded whole: the replica
    parses all of it and refuses the prompt for its length, naming its token count."""
    n = cluster_config.http.router_buffer_bytes // 3 + 1000  # ≥ 3 bytes per id: the body outgrows the buffer
    err = _error(http.post("/v1/completions", json={"model": cluster.model_name, "prompt": [11] * n}), 400)
    assert str(n) in err["message"]


def test_unknown_path_and_wrong_method_use_openai_errors(http):
    """404 and 405 from routing keep the OpenAI error shape."""
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.get("/v1/completions"), 405)


def test_server_still_serves_after_bad_input(http, cluster):
    """After a barrage of bad requests a good request still succeeds."""
    for _ in range(5):
        http.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"})
    ok = http.post("/v1/completions", json={"model": cluster.model_name, "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_client_disconnect_aborts_the_request_in_the_engine(http, cluster):
    """Closing a stream mid-generation aborts it in vLLM: KV blocks are freed, nothing keeps running."""
    aborted_before = metric_sum(cluster.metrics_url, "ray_kvtide_engine_aborted_requests_total")
    body = {"model": cluster.model_name, "prompt": "while True:", "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or line == "" for line in received)
    # Only the engine's cancellation path counts here; a request that ran to its end does not.
    wait_for(lambda: metric_sum(cluster.metrics_url, "ray_kvtide_engine_aborted_requests_total") > aborted_before,
             timeout_s=60, what="the engine to count the aborted request")
    wait_for(lambda: metric_sum(cluster.metrics_url, "ray_vllm_num_requests_running") == 0
             and metric_sum(cluster.metrics_url, "ray_vllm_kv_cache_usage_perc") == 0,
             timeout_s=60, what="engines to report zero running requests and zero KV usage")
