"""The chart sets the process-level Ray settings of KvtideConfig.ray_process_env() on every Ray pod."""

from __future__ import annotations

import pytest
from test_helm_chart import rayservice  # tests/unit is on sys.path (rootdir-relative test modules)

from kvtide.config import parse_config


# Every name ray_process_env() can emit, in either mode: the chart must emit exactly the same subset.
RAY_ENV_NAMES = set(parse_config({"http": {"mode": "direct"}}).ray_process_env()) | set(
    parse_config({"http": {"mode": "ingress"}}).ray_process_env())


def _ray_env_per_container(values: dict, names: list[str]) -> list[dict[str, str]]:
    cluster = rayservice(values)["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    containers = [c for pod in pods for c in pod["template"]["spec"]["containers"]]
    return [{e["name"]: e["value"] for e in c["env"] if e["name"] in names} for c in containers]


@pytest.mark.parametrize("kvtide_values", [
    {},
    {"http": {"throughput_optimized": False}},
    {"autoscaling": {"metrics_push_interval_s": 0.5}},
    {"autoscaling": {"metrics_push_interval_s": 10}},
    {"http": {"mode": "ingress"}},
    {"frontend": {"max_body_bytes": 1 << 20, "admission": {"max_retries": 0}}},
    {"http": {"router_replicas_per_node": 3, "router_buffer_bytes": 1 << 20}},
])
def test_every_ray_container_gets_the_config_ray_env(kvtide_values):
    """Head and workers carry exactly what `kvtide serve` sets locally (throughput mode, metrics push interval)."""
    expected = parse_config(kvtide_values).ray_process_env()
    envs = _ray_env_per_container({"kvtide": kvtide_values} if kvtide_values else {}, list(RAY_ENV_NAMES))
    assert envs and all(env == expected for env in envs)


def test_direct_mode_sets_the_routing_peers_per_node_and_ingress_mode_does_not():
    """http.router_replicas_per_node becomes Ray's RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE in direct mode only (default 1)."""
    name = "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE"
    assert parse_config({}).ray_process_env()[name] == "1"
    assert parse_config({"http": {"router_replicas_per_node": 2}}).ray_process_env()[name] == "2"
    assert name not in parse_config({"http": {"mode": "ingress", "router_replicas_per_node": 2}}).ray_process_env()
