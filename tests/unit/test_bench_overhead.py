"""The overhead benchmark's per-level summary and report (pure, from hand-built request results)."""

from __future__ import annotations

import argparse

import pytest

from kvtide.benchmarks.overhead import level_summary, markdown, paths_markdown
from kvtide.benchmarks.processes import vllm_cli_flags
from kvtide.benchmarks.report import RequestResult


def _result(ttft_s: float, e2e_s: float, tokens: int, gaps: tuple[float, ...] = ()) -> RequestResult:
    return RequestResult(ok=True, start_s=0.0, e2e_s=e2e_s, ttft_s=ttft_s, itl_s=gaps, num_output_tokens=tokens)


def test_itl_mean_is_the_decode_pace_and_throughput_counts_tokens_over_the_level():
    """ITL mean averages (e2e - ttft) / (tokens - 1) per request; tok/s is output tokens over the level's span."""
    results = [_result(0.1, 1.1, 11, (0.1,) * 10), _result(0.2, 2.2, 11, (0.2,) * 10),
               RequestResult(ok=False, start_s=0.0, e2e_s=0.5, error="HTTP 500")]
    summary = level_summary(results, duration_s=4.0)
    assert summary["num_requests"] == 3 and summary["num_errors"] == 1
    assert summary["itl_mean_s"] == pytest.approx((0.1 + 0.2) / 2)
    assert summary["output_tokens_per_s"] == pytest.approx(22 / 4.0)
    assert summary["ttft_s"]["p50"] == pytest.approx(0.15)


def test_report_states_deltas_and_ratios_to_bare_vllm():
    """Each row carries TTFT p50 minus bare vLLM's and ITL / tok/s / e2e ratios to it at the same concurrency."""
    level = {"num_requests": 10, "num_errors": 0, "ttft_s": {"p50": 0.030, "p99": 0.05},
             "itl_mean_s": 0.0105, "itl_p99_s": 0.02, "output_tokens_per_s": 950.0, "e2e_s": {"p50": 1.2}}
    base = {**level, "ttft_s": {"p50": 0.028, "p99": 0.04}, "itl_mean_s": 0.010, "output_tokens_per_s": 1000.0,
            "e2e_s": {"p50": 1.5}}
    args = argparse.Namespace(input_len=512, output_len=128, num_requests=200, duration=60.0)
    text = markdown({"kvtide": {16: level}, "vllm": {16: base}}, args, "cmd", "NVIDIA H200")
    assert "Hardware: NVIDIA H200" in text
    assert "| kvtide | 16 | 10 (0) | 30.0 | 50.0 | 10.5 | 20.0 | 950 | 1200.0 | +2.0 | 1.05× | 0.95× | 0.80× |" in text


def test_engine_kwargs_become_vllm_flags():
    """Booleans become --x / --no-x, None is dropped, names are dashed: bare vLLM runs the identical engine."""
    flags = vllm_cli_flags({"max_model_len": 4096, "enforce_eager": True, "enable_prefix_caching": False,
                            "kv_cache_memory_bytes": None, "disable_log_stats": False})
    assert flags == ["--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching"]


def test_ttft_paths_table_splits_the_path_into_haproxy_plus_consult_and_replica():
    """paths_markdown states full − replica (HAProxy + consult) and replica − bare (replica + engine) from the p50s."""
    def stat(p50: float) -> dict:
        return {"p50": p50, "p90": p50 + 0.002, "p99": p50 + 0.004, "mean": p50 + 0.001, "n": 60}

    text = paths_markdown({"full": stat(0.045), "consult": stat(0.003), "replica": stat(0.040), "bare": stat(0.034)}, 60)
    assert "| full | 45.0 | 47.0 | 46.0 | 60 |" in text
    assert "(full − replica): +5.0 ms" in text and "(replica − bare): +6.0 ms" in text
    assert "full − replica" not in paths_markdown({"bare": stat(0.034)}, 60)  # no split without all three
