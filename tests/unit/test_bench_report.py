"""Benchmark report: percentiles, the exact run-JSON keys, goodput, Prometheus parsing, imbalance, comparison table."""

from __future__ import annotations

import json

import pytest

from kvtide.benchmarks.plots import write_sweep_plots
from kvtide.benchmarks.report import (
    RUN_KEYS,
    MetricsSample,
    RequestResult,
    build_run_report,
    compare_markdown,
    sweep_markdown,
    goodput_count,
    imbalance,
    metrics_delta,
    parse_metrics,
    percentile,
    pick_baseline,
    summarize,
)

# Shaped like Ray's metrics agent output for two kvtide engine replicas (vLLM's Ray stat
# logger adds ReplicaId), plus series that must be ignored.
RAY_TEXT = """\
# HELP ray_vllm_prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE ray_vllm_prefix_cache_hits_total counter
ray_vllm_prefix_cache_hits_total{ReplicaId="r1",engine="0",model_name="kvtide-demo",Component="core_worker"} 600.0
ray_vllm_prefix_cache_hits_total{ReplicaId="r2",engine="0",model_name="kvtide-demo",Component="core_worker"} 200.0
# HELP ray_vllm_prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{ReplicaId="r1",engine="0",model_name="kvtide-demo"} 1000.0
ray_vllm_prefix_cache_queries_total{ReplicaId="r2",engine="0",model_name="kvtide-demo"} 1000.0
# HELP ray_vllm_request_success_total Count of successfully processed requests.
# TYPE ray_vllm_request_success_total counter
ray_vllm_request_success_total{ReplicaId="r1",engine="0",finished_reason="length",model_name="kvtide-demo"} 30.0
ray_vllm_request_success_total{ReplicaId="r1",engine="0",finished_reason="stop",model_name="kvtide-demo"} 2.0
ray_vllm_request_success_total{ReplicaId="r2",engine="0",finished_reason="length",model_name="kvtide-demo"} 16.0
# HELP ray_kvtide_requests_total Finished requests by HTTP status.
# TYPE ray_kvtide_requests_total counter
ray_kvtide_requests_total{endpoint="chat",model="kvtide-demo",status="200"} 48.0
"""

# A bare `vllm serve`: colon names, no replica label.
VLLM_TEXT = """\
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 90.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
"""


def ok(ttft: float, e2e: float, itl=(0.01, 0.03), tokens: int = 3, start: float = 0.0) -> RequestResult:
    return RequestResult(ok=True, start_s=start, e2e_s=e2e, ttft_s=ttft, itl_s=tuple(itl), num_output_tokens=tokens)


@pytest.mark.parametrize("samples, p, expected", [
    ([5.0], 99, 5.0),
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([1.0, 2.0, 3.0, 4.0, 5.0], 90, 4.6),
    ([3.0, 1.0, 2.0], 0, 1.0),
    ([3.0, 1.0, 2.0], 100, 3.0),
    (list(range(101)), 99, 99.0),
])
def test_percentile_interpolates_linearly(samples, p, expected):
    """percentile matches numpy's default linear interpolation on unsorted input."""
    assert percentile(samples, p) == pytest.approx(expected)


