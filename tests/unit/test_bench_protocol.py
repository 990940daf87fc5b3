"""The benchmark protocol (benchmarks.protocol): run order, summaries over repeats, verdicts, provenance."""

from __future__ import annotations

import shlex
from datetime import datetime, timezone

import pytest

from kvtide.benchmarks.protocol import (
    WARMUP,
    Run,
    difference_summary,
    engine_config_differences,
    format_spread,
    order_text,
    provenance,
    provenance_markdown,
    ratio_summary,
    schedule,
    summarize_repeats,
    verdict,
)


@pytest.mark.parametrize("servers", [["a", "b"], ["a", "b", "c"], ["kvtide", "kvtide-ingress", "vllm", "ray"]])
@pytest.mark.parametrize("repeats", [1, 2, 3, 5])
def test_the_order_never_runs_a_server_twice_in_a_row(servers, repeats):
    """With two or more servers no entry of the order names the same server as the one before it."""
    order = schedule(servers, repeats)
    assert all(prev.server != run.server for prev, run in zip(order, order[1:]))


@pytest.mark.parametrize("repeats", [1, 3])
def test_each_server_is_warmed_once_before_its_first_measured_run(repeats):
    """Every server has exactly one warm-up, and it precedes every measured run of every server."""
    order = schedule(["a", "b", "c"], repeats)
    warmups = [i for i, run in enumerate(order) if run.warmup]
    measured = [i for i, run in enumerate(order) if not run.warmup]
    assert sorted(order[i].server for i in warmups) == ["a", "b", "c"]
    assert max(warmups) < min(measured)


def test_the_order_alternates_rounds_of_every_server_and_counts_each_repeat_once():
    """After the warm-ups the order is round after round of all servers (A B C A B C), each repeat index once."""
    order = schedule(["a", "b", "c"], 2)
    assert order == [Run("a", WARMUP), Run("b", WARMUP), Run("c", WARMUP),
                     Run("a", 0), Run("b", 0), Run("c", 0), Run("a", 1), Run("b", 1), Run("c", 1)]
    assert order_text(order[:4]) == "a warm-up → b warm-up → c warm-up → a #1"


def test_a_schedule_refuses_no_repeats_and_a_server_named_twice():
    """repeats < 1 and a duplicate server are errors, not an empty or back-to-back order."""
    with pytest.raises(ValueError, match="repeats"):
        schedule(["a"], 0)
    with pytest.raises(ValueError, match="twice"):
        schedule(["a", "b", "a"], 2)


@pytest.mark.parametrize("values, median, low, high, n", [
    ([3.0, 1.0, 2.0], 2.0, 1.0, 3.0, 3),
    ([4.0, None, 1.0, 2.0], 2.0, 1.0, 4.0, 3),   # a failed repeat is skipped, not counted
    ([1.0, 2.0, 3.0, 10.0], 2.5, 1.0, 10.0, 4),  # an even count's median is the middle pair's mean
    ([None, None], None, None, None, 0),
    ([], None, None, None, 0),
])
def test_summaries_over_repeats_skip_missing_values(values, median, low, high, n):
    """summarize_repeats gives median, min, max over the present values, n counts them, values keeps every repeat."""
    assert summarize_repeats(values) == {"median": median, "min": low, "max": high, "n": n, "values": values}


def test_ratios_and_differences_pair_repeat_i_with_the_baselines_repeat_i():
    """Pairs go by index, not by rank; a pair with a missing side or a zero baseline has no ratio."""
    ratios = ratio_summary([2.0, 3.0, None, 4.0], [1.0, 2.0, 1.0, 0.0])
    assert ratios["values"] == [2.0, 1.5, None, None]
    assert (ratios["median"], ratios["min"], ratios["max"], ratios["n"]) == (1.75, 1.5, 2.0, 2)
    assert difference_summary([2.0, 3.0], [1.5, 3.5])["values"] == [0.5, -0.5]
    with pytest.raises(ValueError, match="pair by index"):
        ratio_summary([1.0, 2.0], [1.0])


@pytest.mark.parametrize("candidate, baseline, higher_is_better, expected", [
    ([10, 11, 12], [13, 14, 15], False, "better"),         # lower latency, ranges apart
    ([10, 11, 12], [13, 14, 15], True, "worse"),           # lower throughput, ranges apart
    ([16, 17, 18], [13, 14, 15], True, "better"),
    ([16, 17, 18], [13, 14, 15], False, "worse"),
    ([10, 11, 14], [13, 14, 15], False, "no difference"),  # overlapping ranges: inside the spread
    ([10, 12, 13], [13, 14, 15], True, "no difference"),   # touching ends overlap
    ([9, 20, 21], [13, 14, 15], False, "no difference"),   # one range inside the other
    ([None, 10], [13, None], False, "better"),             # missing repeats are skipped
    ([None], [13, 14], False, None),                       # nothing to compare
])
def test_verdict_calls_a_difference_only_when_the_ranges_do_not_overlap(candidate, baseline, higher_is_better,
                                                                          expected):
    """verdict: better / worse only with disjoint [min, max] ranges, in the metric's direction; else no difference."""
    assert verdict(candidate, baseline, higher_is_better) == expected
    assert verdict(summarize_repeats(candidate), summarize_repeats(baseline), higher_is_better) == expected


