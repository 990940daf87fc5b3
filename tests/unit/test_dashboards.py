"""The generated dashboards are current, use only catalogued metrics, and are valid Grafana models."""

from __future__ import annotations

import json

import pytest

from kvtide.dashboards import build
from kvtide.dashboards.catalog import series_names
from kvtide.dashboards.panels import dashboard_queries
from kvtide.dashboards.promql import PROMETHEUS_SYNTHETIC, metric_names, resolve_grafana_vars

BUILT = build.build_all()


def test_committed_dashboards_are_current_in_both_copies() -> None:
    """dashboards/generated/ and the chart's dashboards/ hold exactly what build.py generates."""
    for directory in (build.GENERATED_DIR, build.CHART_DASHBOARDS_DIR):
        on_disk = {p.name: p.read_text() for p in directory.glob("*.json")}
        assert on_disk == {name: build.to_text(d) for name, d in BUILT.items()}, (
            f"{directory} drifted: run python -m kvtide.dashboards.build")


def test_required_dashboards_exist() -> None:
    """Overview, routing, capacity and engine detail, each with a unique uid."""
    assert set(BUILT) == {"kvtide-overview.json", "kvtide-routing.json", "kvtide-capacity.json", "kvtide-engine.json"}
    assert len({d["uid"] for d in BUILT.values()}) == len(BUILT)


@pytest.mark.parametrize("name", BUILT)
def test_every_query_uses_only_catalogued_metrics(name: str) -> None:
    """Each panel and variable query names only catalog series (or Prometheus's own `up`)."""
    known = set(series_names()) | PROMETHEUS_SYNTHETIC
    for title, expr in dashboard_queries(BUILT[name]):
        names = metric_names(expr)
        assert names, f"{title}: no metric found in {expr}"
        assert names <= known, f"{title}: {sorted(names - known)} not in dashboards/catalog.py"


def test_metric_name_reader_ignores_functions_labels_and_keywords() -> None:
    """The static reader finds selectors, not functions, grouping labels or strings."""
    expr = ('histogram_quantile(0.9, sum by (le, model) (rate(a_bucket{x=~"b|c"}[5m]))) '
            '/ on(model) group_left sum(b_total) or vector(0) unless label_values(c_gauge, ReplicaId)')
    assert metric_names(expr) == {"a_bucket", "b_total", "c_gauge"}


@pytest.mark.parametrize("name", BUILT)
def test_dashboard_model_is_sound(name: str) -> None:
    """Prometheus datasource variable, the shared variables, unique panel ids, no nulls, every target a refId."""
    board = BUILT[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "cluster", "model"} <= variables.keys()
    assert variables["namespace"]["allValue"] == ".*" and variables["cluster"]["allValue"] == ".*"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(ids)
    assert "null" not in json.dumps(board)
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and all(t["refId"] for t in panel["targets"])
        for target in panel["targets"]:
            resolve_grafana_vars(target["expr"])  # every variable used is one the dashboards define


def test_engine_dashboard_repeats_a_row_per_replica() -> None:
    """Engine detail has a `replica` variable over ReplicaId and a row repeated by it."""
    board = BUILT["kvtide-engine.json"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert "ReplicaId" in variables["replica"]["query"]
    assert [p.get("repeat") for p in board["panels"] if p["type"] == "row"] == ["replica"]


def test_overview_has_the_slo_panels() -> None:
    """TTFT/ITL/e2e percentiles via histogram_quantile, throughput, errors, replicas."""
    queries = dashboard_queries(BUILT["kvtide-overview.json"])
    text = " ".join(expr for _, expr in queries)
    for family in ("time_to_first_token", "inter_token_latency", "e2e_latency"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(ray_kvtide_{family}_seconds_bucket" in text
    titles = {title for title, _ in queries}
    assert {"Requests / s", "Tokens / s", "Error share", "Engine replicas"} <= titles


def test_every_catalogued_metric_is_shown_or_alerted_on() -> None:
    """No catalogued series goes unused: each appears in some dashboard query or alert rule."""
    from kvtide.dashboards.alerts import rules
    from kvtide.dashboards.catalog import CATALOG
    from kvtide.dashboards.promql import Selectors

    text = " ".join(expr for built in BUILT.values() for _, expr in dashboard_queries(built))
    text += " ".join(rule.expr for rule in rules(Selectors()))
    unused = [m.name for m in CATALOG if not any(series in text for series in (m.name, *m.series))]
    assert unused == []