def test_percentile_rejects_empty_and_out_of_range():
    """No samples or p outside 0..100 is an error, not a silent 0."""
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_has_stat_keys_and_nulls_when_empty():
    """summarize gives p50/p90/p99/mean, all null for no samples."""
    assert summarize([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert summarize([1.0, 3.0])["mean"] == 2.0


def test_run_json_has_exactly_the_keys():
    """The run JSON has exactly RUN_KEYS in order, and round-trips through json."""
    report = build_run_report(workload="shared-prefix", policy=None, results=[ok(0.1, 1.0)], duration_s=2.0,
                              metrics=None)
    assert list(report) == list(RUN_KEYS) == [
        "workload", "policy", "offered_rate_per_s", "concurrency", "num_requests", "num_errors", "duration_s",
        "requests_per_s", "output_tokens_per_s", "slo_ttft_s", "goodput_requests_per_s", "ttft_s", "itl_s", "e2e_s",
        "prefix_cache_hit_rate", "oracle_hit_rate", "requests_per_replica", "imbalance"]
    assert json.loads(json.dumps(report)) == report
    assert set(report["ttft_s"]) == {"p50", "p90", "p99", "mean"}


def test_run_json_numbers():
    """Errors are counted but excluded from rates and latencies; ITL pools every gap."""
    results = [ok(0.1, 1.0, tokens=10), ok(0.3, 2.0, tokens=20),
               RequestResult(ok=False, start_s=0.0, e2e_s=0.5, error="HTTP 503")]
    r = build_run_report(workload="random", policy="pow2", results=results, duration_s=4.0, metrics=None)
    assert (r["num_requests"], r["num_errors"]) == (3, 1)
    assert r["requests_per_s"] == 0.5 and r["output_tokens_per_s"] == 7.5
    assert r["ttft_s"]["p50"] == pytest.approx(0.2) and r["e2e_s"]["mean"] == pytest.approx(1.5)
    assert r["itl_s"]["mean"] == pytest.approx(0.02)
    assert (r["prefix_cache_hit_rate"], r["requests_per_replica"], r["imbalance"]) == (None, {}, None)


FAILED = RequestResult(ok=False, start_s=0.0, e2e_s=0.1, ttft_s=0.05, error="HTTP 503")  # fast, yet no good
NO_TOKEN = RequestResult(ok=True, start_s=0.0, e2e_s=0.2)  # a success that streamed no text has no TTFT


@pytest.mark.parametrize("results, duration_s, expected", [
    ([ok(0.1, 1.0), ok(0.5, 1.0), ok(1.0, 2.0)], 2.0, 1.5),   # all within 1 s (the bound is inclusive)
    ([ok(1.5, 2.0), ok(3.0, 4.0)], 2.0, 0.0),                 # none
    ([ok(0.2, 1.0), ok(1.2, 2.0), ok(0.9, 1.0), ok(2.0, 3.0)], 4.0, 0.5),  # mixed: 2 of 4 over 4 s
    ([ok(0.2, 1.0), FAILED, FAILED, NO_TOKEN], 2.0, 0.5),    # errors and TTFT-less successes excluded
    ([ok(0.2, 1.0)], 0.0, 0.0),                               # zero duration: no rate, not a division error
    ([], 5.0, 0.0),                                           # no requests
])
def test_goodput_table(results, duration_s, expected):
    """goodput = successes with TTFT <= slo_ttft_s, per second of the run; the SLO is recorded in the report."""
    r = build_run_report(workload="w", policy="p", results=results, duration_s=duration_s, metrics=None,
                         slo_ttft_s=1.0)
    assert r["goodput_requests_per_s"] == pytest.approx(expected)
    assert r["slo_ttft_s"] == 1.0
    assert r["goodput_requests_per_s"] <= r["requests_per_s"]


def test_goodput_follows_the_slo():
    """A looser SLO admits more requests; the default SLO is 1 s."""
    results = [ok(0.3, 1.0), ok(1.5, 2.0), ok(2.5, 3.0)]
    assert [goodput_count(results, slo) for slo in (0.1, 1.0, 2.0, 3.0)] == [0, 1, 2, 3]
    r = build_run_report(workload="w", policy="p", results=results, duration_s=1.0, metrics=None)
    assert (r["slo_ttft_s"], r["goodput_requests_per_s"]) == (1.0, 1.0)


def test_parse_ray_metrics_sums_cache_and_groups_by_replica():
    """Ray-exported vLLM series: cache counters summed over replicas, successes grouped by ReplicaId."""
    m = parse_metrics(RAY_TEXT)
    assert (m.prefix_cache_hits, m.prefix_cache_queries) == (800.0, 2000.0)
    assert m.requests_by_replica == {"r1": 32.0, "r2": 16.0}


def test_parse_bare_vllm_metrics():
    """Bare vLLM's colon-named series parse too, its one engine under the key 'vllm'; _created is ignored."""
    m = parse_metrics(VLLM_TEXT)
    assert (m.prefix_cache_hits, m.prefix_cache_queries) == (90.0, 100.0)
    assert m.requests_by_replica == {"vllm": 7.0}


def test_metrics_delta_counts_only_the_run():
    """The report uses after − before; a replica that appeared during the run counts from zero."""
    before = MetricsSample(100.0, 400.0, {"r1": 10.0})
    after = parse_metrics(RAY_TEXT)
    d = metrics_delta(before, after)
    assert (d.prefix_cache_hits, d.prefix_cache_queries) == (700.0, 1600.0)
    assert d.requests_by_replica == {"r1": 22.0, "r2": 16.0}
    assert metrics_delta(None, after) is None


def test_hit_rate_and_imbalance_from_metrics():
    """Hit rate is Δhits/Δqueries and imbalance is max/mean of requests per replica."""
    delta = MetricsSample(300.0, 1200.0, {"r1": 30.0, "r2": 10.0})
    r = build_run_report(workload="w", policy="p", results=[ok(0.1, 1.0)], duration_s=1.0, metrics=delta)
    assert r["prefix_cache_hit_rate"] == 0.25
    assert r["requests_per_replica"] == {"r1": 30, "r2": 10}
    assert r["imbalance"] == 1.5


@pytest.mark.parametrize("counts, expected", [({}, None), ({"a": 5}, 1.0), ({"a": 2, "b": 2}, 1.0),
                                              ({"a": 3, "b": 1}, 1.5), ({"a": 0, "b": 0}, None)])
def test_imbalance_table(counts, expected):
    """imbalance = max/mean; null when there is nothing to compare."""
    assert imbalance(counts) == expected


def test_imbalance_counts_replicas_that_served_nothing():
    """A fleet of 4 whose one replica served all 67 requests is 4x imbalanced, not 1.00 (silent replicas count as 0)."""
    assert imbalance({"a": 67}, num_replicas=4) == 4.0
    assert imbalance({"a": 3, "b": 1}, num_replicas=2) == 1.5  # every replica reported: as before


def test_compare_markdown_has_ratios_vs_pow2():
    """The comparison table lists every policy and ratios against pow2."""
    fast = build_run_report(workload="w", policy="prefix_aware", results=[ok(0.1, 1.0)], duration_s=1.0,
                            metrics=MetricsSample(90.0, 100.0, {"a": 1.0}))
    slow = build_run_report(workload="w", policy="pow2", results=[ok(0.4, 1.0)], duration_s=1.0,
                            metrics=MetricsSample(30.0, 100.0, {"a": 1.0}))
    md = compare_markdown({"pow2": slow, "prefix_aware": fast})
    assert "| prefix_aware | 0.25× |" in md and "| pow2 | 1.00× |" in md
    assert "3.00×" in md  # hit rate 0.9 vs 0.3


def _run(policy: str, ttft: float, num_ok: int) -> dict:
    return build_run_report(workload="w", policy=policy, results=[ok(ttft, 1.0)] * num_ok, duration_s=2.0,
                            metrics=None, slo_ttft_s=0.5)


def test_compare_markdown_has_goodput_and_its_ratio():
    """The table has a goodput column naming the SLO, and the ratio table its ratio to the baseline."""
    md = compare_markdown({"bare": _run("bare", 0.4, 2), "prefix_aware": _run("prefix_aware", 0.1, 6)})
    assert "goodput (req/s, TTFT ≤ 0.50 s)" in md
    assert "| bare | 1.00 | 1.00 |" in md and "| prefix_aware | 3.00 | 3.00 |" in md
    ratios = md.split("Ratios vs `bare`")[1]
    assert "| prefix_aware | 0.25× | 0.25× | 3.00× | 3.00× | – |" in ratios


@pytest.mark.parametrize("names, asked, expected", [
    (["pow2", "bare", "prefix_aware"], None, "bare"),   # no kvtide at all is the first choice
    (["prefix_aware", "pow2"], None, "pow2"),
    (["prefix_aware", "ray_prefix"], None, "prefix_aware"),
    (["bare", "pow2"], "pow2", "pow2"),                 # an explicit baseline that ran wins
    (["bare", "pow2"], "missing", "bare"),
])
def test_baseline_is_bare_then_pow2_then_first(names, asked, expected):
    """Ratios are against the explicit baseline if it ran, else bare, else pow2, else the first run."""
    assert pick_baseline(names, asked) == expected


def test_compare_markdown_lists_notes():
    """Notes (what `bare` ran, which balancer) appear in the report as a list."""
    md = compare_markdown({"bare": _run("bare", 0.4, 1)}, notes=["`bare`: 2 servers behind HAProxy"])
    assert "- `bare`: 2 servers behind HAProxy" in md


def _point(policy: str, rate: float, ttft: float, num_ok: int) -> dict:
    return build_run_report(workload="shared-prefix", policy=policy, results=[ok(ttft, 1.0)] * num_ok,
                            duration_s=2.0, metrics=MetricsSample(50.0, 100.0, {"a": 1.0}), slo_ttft_s=0.5,
                            offered_rate_per_s=rate, oracle_hit_rate=0.9)


def test_sweep_markdown_tabulates_goodput_per_load_and_policy(tmp_path):
    """A sweep report has one goodput row per load with a column per policy, then each point's tables."""
    points = {"shared-prefix @ rate 2": {"bare": _point("bare", 2, 0.4, 2), "prefix_aware": _point("prefix_aware", 2, 0.1, 4)},
              "shared-prefix @ rate 8": {"bare": _point("bare", 8, 0.9, 2), "prefix_aware": _point("prefix_aware", 8, 0.2, 8)}}
    md = sweep_markdown(points, hardware="2 × NVIDIA H200")
    assert "Hardware: 2 × NVIDIA H200." in md
    assert "| load | bare | prefix_aware |" in md
    assert "| rate 2 req/s | 1.00 | 2.00 |" in md and "| rate 8 req/s | 0.00 | 4.00 |" in md
    assert "| rate 2 req/s | 0.50 (0.90) | 0.50 (0.90) |" in md  # hit rate beside the oracle's
    assert md.count("Ratios vs `bare`") == 2
    assert [p.name for p in write_sweep_plots(points, tmp_path)] == ["shared-prefix_sweep.png"]


def _repeat_run(goodput: float, ttft_p90: float) -> dict:
    return {"goodput_requests_per_s": goodput, "ttft_s": {"p50": ttft_p90 / 2, "p90": ttft_p90},
            "itl_s": {"mean": 0.01}, "output_tokens_per_s": 100.0 * goodput, "prefix_cache_hit_rate": 0.5}


def test_repeats_aggregate_to_the_median_run_with_every_repeats_metrics():
    """The median-goodput run stands for the policy (a real run, not a mix); the spread keeps each repeat's values."""
    from kvtide.benchmarks.report import aggregate_repeats, spread_markdown

    runs = [_repeat_run(3.0, 0.9), _repeat_run(1.0, 2.0), _repeat_run(2.0, 1.1)]
    agg = aggregate_repeats(runs)
    assert agg["goodput_requests_per_s"] == 2.0 and agg["ttft_s"]["p90"] == 1.1
    assert agg["repeats"]["n"] == 3 and agg["repeats"]["goodput_requests_per_s"] == [3.0, 1.0, 2.0]
    assert aggregate_repeats(runs[:1]) == runs[0]  # one run: as it was, no spread
    text = spread_markdown({"random @ rate 1": {"pow2": agg}})
    assert "| pow2 | 3 | 2.000 [1.000–3.000] |" in text
    assert spread_markdown({"random @ rate 1": {"pow2": runs[0]}}) == ""
