"""The chart sets Ray Serve's process-level mode from kvtide.http.throughput_optimized on every Ray pod."""

from __future__ import annotations

import pytest
from test_helm_chart import rayservice  # tests/unit is on sys.path (rootdir-relative test modules)


def _env_values(values: dict) -> set[str]:
    cluster = rayservice(values)["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    containers = [c for pod in pods for c in pod["template"]["spec"]["containers"]]
    return {next(e["value"] for e in c["env"] if e["name"] == "RAY_SERVE_THROUGHPUT_OPTIMIZED") for c in containers}


@pytest.mark.parametrize(("values", "expected"), [
    ({}, {"1"}),
    ({"kvtide": {"http": {"throughput_optimized": False}}}, {"0"}),
])
def test_every_ray_container_gets_the_same_serve_mode(values, expected):
    """Head and workers agree on RAY_SERVE_THROUGHPUT_OPTIMIZED, which follows the config (default on)."""
    assert _env_values(values) == expected
