"""The autoscaling benchmark's summary of a step-load run (pure, from recorded samples)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtide.benchmarks.autoscale import (
    VARIANT_KEYS, Load, Probe, RunResult, Sample, Trace, count_slo_violations, error_kinds, kv_mean,
    kv_usage_by_replica,
    load_variant_config, main, markdown, new_replica_probes, out_dir_of, replica_seconds, results_json,
    saturation_onset, start_phases_by_replica,
    scale_times, serving_replicas, summarize_run, timeline, variant_overrides, write_timeline_plot,
)
from kvtide.config import load_config


TRACE = Trace(low_s=10, high_s=20, tail_s=10)


def _run(variant: str = "kv") -> RunResult:
    result = RunResult(variant)
    # One replica ("old") until t=18 (decision at 14: target 2), two running ("old", "new") from 18 to 30.
    result.samples = [Sample(float(t), 2 if 18 <= t < 30 else 1, 2 if 14 <= t < 30 else 1,
                             ("old", "new") if 14 <= t < 30 else ("old",),
                             {"old": 0.9, "new": 0.1} if 18 <= t < 30 else {"old": 0.5})
                      for t in range(40)]
    result.probes = [Probe(1.0, 0.02, "old", "low"), Probe(12.0, 0.5, "old", "high"),
                     Probe(19.0, 0.03, "new", "high"), Probe(20.0, 0.04, "new", "high"),
                     Probe(25.0, 1.5, "old", "high"), Probe(32.0, None, "", "tail", "HTTP 503: busy")]
    result.loads = [Load(2.0, True, 0.2), Load(15.0, True, 2.5), Load(16.0, False, None, "HTTP 503: full"),
                    Load(17.0, True, None)]
    return result


def test_replica_seconds_and_scale_timings():
    """Replica-seconds integrate running replicas; decision and serving are timed from the load step."""
    summary = summarize_run(_run(), TRACE)
    assert summary["row"]["replica_seconds"] == 40 + 12
    assert summary["row"]["step_to_decision_s"] == 4.0
    assert summary["row"]["step_to_serving_s"] == 8.0
    assert summary["details"]["max_replicas_seen"] == 2


def test_saturation_onset_is_the_first_probe_after_the_step_that_waited():
    """Onset = first probe at/after the step over 5x the low median (0.1 s floor); decision is timed from it too."""
    probes = [Probe(9.0, 0.9, "old", "low"), Probe(10.5, 0.05, "old", "high"), Probe(11.0, 0.12, "old", "high"),
              Probe(11.5, 0.3, "old", "high")]
    assert saturation_onset(probes, 10.0, low_p50_s=0.02) == 1.0  # bar 0.1 s: 0.12 waited
    assert saturation_onset(probes, 10.0, low_p50_s=0.05) == 1.5  # bar 0.25 s
    assert saturation_onset([Probe(10.5, None, "", "high")], 10.0, 0.02) == 0.5  # a failure waited
    assert saturation_onset(probes[:2], 10.0, 0.02) is None
    details = summarize_run(_run(), TRACE)["details"]  # low p50 20 ms; the probe at 12 s took 0.5 s
    assert (details["saturation_onset_s"], details["saturation_to_decision_s"]) == (2.0, 2.0)


def test_start_phases_are_keyed_by_the_replica_through_the_kv_gauges_worker():
    """kvtide's start-phase gauge (labelled by WorkerId) is mapped to the ReplicaId its KV gauge names."""
    text = "\n".join([
        '# HELP ray_kvtide_engine_start_phase_seconds x',
        'ray_kvtide_engine_start_phase_seconds{WorkerId="w1",model="m",phase="import"} 9.5',
        'ray_kvtide_engine_start_phase_seconds{WorkerId="w1",model="m",phase="engine"} 18.25',
        'ray_kvtide_engine_start_phase_seconds{WorkerId="w2",model="m",phase="engine"} 3.0',
        'ray_vllm_kv_cache_usage_perc{ReplicaId="new",WorkerId="w1",engine="0"} 0.5',
    ])
    assert start_phases_by_replica(text) == {"new": {"import": 9.5, "engine": 18.25}, "w2": {"engine": 3.0}}
    result = _run()
    result.start_phases = {"new": {"import": 9.5, "engine": 18.25}}
    summary = summarize_run(result, TRACE)
    assert summary["details"]["new_replica_start_phases_s"] == {"import": 9.5, "engine": 18.25}
    text = markdown([summary["row"]], {"kv": summary["details"]}, Trace(), command="c", hardware="CPU",
                    config_desc="c")
    assert "- kv: import 9.5 s, engine 18.2 s" in text


