"""kvtide's alert rules fire on the series that should fire them and stay silent otherwise.

Each enabled rule has a firing and a quiet case of synthetic series below; the test writes
a `promtool test rules` file for them and runs Prometheus's own promtool (Debian package
`prometheus`) on both the plain rule file and the chart's copy (KVTIDE_SELECTOR replaced
by a job matcher, the series carrying that job). Annotations are checked by
`promtool check rules` (template syntax) and left out of the alert comparison, where
promtool would require their rendered text verbatim.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtide.dashboards import alerts
from kvtide.dashboards.promql import Selectors

PROMTOOL = shutil.which("promtool")
JOB = "llm/demo-kvtide"
RUNBOOKS = alerts.REPO_ROOT / "docs" / "runbooks.md"

M = 'model="demo"'
R1 = 'model_name="demo",engine="0",ReplicaId="r1"'
ENG = 'deployment="Engine",application="kvtide"'
PRED = "ray_kvtide_router_predictions_total"


def _bucket(name: str, labels: str, counts: dict[str, str]) -> list[dict[str, str]]:
    return [{"series": f'{name}_bucket{{{labels},le="{le}"}}', "values": values} for le, values in counts.items()]


# alert -> (firing series, expected alert labels, quiet series). Values: promtool's expanding notation,
# 1m steps, 51 samples: all still fresh at EVAL_TIME.
CASES: dict[str, tuple[list[dict[str, str]], dict[str, str], list[dict[str, str]]]] = {
    "KvtideNoReadyReplicas": (
        [{"series": f'ray_serve_deployment_replica_healthy{{{ENG},replica="a"}}', "values": "0x50"},
         {"series": f"ray_serve_autoscaling_target_replicas{{{ENG}}}", "values": "2x50"}],
        {},
        [{"series": f'ray_serve_deployment_replica_healthy{{{ENG},replica="a"}}', "values": "1x50"},
         {"series": f'ray_serve_deployment_replica_healthy{{{ENG},replica="b"}}', "values": "0x50"},
         {"series": f"ray_serve_autoscaling_target_replicas{{{ENG}}}", "values": "2x50"}],
    ),
    "KvtideHighServerErrorRate": (
        [{"series": f'ray_kvtide_requests_total{{{M},endpoint="chat",status="200"}}', "values": "0+60x50"},
         {"series": f'ray_kvtide_requests_total{{{M},endpoint="chat",status="503"}}', "values": "0+20x50"}],
        {"model": "demo"},
        # Only client errors: not a server problem.
        [{"series": f'ray_kvtide_requests_total{{{M},endpoint="chat",status="200"}}', "values": "0+60x50"},
         {"series": f'ray_kvtide_requests_total{{{M},endpoint="chat",status="400"}}', "values": "0+60x50"}],
    ),
    "KvtideTTFTAboveSLO": (
        _bucket("ray_kvtide_time_to_first_token_seconds", f'{M},endpoint="chat"',
                {"1.0": "0x50", "2.5": "0x50", "5.0": "0+10x50", "+Inf": "0+10x50"}),
        {"model": "demo"},
        _bucket("ray_kvtide_time_to_first_token_seconds", f'{M},endpoint="chat"',
                {"0.25": "0x50", "0.5": "0+10x50", "1.0": "0+10x50", "+Inf": "0+10x50"}),
    ),
    "KvtideKVCacheSaturated": (
        [{"series": f"ray_vllm_kv_cache_usage_perc{{{R1}}}", "values": "0.99x50"}],
        {"model_name": "demo", "ReplicaId": "r1"},
        # High but with relief every 10 minutes: not sustained for 15.
        [{"series": f"ray_vllm_kv_cache_usage_perc{{{R1}}}", "values": " ".join(["0.99x8 0.5"] * 6)}],
    ),
    "KvtideSustainedPreemptions": (
        [{"series": f"ray_vllm_num_preemptions_total{{{R1}}}", "values": "0+30x50"},
         {"series": f"ray_vllm_num_requests_running{{{R1}}}", "values": "8x50"}],
        {"model_name": "demo", "ReplicaId": "r1"},
        # No preemption ever (the counter does not exist): the signal reads 0.
        [{"series": f"ray_vllm_num_requests_running{{{R1}}}", "values": "8x50"}],
    ),
    "KvtideAutoscalerPinnedAtMax": (
        [{"series": f'ray_kvtide_autoscaler_decisions_total{{{ENG},reason="bounds"}}', "values": "0+1x50"},
         {"series": f"ray_kvtide_autoscaler_kv_usage_perc{{{ENG}}}", "values": "0.9x50"},
         {"series": f"ray_kvtide_autoscaler_num_waiting{{{ENG}}}", "values": "0x50"}],
        {"application": "kvtide", "deployment": "Engine"},
        # Clamped, but at min_replicas on slack: no pressure.
        [{"series": f'ray_kvtide_autoscaler_decisions_total{{{ENG},reason="bounds"}}', "values": "0+1x50"},
         {"series": f"ray_kvtide_autoscaler_kv_usage_perc{{{ENG}}}", "values": "0.1x50"},
         {"series": f"ray_kvtide_autoscaler_num_waiting{{{ENG}}}", "values": "0x50"}],
    ),
    "KvtideRouterLoadFallbackHigh": (
        [{"series": 'ray_kvtide_router_decisions_total{policy="prefix_aware",outcome="load_fallback"}',
          "values": "0+90x50"},
         {"series": 'ray_kvtide_router_decisions_total{policy="prefix_aware",outcome="cache_hit"}', "values": "0+10x50"}],
        {"policy": "prefix_aware"},
        [{"series": 'ray_kvtide_router_decisions_total{policy="prefix_aware",outcome="load_fallback"}',
          "values": "0+10x50"},
         {"series": 'ray_kvtide_router_decisions_total{policy="prefix_aware",outcome="cache_hit"}', "values": "0+90x50"}],
    ),
    "KvtideRouterDigestStale": (
        # One replica's digests stopped coming: its age climbs a minute per minute.
        [{"series": 'ray_kvtide_router_digest_age_seconds{replica="r1"}', "values": "0.5+60x50"},
         {"series": 'ray_kvtide_router_digest_age_seconds{replica="r2"}', "values": "0.8x50"}],
        {"replica": "r1"},
        # Fresh digests, one replica with a single late push (one sample, not a minute).
        [{"series": 'ray_kvtide_router_digest_age_seconds{replica="r1"}', "values": " ".join(["0.9x8 10"] * 5)},
         {"series": 'ray_kvtide_router_digest_age_seconds{replica="r2"}', "values": "1.5x50"}],
    ),
    "KvtideRouterIndexPrecisionLow": (
        # 20 % of 10 predicted hits a minute confirmed.
        [{"series": f'{PRED}{{{M},outcome="true_hit"}}', "values": "0+2x50"},
         {"series": f'{PRED}{{{M},outcome="false_hit"}}', "values": "0+8x50"},
         {"series": f'{PRED}{{{M},outcome="true_miss"}}', "values": "0+30x50"}],
        {"model": "demo"},
        # 90 % confirmed; misses on either side do not count against precision.
        [{"series": f'{PRED}{{{M},outcome="true_hit"}}', "values": "0+9x50"},
         {"series": f'{PRED}{{{M},outcome="false_hit"}}', "values": "0+1x50"},
         {"series": f'{PRED}{{{M},outcome="missed_hit"}}', "values": "0+30x50"}],
    ),
}
EVAL_TIME = "40m"  # past every rule's `for` plus its window


def _with_job(series: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{**s, "series": s["series"].replace("{", f'{{job="{JOB}",', 1)} for s in series]


def _strip_annotations(text: str) -> dict[str, Any]:
    doc = yaml.safe_load(text)
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    return doc


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    assert PROMTOOL, "promtool missing: apt-get install -y --no-install-recommends prometheus"
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _enabled() -> list[alerts.AlertRule]:
    return alerts.rules(Selectors())


def test_every_enabled_rule_has_a_firing_and_a_quiet_case_and_a_runbook() -> None:
    """Adding a rule without promtool cases or a runbook section fails here."""
    runbook_headings = {line[3:].strip().lower() for line in RUNBOOKS.read_text().splitlines() if line.startswith("## ")}
    for rule in _enabled():
        assert rule.name in CASES, f"add a firing and a quiet promtool case for {rule.name}"
        assert rule.name.lower() in runbook_headings, f"add '## {rule.name}' to docs/runbooks.md"
        assert rule.runbook_url.endswith("#" + rule.name.lower())


def test_generated_rule_files_are_current() -> None:
    """The committed plain rule file and the chart's alerts.yaml equal what alerts.py generates."""
    assert alerts.RULES_FILE.read_text() == alerts.rules_text(chart=False), "run: python -m kvtide.dashboards.build"
    assert alerts.CHART_RULES_FILE.read_text() == alerts.rules_text(chart=True), "run: python -m kvtide.dashboards.build"


