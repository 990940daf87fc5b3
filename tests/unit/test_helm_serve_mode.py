"""The chart sets the process-level Ray settings of KvtideConfig.ray_process_env() on every Ray pod."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_helm_chart import KEYS, rayservice  # tests/unit is on sys.path (rootdir-relative test modules)

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
    {"frontend": {"admission": {"request_timeout_s": 2.5}}},
    {"frontend": {"admission": {"request_timeout_s": None}}},
])
def test_every_ray_container_gets_the_config_ray_env(kvtide_values):
    """Head and workers carry exactly what `kvtide serve` sets locally (throughput mode, metrics push interval)."""
    expected = parse_config(kvtide_values).ray_process_env()
    envs = _ray_env_per_container({**KEYS, "kvtide": kvtide_values} if kvtide_values else KEYS, list(RAY_ENV_NAMES))
    assert envs and all(env == expected for env in envs)


def test_direct_mode_sets_the_routing_peers_per_node_and_ingress_mode_does_not():
    """http.router_replicas_per_node becomes Ray's RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE in direct mode only (default 1)."""
    name = "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE"
    assert parse_config({}).ray_process_env()[name] == "1"
    assert parse_config({"http": {"router_replicas_per_node": 2}}).ray_process_env()[name] == "2"
    assert name not in parse_config({"http": {"mode": "ingress", "router_replicas_per_node": 2}}).ray_process_env()


def test_an_old_haproxy_keeps_its_streams_past_the_request_deadline():
    """hard-stop-after is the request deadline (the drain fallback without one) plus HAProxy's margin; 500 is never retried."""
    from kvtide.config.model import DRAIN_TIMEOUT_WITHOUT_DEADLINE_S, HAPROXY_HARD_STOP_MARGIN_S

    def env(admission: dict) -> dict[str, str]:
        return parse_config({"frontend": {"admission": admission}}).ray_process_env()

    assert env({"request_timeout_s": 2.5})["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"] == str(3 + HAPROXY_HARD_STOP_MARGIN_S)
    assert env({"request_timeout_s": None})["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"] == str(
        int(DRAIN_TIMEOUT_WITHOUT_DEADLINE_S) + HAPROXY_HARD_STOP_MARGIN_S)
    assert "500" not in env({})["RAY_SERVE_HAPROXY_RETRY_ON"].split()


def test_direct_mode_runs_kvtides_haproxy_command_from_the_image():
    """Every Ray container of a direct-mode release points Ray at the image's kvtide-haproxy (the Dockerfile
    checks that path); ingress mode runs no HAProxy and sets none."""
    name = "RAY_SERVE_HAPROXY_BINARY_PATH"
    envs = _ray_env_per_container(KEYS, [name])
    assert envs and all(env == {name: "/home/ray/anaconda3/bin/kvtide-haproxy"} for env in envs)
    assert "test -x /home/ray/anaconda3/bin/kvtide-haproxy" in (Path(__file__).parents[2] / "Dockerfile").read_text()
    ingress = _ray_env_per_container({**KEYS, "kvtide": {"http": {"mode": "ingress"}}}, [name])
    assert ingress and all(env == {} for env in ingress)
