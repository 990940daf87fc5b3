"""A local multi-node cluster's plan (cluster/nodes.py) and the process-level settings serve-config carries."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from kvtide.cluster.nodes import LOCAL_HEALTH_CHECK_ENV, engine_cpus, node_env, plan_nodes, ray_start_args
from kvtide.cluster.serve_config import ray_env_exports, serve_config, serve_config_yaml
from kvtide.config import ConfigError, default_config_path, load_config


@pytest.fixture
def config():
    return load_config(default_config_path(), ["http.port=9000", "metrics.port=9100"])


def test_each_node_gets_its_own_ports_and_the_cpus_of_its_engines(config):
    """Node i serves on http.port + i and exports metrics on metrics.port + i; CPUs are whole engines'."""
    nodes = plan_nodes(config, 3, engines_per_node=[2, 1, 0])
    assert [n.http_port for n in nodes] == [9000, 9001, 9002]
    assert [n.metrics_port for n in nodes] == [9100, 9101, 9102]
    assert [n.num_cpus for n in nodes] == [2 * engine_cpus(config), engine_cpus(config), 0]
    for attr in ("haproxy_stats_port", "haproxy_metrics_port", "dashboard_agent_port"):
        assert len({getattr(n, attr) for n in nodes}) == 3, attr
    assert [n.is_head for n in nodes] == [True, False, False]


def test_default_plan_deals_the_replicas_out_evenly_head_first(config):
    """Two replicas on two nodes: one engine's CPUs each; three on two: the head takes two."""
    per_engine = engine_cpus(config)
    assert [n.num_cpus for n in plan_nodes(config, 2)] == [per_engine, per_engine]
    three = load_config(default_config_path(), ["replicas.num_replicas=3"])
    assert [n.num_cpus for n in plan_nodes(three, 2)] == [2 * per_engine, per_engine]


@pytest.mark.parametrize("nodes", [0, 17])
def test_a_node_count_out_of_range_is_a_config_error(config, nodes):
    """--nodes outside 1..16 is refused with a message naming the flag."""
    with pytest.raises(ConfigError, match="--nodes"):
        plan_nodes(config, nodes)


def test_every_node_starts_with_the_configs_process_settings_and_its_own_proxy_ports(config):
    """ray_process_env on every node; the worker proxy port override on non-head nodes only."""
    head, worker = plan_nodes(config, 2)
    for node in (head, worker):
        env = node_env(config, node)
        assert config.ray_process_env().items() <= env.items()
        assert LOCAL_HEALTH_CHECK_ENV.items() <= env.items()
        assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == str(node.haproxy_stats_port)
    assert "RAY_SERVE_WORKER_PROXY_HTTP_PORT" not in node_env(config, head)
    assert node_env(config, worker)["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] == "9001"


def test_the_head_opens_the_gcs_and_the_others_join_it(config, tmp_path):
    """`ray start --head --port=P` for node 0, `--address=127.0.0.1:P` for the rest; each its own temp dir and ports."""
    head, worker = plan_nodes(config, 2)
    head_args = ray_start_args(head, gcs_port=6400, temp_dir=tmp_path / "n0")
    worker_args = ray_start_args(worker, gcs_port=6400, temp_dir=tmp_path / "n1")
    assert {"--head", "--port=6400", "--metrics-export-port=9100", f"--temp-dir={tmp_path / 'n0'}"} <= set(head_args)
    assert {"--address=127.0.0.1:6400", "--metrics-export-port=9101", f"--temp-dir={tmp_path / 'n1'}"} <= set(
        worker_args)
    assert "--head" not in worker_args
    assert "--num-gpus=0" in head_args and ray_start_args(head, gcs_port=1, temp_dir=tmp_path, num_gpus=None).count(
        "--num-gpus=0") == 0


def test_serve_config_names_every_process_level_setting_and_still_parses_to_the_document(config):
    """The YAML's header comments list ray_process_env; the document itself is unchanged."""
    text = serve_config_yaml(config)
    for name, value in config.ray_process_env().items():
        assert f"#   export {name}=" in text, name
    assert yaml.safe_load(text) == serve_config(config)


@pytest.mark.parametrize("mode", ["direct", "ingress"])
def test_serve_config_env_exports_reproduce_ray_process_env_in_a_shell(mode):
    """`eval "$(kvtide serve-config --env)"` sets exactly ray_process_env's values (quoting included)."""
    config = load_config(default_config_path(), [f"http.mode={mode}"])
    script = ray_env_exports(config) + "env -0"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"KVTIDE_INTERNAL_SECRET_FILE": "/s"}).stdout
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    assert {k: env[k] for k in config.ray_process_env()} == config.ray_process_env()
    if mode == "direct":  # kvtide's HAProxy, and the cluster secret the shell named
        assert env["RAY_SERVE_HAPROXY_BINARY_PATH"].endswith("/kvtide-haproxy") and env["KVTIDE_INTERNAL_SECRET_FILE"] == "/s"


def test_serve_config_env_exports_refuse_a_direct_cluster_without_the_secret():
    """Evaluated without KVTIDE_INTERNAL_SECRET_FILE, the direct-mode exports fail, saying how to make the secret."""
    script = ray_env_exports(load_config(default_config_path(), [])) + "echo reached"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={})
    assert done.returncode != 0 and "reached" not in done.stdout and "openssl rand" in done.stderr