def test_replica_seconds_uses_the_real_sample_spacing():
    """Each sample holds until the next one (polls are not exactly 1 s apart); the last until the end."""
    samples = [Sample(0.0, 1, 1), Sample(1.5, 2, 2), Sample(4.0, 1, 1)]
    assert replica_seconds(samples, end_s=5.0) == pytest.approx(1.5 + 2 * 2.5 + 1.0)
    assert replica_seconds([], end_s=5.0) == 0.0


def test_scale_times_are_relative_to_the_count_at_the_step():
    """A fleet that starts at 2 replicas scales up when its target passes 2, not when it reaches 2."""
    samples = [Sample(float(t), 2 if t < 15 else 3, 2 if t < 12 else 3) for t in range(20)]
    assert scale_times(samples, 10.0) == (2.0, 5.0)
    assert scale_times([Sample(float(t), 1, 1) for t in range(20)], 10.0) == (None, None)


def test_with_a_standby_the_decision_is_the_wake_and_serving_is_its_first_running_request():
    """A standby live before the step is not "serving"; the wake is a decision (standbys leave the count)."""
    samples = [Sample(float(t), 2, 2, ("a", "s"), {}, ("s",) if t < 12 else (),
                      {"a": 3.0, "s": 1.0 if t >= 14 else 0.0}) for t in range(20)]
    assert scale_times(samples, 10.0) == (2.0, 4.0)
    # The woken standby's first probes count as the new replica's.
    probes = [Probe(5.0, 0.02, "a", "low"), Probe(15.0, 0.03, "s", "high")]
    assert new_replica_probes(probes, samples, step_s=10.0) == ("s", [0.03])


def test_serving_counts_only_replicas_that_did_not_serve_before_the_step():
    """A replica running requests before the step is old; the new one serving is the first that was not."""
    samples = [Sample(float(t), 2 if t < 16 else 3, 3, ("a", "b"), {}, (),
                      {"a": 1.0, "b": 1.0, **({"c": 2.0} if t >= 17 else {})}) for t in range(20)]
    assert scale_times(samples, 10.0) == (None, 7.0)


def test_new_replica_first_probes_and_phase_percentiles():
    """The probes served by a replica not live before the step are the new replica's TTFTs."""
    summary = summarize_run(_run(), TRACE)
    assert summary["details"]["new_replica"] == "new"
    assert summary["details"]["new_replica_hot_ttft_s"] == [0.03, 0.04]
    assert summary["row"]["new_replica_hot_ttft_p50_ms"] == pytest.approx(35.0)
    assert summary["details"]["probe_ttft_by_phase_s"]["low"]["n"] == 1
    assert summary["details"]["probe_errors"] == 1


def test_new_replica_probes_takes_the_first_n_in_send_order():
    """Only the first N probes the new replica served count, ordered by send time, failures skipped."""
    probes = [Probe(float(t), t / 1000, "b", "high") for t in range(30, 10, -1)]
    probes += [Probe(5.0, 0.01, "a", "low"), Probe(12.5, None, "", "high")]
    new, ttfts = new_replica_probes(probes, [Sample(1.0, 1, 1, ("a",))], step_s=10.0, n=3)
    assert (new, ttfts) == ("b", [0.011, 0.012, 0.013])


def test_a_replica_live_before_the_step_is_not_new():
    """A replica that was live before the step but got its first probe after it is an old one."""
    samples = [Sample(1.0, 2, 2, ("a", "b")), Sample(12.0, 3, 3, ("a", "b", "c"))]
    probes = [Probe(2.0, 0.01, "a", "low"), Probe(11.0, 0.02, "b", "high"), Probe(13.0, 0.03, "c", "high")]
    assert new_replica_probes(probes, samples, step_s=10.0) == ("c", [0.03])
    assert new_replica_probes(probes[:2], samples, step_s=10.0) == ("", [])


def test_slo_violations_count_late_failed_and_tokenless_requests():
    """Load and probe requests past the SLO, failed, or without a token are violations; on-time ones are not."""
    result = _run()
    # load: 2.5 s late, failed, tokenless; probes: 1.5 s late, failed.
    assert count_slo_violations(result.loads, result.probes, 1.0) == 5
    assert count_slo_violations(result.loads, result.probes, 3.0) == 3
    assert summarize_run(result, TRACE, slo_ttft_s=1.0)["row"]["slo_violations"] == 5
    assert summarize_run(result, TRACE)["row"]["errors"] == 2


