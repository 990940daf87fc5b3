"""The scale-down episode's summaries: when the decision came, who left, hit rate and TTFT around it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtide.benchmarks import scale_down
from kvtide.benchmarks.scale_down import (Request, Episode, decision_time, groups_last_served_by, markdown, merge_into,
                                          next_group, removed_replica, summarize, window_stats, zipf_weights)

REPO = Path(__file__).resolve().parents[2]


def test_zipf_weights_sum_to_one_and_fall_with_rank():
    """Group g's share is ∝ 1/(g+1)^s."""
    w = zipf_weights(4, 1.0)
    assert sum(w) == pytest.approx(1.0) and w == sorted(w, reverse=True)
    assert w[0] / w[1] == pytest.approx(2.0)


@pytest.mark.parametrize("samples, decided, removed", [
    # Ray's choice: Serve's count drops and "b" leaves the live set.
    ([(0.0, 3, ("a", "b", "c"), ()), (5.0, 3, ("a", "b", "c"), ()), (6.0, 2, ("a", "b", "c"), ()),
      (8.0, 2, ("a", "c"), ())], 6.0, "b"),
    # kvtide's choice: the count holds, "c" becomes a standby.
    ([(0.0, 3, ("a", "b", "c"), ()), (6.0, 3, ("a", "b", "c"), ("c",))], 6.0, "c"),
    # No scale-down.
    ([(0.0, 3, ("a", "b", "c"), ()), (6.0, 3, ("a", "b", "c"), ())], None, ""),
])
def test_the_decision_is_one_active_replica_fewer_and_the_removed_one_is_named(samples, decided, removed):
    """Active = target less standbys; the replica that left routing is the one gone or set aside."""
    assert decision_time(samples) == decided
    assert (removed_replica(samples, decided) if decided is not None else "") == removed


def test_window_stats_are_hit_rate_and_ttft_p90_of_requests_sent_inside():
    """Cached / prompt tokens and the 90th percentile latency over the window; failures count as errors."""
    requests = [Request(1.0, True, 0.1, "a", 100, 90), Request(2.0, True, 0.3, "b", 100, 0),
                Request(3.0, False, None), Request(20.0, True, 9.0, "a", 100, 100)]
    stats = window_stats(requests, 0.0, 10.0)
    assert stats["hit_rate"] == pytest.approx(0.45) and stats["requests"] == 3 and stats["errors"] == 1
    assert 100 < stats["ttft_p90_ms"] <= 300


def test_window_stats_count_the_requests_that_prefilled_their_group_anew_and_the_groups_drawn():
    """A re-prefill found under half its prompt cached; groups are the distinct groups sent in the window."""
    requests = [Request(1.0, True, 0.1, "a", 100, 90, group=0), Request(2.0, True, 0.3, "b", 100, 49, group=1),
                Request(3.0, True, 0.1, "b", 100, 50, group=1), Request(4.0, False, None, group=2),
                Request(20.0, True, 0.3, "a", 100, 0, group=3)]
    stats = window_stats(requests, 0.0, 10.0)
    assert stats["reprefills"] == 1 and stats["groups"] == 3


def test_summary_names_the_removed_replicas_share_of_hits_before(tmp_path):
    """The share of hit tokens the removed replica served before the decision, and the file merge keeps variants."""
    episode = Episode("ray", [Request(1.0, True, 0.1, "a", 100, 80), Request(2.0, True, 0.1, "b", 100, 20),
                              Request(12.0, True, 0.2, "a", 100, 10)],
                      [(0.0, 3, ("a", "b", "c"), ()), (10.0, 2, ("b", "c"), ())])
    row = summarize(episode, window_s=10.0)
    assert row["decision_s"] == 10.0 and row["removed_replica"] == "a"
    assert row["removed_share_of_hits_before"] == pytest.approx(0.8) and row["hit_rate"] == pytest.approx(0.1)
    (tmp_path / "autoscale.json").write_text(json.dumps({"hardware": "H200", "variants": [{"variant": "kv"}]}))
    data = json.loads(merge_into(tmp_path, "H200", {"ray": row}, {}).read_text())
    assert data["variants"] == [{"variant": "kv"}] and data["scale_down"]["ray"]["removed_replica"] == "a"


