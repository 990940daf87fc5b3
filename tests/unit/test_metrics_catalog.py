"""The metric catalog matches what code exports, what vLLM/Ray name, and docs/metrics.md."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvtide.dashboards import build, catalog, docs
from kvtide.dashboards.catalog import CATALOG, Kind, Source


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates without importing vLLM/Ray
    assert spec and spec.submodule_search_locations, f"{name} is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def test_catalog_lists_exactly_the_kvtide_metrics_code_exports() -> None:
    """Every ray_kvtide_* created in code is catalogued with its type, and nothing else is."""
    in_code = catalog.exported_metric_names_from_code()
    listed = {m.name: m.kind for m in catalog.kvtide_metrics()}
    assert sorted(set(in_code) - set(listed)) == [], "exported but not in dashboards/catalog.py"
    assert sorted(set(listed) - set(in_code)) == [], "catalogued but no code exports it"
    assert in_code == listed


def test_static_scan_reads_ray_naming() -> None:
    """The AST scan applies Ray's naming: ray_ prefix, counters gain _total, prometheus_client is ignored."""
    found = catalog.exported_metric_names_from_code()
    assert found["ray_kvtide_requests_total"] is Kind.COUNTER
    assert found["ray_kvtide_time_to_first_token_seconds"] is Kind.HISTOGRAM


@pytest.mark.parametrize("entry", [m for m in CATALOG if m.source is Source.ENGINE and m.name.startswith("ray_vllm_")],
                         ids=lambda m: m.name)
def test_vllm_entries_exist_in_the_installed_vllm(entry: catalog.Metric) -> None:
    """Each ray_vllm_* entry is a `vllm:` metric of the installed vLLM, with the catalogued type."""
    base = entry.name.removeprefix("ray_vllm_")
    if entry.kind is Kind.COUNTER:
        base = base.removesuffix("_total")
    text = "".join(p.read_text() for p in (_package_dir("vllm") / "v1" / "metrics").glob("*.py"))
    match = re.search(rf'self\._(\w+)_cls\(\s*name="vllm:{re.escape(base)}"', text)
    assert match, f'vllm:{base} not found in vllm/v1/metrics: update {entry.name}'
    assert match.group(1) == entry.kind.value


@pytest.mark.parametrize("entry", [m for m in CATALOG if m.source is Source.SERVE], ids=lambda m: m.name)
def test_serve_entries_exist_in_the_installed_ray(entry: catalog.Metric) -> None:
    """Each ray_serve_* entry is a metric Ray Serve creates (f-strings over the protocol included)."""
    base = entry.name.removeprefix("ray_")
    if entry.kind is Kind.COUNTER:
        base = base.removesuffix("_total")
    text = "".join(p.read_text() for p in (_package_dir("ray") / "serve" / "_private").glob("*.py"))
    candidates = {base, base.replace("_http_", "_{protocol_name}_")}
    assert any(f'"{c}"' in text for c in candidates), f"{base} not created in ray/serve/_private"


def test_vllm_labels_match_the_ray_wrapper() -> None:
    """vLLM series carry model_name and engine, and the Ray wrapper adds ReplicaId."""
    wrappers = (_package_dir("vllm") / "v1" / "metrics" / "ray_wrappers.py").read_text()
    loggers = (_package_dir("vllm") / "v1" / "metrics" / "loggers.py").read_text()
    assert 'labels.append("ReplicaId")' in wrappers
    assert 'labelnames = ["model_name", "engine"]' in loggers
    assert catalog.VLLM_LABELS == ("model_name", "engine", "ReplicaId")


def test_engine_deployment_name_matches_the_app() -> None:
    """Queries select deployment="Engine": the name deployments/names.py gives the engine deployment."""
    source = (catalog.REPO_ROOT / "deployments" / "names.py").read_text()  # read, not imported
    assert f'ENGINE_DEPLOYMENT = "{catalog.ENGINE_DEPLOYMENT}"' in source


def test_unknown_metric_is_refused_with_the_fix() -> None:
    """A query may not name an uncatalogued metric: building it raises, naming the catalog."""
    with pytest.raises(KeyError, match="dashboards/catalog.py"):
        catalog.metric("ray_kvtide_not_exported_anywhere_total")


def test_every_entry_is_documented() -> None:
    """Names carry units, help text is present, model labels are real labels."""
    for m in CATALOG:
        assert m.help and m.unit, m.name
        assert m.model_label is None or m.model_label in m.labels, m.name
        if m.kind is Kind.COUNTER:
            assert m.name.endswith("_total"), m.name


def test_metrics_md_is_current() -> None:
    """docs/metrics.md equals what the catalog generates."""
    expected = docs.render_metrics_md(build.dashboard_specs())
    assert docs.METRICS_MD.read_text() == expected, "run: python -m kvtide.dashboards.build"