def test_error_kinds_count_failed_requests_by_message():
    """Failed load and probe requests are counted by their (cut) message; successes are not."""
    assert error_kinds(_run().loads + _run().probes, width=8) == {"HTTP 503": 2}
    assert error_kinds([Load(1.0, False, None)]) == {"unknown": 1}
    assert summarize_run(_run(), TRACE)["details"]["error_kinds"] == {"HTTP 503: full": 1, "HTTP 503: busy": 1}


def test_fixed_max_reports_no_scale_decision_nor_new_replica():
    """A fleet without autoscaling has null decision, serving and new-replica figures, the rest as usual."""
    row = summarize_run(_run("fixed-max"), TRACE, autoscaled=False)["row"]
    assert row["step_to_decision_s"] is None and row["step_to_serving_s"] is None
    assert row["new_replica_hot_ttft_p50_ms"] is None
    assert row["replica_seconds"] == 52 and row["errors"] == 2


def test_variant_rows_have_exactly_the_issue_keys():
    """The variant object summarize_run returns carries exactly the keys issues 13 and 34 name, nothing else."""
    assert tuple(summarize_run(_run(), TRACE)["row"]) == VARIANT_KEYS
    assert VARIANT_KEYS == ("variant", "step_to_decision_s", "decision_to_serving_s", "step_to_serving_s",
                            "new_replica_hot_ttft_p50_ms", "replica_seconds", "slo_violations", "errors")


def test_results_json_shape_keeps_extras_out_of_variants():
    """autoscale.json has "hardware" and "variants" (issue keys only); extras sit at the top level."""
    row = {**summarize_run(_run(), TRACE)["row"], "stray": 1}
    data = results_json(hardware="NVIDIA H200", variants=[row], trace={"low_s": 10})
    assert data["hardware"] == "NVIDIA H200"
    assert list(data["variants"][0]) == list(VARIANT_KEYS)
    assert data["trace"] == {"low_s": 10}
    json.dumps(data)  # plain JSON
    with pytest.raises(ValueError, match="lacks"):
        results_json(hardware="x", variants=[{"variant": "kv"}])


def test_kv_usage_parsed_per_replica_from_prometheus_text():
    """The KV gauge is read per ReplicaId (max over its series); other metrics and comments are skipped."""
    text = "\n".join([
        "# HELP ray_vllm_kv_cache_usage_perc KV-cache usage.",
        "# TYPE ray_vllm_kv_cache_usage_perc gauge",
        'ray_vllm_kv_cache_usage_perc{ReplicaId="r1",engine="0",model_name="demo"} 0.25',
        'ray_vllm_kv_cache_usage_perc{ReplicaId="r1",engine="1",model_name="demo"} 0.5',
        'ray_vllm_kv_cache_usage_perc{ReplicaId="r2",model_name="demo"} 1.0 1700000000000',
        'ray_vllm_kv_cache_usage_perc_other{ReplicaId="r3"} 0.9',
        'ray_vllm_num_requests_running{ReplicaId="r1"} 3.0',
    ])
    assert kv_usage_by_replica(text) == {"r1": 0.5, "r2": 1.0}
    assert kv_usage_by_replica("vllm_x 1") == {}


def test_kv_mean_over_live_replicas_drops_stale_series():
    """The KV mean covers live replicas only (a stopped one's lingering value is left out); all if unknown."""
    assert kv_mean({"a": 0.2, "b": 0.4, "gone": 1.0}, ("a", "b")) == pytest.approx(0.3)
    assert kv_mean({"a": 0.2, "b": 0.4}, ()) == pytest.approx(0.3)
    assert kv_mean({}, ("a",)) is None


def test_timeline_lists_what_the_plot_shows():
    """The timeline has per-sample replicas and KV mean, and per-probe send time and TTFT."""
    tl = timeline(_run())
    assert len(tl["t_s"]) == len(tl["running"]) == len(tl["kv_mean"]) == 40
    assert tl["kv_mean"][0] == 0.5 and tl["kv_mean"][20] == pytest.approx(0.5)
    assert tl["probe_ttft_s"][-1] is None and tl["probe_replica"][2] == "new"


def test_serving_replicas_leave_out_the_standbys_ray_counts_as_running():
    """The plot's replica count is Ray's running replicas less the standbys; a timeline without standbys is all serving."""
    assert serving_replicas({"running": [2, 2, 2, 3], "standby": [1, 1, 0, 1]}) == [1, 1, 2, 2]
    assert serving_replicas({"running": [1, 2]}) == [1, 2]


