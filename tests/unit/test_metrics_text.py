"""benchmarks.metrics_text: family presence and histogram summaries of a saved Prometheus exposition."""

from kvtide.benchmarks.metrics_text import families_present, histogram_summary

TEXT = """# HELP ray_serve_haproxy_ingress_router_latency_ms Wall-clock time
# TYPE ray_serve_haproxy_ingress_router_latency_ms histogram
ray_serve_haproxy_ingress_router_latency_ms_bucket{application="a",outcome="ok",le="1.0"} 2.0
ray_serve_haproxy_ingress_router_latency_ms_bucket{application="a",outcome="ok",le="2.0"} 8.0
ray_serve_haproxy_ingress_router_latency_ms_bucket{application="a",outcome="ok",le="5.0"} 10.0
ray_serve_haproxy_ingress_router_latency_ms_bucket{application="a",outcome="ok",le="+Inf"} 10.0
ray_serve_haproxy_ingress_router_latency_ms_sum{application="a",outcome="ok"} 17.0
ray_serve_haproxy_ingress_router_latency_ms_count{application="a",outcome="ok"} 10.0
# TYPE ray_vllm_kv_cache_usage_perc gauge
ray_vllm_kv_cache_usage_perc{replica="r1"} 0.0
"""


def test_families_present_names_each_asked_family_with_or_without_samples():
    """A gauge with a sample is present; a family the text lacks is not."""
    assert families_present(TEXT, ("ray_vllm_kv_cache_usage_perc", "ray_vllm_num_requests_running")) == {
        "ray_vllm_kv_cache_usage_perc": True, "ray_vllm_num_requests_running": False}


def test_histogram_summary_gives_the_exact_mean_and_bucket_interpolated_quantiles():
    """mean = sum / count; p50 (rank 5) lies 3/6 into the 1–2 ms bucket; p99 (rank 9.9) 0.95 into 2–5 ms."""
    s = histogram_summary(TEXT, "ray_serve_haproxy_ingress_router_latency_ms")
    assert s["count"] == 10 and s["mean"] == 1.7
    assert s["p50"] == 1.5
    assert abs(s["p99"] - 4.85) < 1e-9


def test_histogram_summary_is_none_for_an_absent_histogram_and_stops_at_the_last_finite_bound():
    """No samples → None; a quantile in the +Inf bucket reads as the largest finite bound."""
    assert histogram_summary(TEXT, "missing_ms") is None
    overflow = TEXT.replace('le="+Inf"} 10.0', 'le="+Inf"} 20.0').replace("_count{application=\"a\",outcome=\"ok\"} 10.0",
                                                                          "_count{application=\"a\",outcome=\"ok\"} 20.0")
    assert histogram_summary(overflow, "ray_serve_haproxy_ingress_router_latency_ms")["p99"] == 5.0