def test_groups_last_served_by_a_replica_follow_each_groups_latest_request():
    """A group belongs to the replica that served its latest successful request; failures don't move it."""
    requests = [Request(1.0, True, 0.1, "a", group=0), Request(2.0, True, 0.1, "b", group=1),
                Request(3.0, True, 0.1, "b", group=0), Request(4.0, False, None, group=1),
                Request(5.0, True, 0.1, "a", group=2)]
    assert groups_last_served_by(requests, "b") == [0, 1]
    assert groups_last_served_by(requests, "a") == [2] and groups_last_served_by(requests, "c") == []


def test_the_load_takes_every_group_once_then_zipf_then_only_the_kept_groups():
    """The first pass caches every prompt; after a shift only kept groups are drawn."""
    rng = random.Random(0)
    weights = zipf_weights(4, 1.1)
    assert [next_group(i, rng, weights, None) for i in range(4)] == [0, 1, 2, 3]
    assert {next_group(i, rng, weights, [1, 3]) for i in range(200)} == {1, 3}
    assert {next_group(i, rng, weights, None) for i in range(4, 400)} == {0, 1, 2, 3}


def test_after_a_shift_the_kept_groups_keep_their_zipf_weights_or_are_drawn_alike():
    """Zipf after the shift favours the kept group of best rank; uniform gives each kept group about as many draws."""
    weights = zipf_weights(18, 1.1)
    rng = random.Random(1)
    zipf = [next_group(i, rng, weights, [0, 17]) for i in range(2000)]
    uniform = [next_group(i, rng, weights, [0, 17], kept_uniform=True) for i in range(2000)]
    assert zipf.count(0) > 0.9 * len(zipf)
    assert 0.4 * len(uniform) < uniform.count(17) < 0.6 * len(uniform)


def test_the_report_names_the_shift_and_who_was_removed():
    """With a shift the markdown says when, which groups stayed, Ray's would-be victim and the removed replica."""
    row = {"decision_s": 60.0, "hit_rate": 0.99, "ttft_p90_ms": 30.0, "hit_rate_before": 0.9, "ttft_p90_before_ms": 30.0,
           "removed_share_of_hits_before": 0.1, "requests": 60, "errors": 0, "removed_replica": "a",
           "shift": {"at_s": 30.0, "ray_victim": "c", "kept_groups": [2, 5]}}
    text = markdown({"cache_aware": row}, "cmd", 60.0)
    assert "groups [2, 5]" in text and "`c`" in text and "removed: `a`" in text
    assert "| 60 | 0 |" in text  # a row without the re-prefill counts (an older run's) keeps its columns
    text = markdown({"ray": {**row, "reprefills_after": 7, "groups_after": 2}}, "cmd", 60.0)
    assert "| 60 (7, 2) | 0 |" in text


def test_main_writes_each_choosers_row_and_its_requests(tmp_path, monkeypatch):
    """main runs each chooser, writes autoscale.json (rows, and every request as a record) and scale_down.md."""
    def fake_episode(chooser, config, args):
        assert config.autoscaling.scale_down_chooser == chooser
        return Episode(chooser, [Request(1.0, True, 0.1, "a", 100, 80, group=0),
                                 Request(12.0, True, 0.2, "b", 100, 0, group=3)],
                       [(0.0, 3, ("a", "b", "c"), ()), (10.0, 2, ("b", "c"), ())])

    monkeypatch.setattr(scale_down, "run_episode", fake_episode)
    assert scale_down.main(["--config", str(REPO / "config/presets/cpu.yaml"), "--window-s", "10",
                            "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "autoscale.json").read_text())
    assert set(data["scale_down"]) == {"cache_aware", "ray"}
    assert data["scale_down"]["ray"]["reprefills_after"] == 1 and data["scale_down"]["ray"]["groups_after"] == 1
    assert data["scale_down_details"]["requests"]["ray"][1] == [12.0, True, 0.2, "b", 100, 0, 3]
    assert "| ray |" in (tmp_path / "scale_down.md").read_text()