def test_timeline_plot_is_written(tmp_path: Path):
    """timeline.png is written from the timelines (matplotlib Agg, no display)."""
    path = write_timeline_plot({"kv": timeline(_run()), "fixed-max": timeline(_run("fixed-max"))}, TRACE,
                               tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_variant_overrides_make_fixed_max_a_fixed_fleet_of_max_replicas():
    """fixed-max turns autoscaling off at the config's max; the other variants pick their policy."""
    base = ["replicas.num_replicas=null", "replicas.min_replicas=1", "replicas.max_replicas=3"]
    fixed = load_config(None, [*base, *variant_overrides("fixed-max", 3)])
    assert not fixed.replicas.autoscaling and fixed.replicas.num_replicas == 3
    queue = load_config(None, [*base, *variant_overrides("queue_length", 3, 8)])
    assert queue.autoscaling.policy == "queue_length" and queue.autoscaling.target_ongoing_requests == 8
    cold = load_config(None, [*base, *variant_overrides("kv-cold", 3)])
    assert cold.autoscaling.policy == "kv" and not cold.autoscaling.warm_start.enabled
    with pytest.raises(ValueError, match="unknown variant"):
        variant_overrides("nope", 3)


def test_variant_config_from_a_given_config_and_sets(tmp_path: Path):
    """--config and --set make the shared config; fixed-max reads max_replicas from it; a fixed one is refused."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("replicas:\n  min_replicas: 1\n  max_replicas: 4\n")
    config = load_variant_config(str(cfg), ["replicas.max_replicas=3"], "fixed-max", 8123, 2.0)
    assert config.replicas.num_replicas == 3 and config.http.port == 8123
    cfg.write_text("replicas:\n  num_replicas: 1\n")
    with pytest.raises(SystemExit, match="must autoscale"):
        load_variant_config(str(cfg), [], "kv", 8123, 2.0)


def test_out_alias_names_a_directory():
    """--out-dir wins; the old --out FILE.md names the directory FILE, a plain --out DIR is that DIR."""
    assert out_dir_of("d", "x.md") == Path("d")
    assert out_dir_of(None, "results/autoscale.md") == Path("results/autoscale")
    assert out_dir_of(None, "results/as") == Path("results/as")
    assert out_dir_of(None, None) is None


def test_unknown_variant_is_refused_before_any_cluster_starts():
    """--variants with an unknown name fails in argument parsing."""
    with pytest.raises(SystemExit):
        main(["--variants", "kv,bogus"])


def test_warm_caches_starts_the_max_fleet_once_before_any_variant(monkeypatch, tmp_path):
    """--warm-caches: one unmeasured start of the fixed-max config, before the first variant runs."""
    import kvtide.benchmarks.autoscale as bench

    calls = []
    monkeypatch.setattr(bench, "warm_caches", lambda config, _ms: calls.append(("warm", config.replicas.num_replicas)))
    monkeypatch.setattr(bench, "run_variant", lambda variant, *_: calls.append((variant,)) or _run(variant))
    assert main(["--variants", "kv,queue_length", "--warm-caches", "--out-dir", str(tmp_path)]) == 0
    assert calls == [("warm", 2), ("kv",), ("queue_length",)]  # the CPU demo's max fleet: 2 replicas
    assert main(["--variants", "kv", "--out-dir", str(tmp_path)]) == 0 and ("warm", 2) not in calls[3:]


def test_markdown_has_one_row_per_variant():
    """The report table carries a row per variant: replica-seconds, timings, new replica's p50 (n), SLO misses."""
    s = summarize_run(_run(), TRACE)
    text = markdown([s["row"]], {"kv": s["details"]}, Trace(), command="cmd", hardware="CPU", config_desc="c",
                    plot="timeline.png")
    assert "| kv | 52 | 2 | 4 | 2 | 4.0 | 8 | 35 (2) | 5 / 10 |" in text
    assert "![timeline](timeline.png)" in text


@pytest.mark.parametrize("status, rejected", [(200, False), (503, False), (400, True)])
def test_the_preflight_probe_fails_the_variant_only_when_the_server_rejects_the_probe(status, rejected):
    """A 4xx for the hot-prefix probe (e.g. longer than max_model_len) stops the variant, naming the server's reason."""
    import asyncio

    import httpx

    from kvtide.benchmarks.autoscale import preflight

    transport = httpx.MockTransport(lambda request: httpx.Response(status, text="maximum context length is 8192"))

    async def go() -> None:
        async with httpx.AsyncClient(base_url="http://engine", transport=transport) as client:
            await preflight(client, "m", "hot prefix")

    if rejected:
        with pytest.raises(ValueError, match="HTTP 400.*maximum context length"):
            asyncio.run(go())
    else:
        asyncio.run(go())
