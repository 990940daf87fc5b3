"""Dashboard specs (plain data) and their rendering to Grafana JSON.

Why two layers: the specs are what tests and the integration run read (every query, its
legend, the panels worth a preview); Grafana's JSON model is rendered from them with
`grafana-foundation-sdk`, Grafana Labs' maintained, typed builders for dashboards as
code. The SDK keeps the JSON shape (grid layout, field config, variable models) in step
with Grafana without hand-written dicts; the specs keep kvtide's content independent of it.

    DashboardSpec ─┬─ variables   (datasource, namespace, cluster, model[, replica])
                   └─ RowSpec* ── PanelSpec* ── Query* (PromQL from catalogued names)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import common as gcb
from grafana_foundation_sdk.builders import dashboard as gdb
from grafana_foundation_sdk.builders import prometheus as gprom
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as gcommon
from grafana_foundation_sdk.models import dashboard as gmodel


DATASOURCE = gmodel.DataSourceRef(type_val="prometheus", uid="${datasource}")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    """One panel: a title an SRE reads, its unit, and the queries behind it."""

    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    height: int = 8
    max: float | None = None
    no_value: str | None = None  # what Grafana shows instead of "No data", e.g. "autoscaling off"
    preview: bool = False  # one of the dashboard's key panels, drawn in dashboards/previews/
    needs: str | None = None  # condition under which the queries have data (see catalog.Metric.needs)


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...]
    repeat: str | None = None  # a variable name: one copy of the row per selected value


@dataclass(frozen=True)
class VariableSpec:
    """A query variable over a label; `all_value` '.*' also matches series without the label."""

    name: str
    label: str
    query: str  # Grafana's label_values(metric{...}, label)
    all_value: str | None = ".*"
    multi: bool = True


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    variables: tuple[VariableSpec, ...]
    rows: tuple[RowSpec, ...]
    tags: tuple[str, ...] = ("kvtide",)

    def panels(self) -> list[PanelSpec]:
        return [panel for row in self.rows for panel in row.panels]


# --- rendering ---------------------------------------------------------------------------


def render(spec: DashboardSpec) -> dict[str, Any]:
    """Grafana dashboard JSON model for `spec` (no nulls, stable panel ids)."""
    board = (
        gdb.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(list(spec.tags))
        .editable()
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(gmodel.DashboardCursorSync.CROSSHAIR)
        .with_variable(gdb.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for var in spec.variables:
        builder = (
            gdb.QueryVariable(var.name)
            .label(var.label)
            .datasource(DATASOURCE)
            .query(var.query)
            .refresh(gmodel.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(gmodel.VariableSort.ALPHABETICAL_ASC)
            .include_all(True)
            .multi(var.multi)
            .current(gmodel.VariableOption(selected=True, text="All", value="$__all"))
        )
        if var.all_value is not None:
            builder = builder.all_value(var.all_value)
        board = board.with_variable(builder)
    panel_id = 0
    for row in spec.rows:
        panel_id += 1
        row_builder = gdb.Row(row.title).id(panel_id)
        if row.repeat:
            row_builder = row_builder.repeat(row.repeat)
        board = board.with_row(row_builder)
        for panel in row.panels:
            panel_id += 1
            board = board.with_panel(_panel(panel, panel_id))
    data = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return _drop_nulls(data)


def _panel(spec: PanelSpec, panel_id: int) -> Any:
    builder = gstat.Panel() if spec.kind == "stat" else gts.Panel()
    builder = (
        builder.id(panel_id).title(spec.title).datasource(DATASOURCE)
        .unit(spec.unit).span(spec.width).height(spec.height)
    )
    if spec.description:
        builder = builder.description(spec.description)
    if spec.max is not None:
        builder = builder.min(0).max(spec.max)
    if spec.no_value:
        builder = builder.no_value(spec.no_value)
    if spec.kind == "stat":
        builder = builder.graph_mode(gcommon.BigValueGraphMode.AREA).reduce_options(
            gcb.ReduceDataOptions().calcs(["lastNotNull"]))
    else:
        builder = (
            builder.line_width(1).fill_opacity(10).show_points(gcommon.VisibilityMode.NEVER)
            .legend(gcb.VizLegendOptions().show_legend(True).display_mode(gcommon.LegendDisplayMode.LIST)
                    .placement(gcommon.LegendPlacement.BOTTOM).calcs([]))
            .tooltip(gcb.VizTooltipOptions().mode(gcommon.TooltipDisplayMode.MULTI).sort(gcommon.SortOrder.DESCENDING))
        )
    for i, query in enumerate(spec.queries):
        target = gprom.Dataquery().expr(query.expr).ref_id(chr(ord("A") + i)).range()
        if query.legend:
            target = target.legend_format(query.legend)
        if spec.kind == "stat":
            target = target.instant()
        builder = builder.with_target(target)
    return builder


def _drop_nulls(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _drop_nulls(value) for key, value in node.items() if value is not None}
    if isinstance(node, list):
        return [_drop_nulls(item) for item in node]
    return node


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of a rendered dashboard, variables' queries included."""
    out = [(f"variable {v['name']}", _var_query(v)) for v in dashboard.get("templating", {}).get("list", [])
           if v.get("type") == "query"]
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def _var_query(var: dict[str, Any]) -> str:
    query = var["query"]
    return query["query"] if isinstance(query, dict) else query
