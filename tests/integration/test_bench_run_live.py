"""`kvtide bench run` against the real cluster writes the documented JSON report."""

from __future__ import annotations

import json
import subprocess
import sys

from kvtide.benchmarks.report import RUN_KEYS, STAT_KEYS


def test_bench_run_on_a_tiny_workload_writes_every_key(cluster, tmp_path):
    """A tiny shared-prefix run yields JSON with exactly the documented keys (and its provenance) and sane values."""
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "kvtide.cluster.cli", "bench", "run", "--url", cluster.base_url,
           "--metrics-url", cluster.metrics_url, "--policy", "prefix_aware", "--workload", "shared-prefix",
           "--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "256", "--question-len", "16",
           "--output-len", "4", "--concurrency", "2", "--duration", "60", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert tuple(report) == (*RUN_KEYS, "provenance") and report["provenance"]["command"].startswith("kvtide bench run")
    assert report["num_requests"] == 6 and report["num_errors"] == 0 and report["policy"] == "prefix_aware"
    for key in ("ttft_s", "itl_s", "e2e_s"):
        assert set(report[key]) == set(STAT_KEYS)
    assert report["ttft_s"]["p50"] > 0 and report["output_tokens_per_s"] > 0
    assert 0.0 <= report["prefix_cache_hit_rate"] <= 1.0