def test_spreads_format_as_median_and_range():
    """format_spread writes `median (min–max)` scaled, a lone value for one repeat and a dash for none."""
    assert format_spread(summarize_repeats([0.030, 0.028, 0.031]), scale=1000.0) == "30.0 (28.0–31.0)"
    assert format_spread(summarize_repeats([1.05, 1.02, 1.08]), fmt="{:.2f}", suffix="×") == "1.05× (1.02–1.08)"
    assert format_spread(summarize_repeats([0.002, -0.001, 0.003]), 1000.0, "{:+.1f}") == "+2.0 (-1.0–+3.0)"
    assert format_spread(summarize_repeats([0.5])) == "0.5"
    assert format_spread(summarize_repeats([None])) == "–" and format_spread(None) == "–"


def _runner(outputs: dict[str, str | None]):
    """A runner answering each command by its first two words (None: the tool is missing or failed)."""
    calls = []

    def run(argv):
        calls.append(list(argv))
        key = argv[0] if argv[0] != "git" else f"git {argv[3]}"
        return outputs.get(key)
    return run, calls


NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def test_provenance_records_commit_versions_gpu_host_command_and_time():
    """provenance takes the commit from git, the GPUs from nvidia-smi's CSV, versions by distribution, the argv
    joined with shlex and the UTC time, all through injected runners."""
    run, calls = _runner({"git rev-parse": "abc123\n", "git status": "",
                          "nvidia-smi": "NVIDIA H200, 570.86.15, 143771 MiB\nNVIDIA H200, 570.86.15, 143771 MiB\n"})
    versions = {"vllm": "0.29.0", "ray": "2.60.0"}
    argv = ["python3", "-m", "kvtide.benchmarks.overhead", "--set", "model=/tmp/my model"]
    prov = provenance(argv, run=run, version_of=lambda names: versions.get(names[0]), now=lambda: NOW,
                      environ={})
    assert prov["kvtide_commit"] == "abc123"
    assert prov["versions"]["vllm"] == "0.29.0" and prov["versions"]["torch"] is None and prov["versions"]["python"]
    assert prov["gpu"] == [{"name": "NVIDIA H200", "driver_version": "570.86.15", "memory_total": "143771 MiB"}] * 2
    assert shlex.split(prov["command"]) == argv
    assert prov["utc"] == "2030-01-02T03:04:05+00:00"
    assert {"system", "machine", "cpu_count"} <= set(prov["host"])
    assert ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"] in calls
    text = provenance_markdown(prov)
    assert "kvtide commit: abc123" in text and "torch not installed" in text and "NVIDIA H200 (143771 MiB" in text


@pytest.mark.parametrize("status, commit", [
    (" M cluster/app.py\n", "abc123-dirty"),                      # a tracked file changed
    ("?? cluster/new_module.py\n", "abc123-dirty"),               # new source not committed
    ("?? benchmarks/results/overhead-cpu/\n", "abc123"),          # benchmark output is not source
    (None, "abc123-unknown-tree"),                                # git could not say: not claimed clean
])
def test_a_tree_that_differs_from_its_commit_is_marked(status, commit):
    """The commit carries "-dirty" for changed tracked or untracked source files, not for benchmark output."""
    run, _ = _runner({"git rev-parse": "abc123\n", "git status": status})
    assert provenance(["x"], run=run, version_of=lambda names: None, now=lambda: NOW, environ={})[
        "kvtide_commit"] == commit


def test_without_git_or_nvidia_smi_provenance_says_so():
    """No checkout: the commit comes from KVTIDE_COMMIT (a staged wheel) or is None; no nvidia-smi: gpu None;
    gpu_info given by the caller is used as is."""
    run, calls = _runner({})
    prov = provenance(["x"], run=run, version_of=lambda names: None, now=lambda: NOW, environ={})
    assert prov["kvtide_commit"] is None and prov["gpu"] is None
    assert "GPU: none (no nvidia-smi)" in provenance_markdown(prov)
    given = [{"name": "NVIDIA H100 80GB HBM3", "driver_version": "1", "memory_total": "81559 MiB"}]
    calls.clear()
    prov = provenance(["x"], given, run=run, version_of=lambda names: None, now=lambda: NOW,
                      environ={"KVTIDE_COMMIT": "def456"})
    assert prov["kvtide_commit"] == "def456" and prov["gpu"] == given
    assert not any(call[0] == "nvidia-smi" for call in calls)


def test_engine_configs_are_compared_field_by_field_against_the_baseline():
    """engine_config_differences names each differing field; equal is None when nothing could be compared."""
    base = {"max_num_batched_tokens": 8192, "block_size": 16}
    assert engine_config_differences({"kvtide": dict(base), "vllm": base}, "vllm") == (True, [])
    equal, differences = engine_config_differences(
        {"kvtide": {**base, "max_num_batched_tokens": 2048}, "ray": None, "vllm": base}, "vllm")
    assert equal is False and differences == ["kvtide.max_num_batched_tokens: 2048 vs vllm 8192"]
    assert engine_config_differences({"kvtide": base, "vllm": None}, "vllm") == (None, [])
    assert engine_config_differences({"vllm": base}, "vllm") == (None, [])
