"""The Ray metrics port serves Prometheus text with vLLM engine series and kvtide ingress series."""

from __future__ import annotations

from support import metric_sum, metric_values, wait_for

ENGINE_SERIES = [
    "ray_vllm_kv_cache_usage_perc",
    "ray_vllm_prefix_cache_queries_total",
    "ray_vllm_prefix_cache_hits_total",
    "ray_vllm_num_requests_running",
    "ray_vllm_num_requests_waiting",
]
INGRESS_HISTOGRAMS = [
    "ray_kvtide_time_to_first_token_seconds",
    "ray_kvtide_inter_token_latency_seconds",
    "ray_kvtide_e2e_latency_seconds",
    # Index trust (prefix_aware, the session's policy): the repeated prompt below is a predicted
    # hit the engine confirms, so the error histogram has observations.
    "ray_kvtide_router_prediction_error_tokens",
]
INGRESS_COUNTERS = ["ray_kvtide_router_predictions_total"]


def _drive_traffic(http, model: str) -> None:
    # The same long prompt twice: the second prefill hits the prefix cache on whichever replica.
    prompt = "The quick brown fox jumps over the lazy dog. " * 60
    for _ in range(4):
        r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4, "stream": True})
        assert r.status_code == 200
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_metrics_port_serves_engine_and_ingress_series(http, cluster):
    """After traffic, one scrape shows vLLM's KV/prefix-cache/queue series and kvtide's latency histograms."""
    _drive_traffic(http, cluster.model_name)

    def all_present() -> bool:
        return (all(metric_values(cluster.metrics_url, name) for name in ENGINE_SERIES)
                and all(metric_values(cluster.metrics_url, name + "_count") for name in INGRESS_HISTOGRAMS)
                and all(metric_values(cluster.metrics_url, name) for name in INGRESS_COUNTERS)
                and metric_sum(cluster.metrics_url, "ray_vllm_prefix_cache_hits_total") > 0)

    wait_for(all_present, timeout_s=90, what="engine and ingress series in the scrape")
    assert metric_sum(cluster.metrics_url, "ray_kvtide_time_to_first_token_seconds_count",
                      endpoint="completions") >= 4


def test_request_counter_is_labelled_by_status(http, cluster):
    """kvtide_requests_total counts successes and client errors under their HTTP status."""
    ok_before = metric_sum(cluster.metrics_url, "ray_kvtide_requests_total", status="200")
    bad_before = metric_sum(cluster.metrics_url, "ray_kvtide_requests_total", status="400")
    assert http.post("/v1/completions", json={"model": cluster.model_name, "prompt": "a", "max_tokens": 1}).status_code == 200
    assert http.post("/v1/completions", json={"model": cluster.model_name, "prompt": "a", "max_tokens": 0}).status_code == 400
    wait_for(lambda: metric_sum(cluster.metrics_url, "ray_kvtide_requests_total", status="200") > ok_before
             and metric_sum(cluster.metrics_url, "ray_kvtide_requests_total", status="400") > bad_before,
             timeout_s=60, what="status-labelled request counters to move")


def test_metrics_are_not_on_the_public_port(http):
    """The OpenAI port does not expose /metrics; Prometheus scrapes the Ray metrics port."""
    assert http.get("/metrics").status_code == 404
