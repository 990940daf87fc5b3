"""The autoscaling benchmark's summary of a step-load run (pure, from recorded samples)."""

from __future__ import annotations

from kvtide.benchmarks.autoscale import Probe, RunResult, Trace, markdown, summarize_run


TRACE = Trace(low_s=10, high_s=20, tail_s=10)


def _run() -> RunResult:
    result = RunResult("kv")
    # One replica until t=18 (decision at 14: target 2), two running from 18 to 30, one again after.
    result.replicas = [(float(t), 2 if 18 <= t < 30 else 1, 2 if 14 <= t < 30 else 1) for t in range(40)]
    result.probes = [Probe(1.0, 0.02, "old", "low"), Probe(12.0, 0.5, "old", "high"),
                     Probe(19.0, 0.03, "new", "high"), Probe(20.0, 0.04, "new", "high"),
                     Probe(32.0, None, "", "tail")]
    return result


def test_replica_seconds_and_scale_timings():
    """Replica-seconds integrate running replicas; decision and serving are timed from the load step."""
    summary = summarize_run(_run(), TRACE)
    assert summary["replica_seconds"] == 40 + 12
    assert summary["scale_decision_after_step_s"] == 4.0
    assert summary["added_replica_serving_after_step_s"] == 8.0
    assert summary["max_replicas_seen"] == 2


def test_new_replica_first_probes_and_phase_percentiles():
    """The first probes served by a replica other than the first one are the new replica's TTFTs."""
    summary = summarize_run(_run(), TRACE)
    assert summary["new_replica_first_probe_ttft_s"] == [0.03, 0.04]
    assert summary["probe_ttft_by_phase_s"]["low"]["n"] == 1
    assert summary["probe_errors"] == 1


def test_markdown_has_one_row_per_variant():
    """The report table carries a row per variant with its replica-seconds."""
    text = markdown([summarize_run(_run(), TRACE)], Trace(), "cmd", ["a=1"])
    assert "| kv | 52 | 2 | 4 | 8 | 30, 40 |" in text