def test_condition_free_signal_is_inside_every_expression() -> None:
    """Each rule's expr is its condition around its signal, so the integration test's signal check covers it."""
    for rule in _enabled():
        assert rule.signal and rule.signal in rule.expr, rule.name


@pytest.mark.parametrize("chart", [False, True], ids=["plain", "chart"])
def test_rule_files_pass_promtool_check(tmp_path: Path, chart: bool) -> None:
    """promtool accepts both files (PromQL and annotation templates), the chart's once Helm substitutes the job."""
    text = alerts.rules_text(chart=chart).replace(alerts.CHART_SELECTOR, f'job="{JOB}"')
    (tmp_path / "rules.yaml").write_text(text)
    result = _promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_enabled())} rules found" in result.stdout


@pytest.mark.parametrize("chart", [False, True], ids=["plain", "chart"])
def test_each_alert_fires_on_bad_series_and_not_on_good(tmp_path: Path, chart: bool) -> None:
    """promtool: every rule fires (with the expected labels) on its bad series and stays silent on the good."""
    text = alerts.rules_text(chart=chart).replace(alerts.CHART_SELECTOR, f'job="{JOB}"')
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_strip_annotations(text), sort_keys=False))
    severity = {r.name: r.severity for r in _enabled()}
    tests = []
    for rule in _enabled():
        firing, labels, quiet = CASES[rule.name]
        exp_labels = {"severity": severity[rule.name], **labels}
        prep = _with_job if chart else (lambda s: s)
        tests.append({"interval": "1m", "input_series": prep(firing), "alert_rule_test": [
            {"eval_time": EVAL_TIME, "alertname": rule.name, "exp_alerts": [{"exp_labels": exp_labels}]}]})
        tests.append({"interval": "1m", "input_series": prep(quiet), "alert_rule_test": [
            {"eval_time": EVAL_TIME, "alertname": rule.name, "exp_alerts": []}]})
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    result = _promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_ready_replicas_fires_when_nothing_is_scraped_but_not_on_scale_to_zero(tmp_path: Path) -> None:
    """An empty Prometheus pages (vector(0)); a deliberate target of 0 replicas does not."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_strip_annotations(alerts.rules_text()), sort_keys=False))
    name = "KvtideNoReadyReplicas"
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": [{"series": 'unrelated{a="b"}', "values": "1x50"}],
         "alert_rule_test": [{"eval_time": "10m", "alertname": name,
                              "exp_alerts": [{"exp_labels": {"severity": "critical"}}]}]},
        {"interval": "1m", "input_series": [
            {"series": f"ray_serve_autoscaling_target_replicas{{{ENG}}}", "values": "0x50"}],
         "alert_rule_test": [{"eval_time": "10m", "alertname": name, "exp_alerts": []}]},
    ]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    result = _promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _run_cases(tmp_path: Path, name: str, cases: list[tuple[list[dict[str, str]], list[dict[str, Any]]]]) -> None:
    """promtool: `name` at EVAL_TIME on each (input series, expected alerts) case, plain rule file."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_strip_annotations(alerts.rules_text()), sort_keys=False))
    tests = [{"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": EVAL_TIME, "alertname": name, "exp_alerts": expected}]} for series, expected in cases]
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    result = _promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_index_precision_needs_enough_predictions_and_fires_before_any_true_hit(tmp_path: Path) -> None:
    """Low precision over too few predicted hits stays silent; all-false hits (no true_hit series yet) fire."""
    firing = [{"exp_labels": {"severity": "warning", "model": "demo"}}]
    _run_cases(tmp_path, "KvtideRouterIndexPrecisionLow", [
        # 0 of 3 predicted hits per 10 minutes confirmed: under min_predicted_hits, no verdict.
        ([{"series": f'{PRED}{{{M},outcome="true_hit"}}', "values": "0x50"},
          {"series": f'{PRED}{{{M},outcome="false_hit"}}', "values": "0+0.3x50"}], []),
        # The true_hit counter never appeared (Ray creates a series at its first increment).
        ([{"series": f'{PRED}{{{M},outcome="false_hit"}}', "values": "0+10x50"}], firing),
    ])
