"""A Ray cluster of several nodes on one machine, started as Ray documents: `ray start`.

`kvtide serve --nodes N` and the multi-node integration tests use it. Node 0 is the head
(`ray start --head`); nodes 1..N-1 join it (`ray start --address`). Each node is what a Ray
node on its own host would be: its own raylet, metrics agent (own `--metrics-export-port`),
temp dir, and a Serve proxy (HAProxy in direct mode) with its own HTTP port, so a client can
reach the cluster through any node's port and Prometheus scrapes every node. On one machine
the ports a Ray node keeps fixed must differ per node; Ray 2.60 has a knob for each
(`--dashboard-agent-listen-port`, RAY_SERVE_WORKER_PROXY_HTTP_PORT, RAY_SERVE_HAPROXY_*_PORT).
On separate hosts none of the per-node port overrides are needed (docs/kubernetes.md and the
README give the `ray start` steps for real hosts).

Pure planning (`plan_nodes`, `node_env`, `ray_start_args`) is separate from the processes
(`start_nodes`, `kill_node`), and unit-tested without Ray.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtide.config import ConfigError, KvtideConfig
from kvtide.deployments.engine.placement import placement_bundles

# Ports of node i (i ≥ 1) are base + i; node 0 keeps Ray's defaults for those Ray fixes
# (HAProxy stats 8404 and metrics 9101, the dashboard agent's 52365) except where kvtide's
# config names them (http.port, metrics.port). Offsets stay below 100 nodes.
HAPROXY_STATS_PORT_BASE = 18404
HAPROXY_METRICS_PORT_BASE = 19101
DASHBOARD_AGENT_PORT_BASE = 52365
MAX_LOCAL_NODES = 16
HEAD_IP = "127.0.0.1"
# Node death is noticed by the GCS's health checks: every period, failed after this many
# misses. Ray's defaults (3 s × 5 misses) leave a dead node's replicas routed for ~15 s; a
# local cluster notices in ~3 s. (On real hosts Ray's defaults apply unless set.)
LOCAL_HEALTH_CHECK_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


@dataclass(frozen=True)
class NodePlan:
    """One Ray node of a local cluster: its resources and the ports it alone binds."""

    index: int  # 0: the head
    num_cpus: int
    http_port: int  # its Serve proxy's (HAProxy's) port: the OpenAI API through this node
    metrics_port: int  # its Ray metrics agent's export port (Prometheus scrapes each node)
    haproxy_stats_port: int
    haproxy_metrics_port: int
    dashboard_agent_port: int

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def ip(self) -> str:
        """The node's own loopback address (127.0.0.<i+1>): Ray tells nodes apart by IP where it
        places things "on the same node", e.g. which routing peer a node's HAProxy consults."""
        return f"127.0.0.{self.index + 1}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


def engine_cpus(config: KvtideConfig) -> int:
    """Logical Ray CPUs one engine replica takes (all its placement bundles)."""
    return math.ceil(sum(bundle["CPU"] for bundle in placement_bundles(config)))


def plan_nodes(config: KvtideConfig, nodes: int, engines_per_node: list[int] | None = None) -> list[NodePlan]:
    """The nodes of a local cluster of `nodes` nodes for `config`.

    Each node offers the CPUs of `engines_per_node[i]` engine replicas (default: the initial
    replicas dealt out evenly, the head first), so with one engine's worth per node Ray can
    place one engine on each. Node i ≥ 1 serves HTTP on http.port + i and exports metrics on
    metrics.port + i.
    """
    if not 1 <= nodes <= MAX_LOCAL_NODES:
        raise ConfigError(f"--nodes must be between 1 and {MAX_LOCAL_NODES}, got {nodes}")
    if engines_per_node is None:
        replicas = config.replicas.max_replicas if config.replicas.autoscaling else config.replicas.num_replicas
        replicas = replicas or 1
        engines_per_node = [replicas // nodes + (1 if i < replicas % nodes else 0) for i in range(nodes)]
    if len(engines_per_node) != nodes:
        raise ValueError(f"engines_per_node has {len(engines_per_node)} entries for {nodes} nodes")
    per_engine = engine_cpus(config)
    # Ingress mode's frontend replicas take a CPU each; the head offers them.
    ingress_cpus = config.frontend.num_replicas if config.http.mode == "ingress" else 0
    return [NodePlan(index=i,
                     num_cpus=per_engine * engines + (ingress_cpus if i == 0 else 0),
                     http_port=config.http.port + i,
                     metrics_port=config.metrics.port + i,
                     haproxy_stats_port=HAPROXY_STATS_PORT_BASE + i,
                     haproxy_metrics_port=HAPROXY_METRICS_PORT_BASE + i,
                     dashboard_agent_port=DASHBOARD_AGENT_PORT_BASE + i)
            for i, engines in enumerate(engines_per_node)]


def node_env(config: KvtideConfig, node: NodePlan) -> dict[str, str]:
    """The environment of one node's `ray start`: every Ray process of the node inherits it.

    The config's process-level settings (HAProxy mode, retry-on, niceness: the same
    `ray_process_env` the chart sets on every pod), the local health-check period, and the
    node's own proxy ports (Ray applies RAY_SERVE_WORKER_PROXY_HTTP_PORT to worker nodes only;
    the head binds http.port).
    """
    env = {**config.ray_process_env(), **LOCAL_HEALTH_CHECK_ENV,
           "RAY_SERVE_HAPROXY_STATS_PORT": str(node.haproxy_stats_port),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(node.haproxy_metrics_port)}
    if not node.is_head:
        env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] = str(node.http_port)
    return env


def ray_start_args(node: NodePlan, *, gcs_port: int, temp_dir: Path, num_gpus: int | None = 0) -> list[str]:
    """`ray start` arguments for `node` (the head opens the GCS on `gcs_port`; the others join it)."""
    args = ["start", f"--num-cpus={node.num_cpus}", f"--metrics-export-port={node.metrics_port}",
            f"--dashboard-agent-listen-port={node.dashboard_agent_port}", f"--temp-dir={temp_dir}",
            # Workers on random ports (as ray.init's local node has them): `ray start`'s default
            # range 10002-19999 would clash with the metrics and HTTP ports kvtide configures.
            "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats"]
    if num_gpus is not None:
        args.append(f"--num-gpus={num_gpus}")
    args.append(f"--node-ip-address={node.ip}")
    if node.is_head:
        args += ["--head", f"--port={gcs_port}", "--include-dashboard=true", "--dashboard-port=0"]
    else:
        args.append(f"--address={HEAD_IP}:{gcs_port}")
    return args


@dataclass
class StartedNode:
    """A node this process started: its plan and the directory that names its processes."""

    plan: NodePlan
    temp_dir: Path


@dataclass
class LocalNodes:
    """The nodes of a local multi-node cluster and the GCS address drivers connect to."""

    address: str
    nodes: list[StartedNode]
    root: Path

    @property
    def head(self) -> StartedNode:
        return self.nodes[0]


def _ray_cli() -> str:
    """The `ray` console script of this interpreter's environment."""
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def cluster_auth_env() -> dict[str, str]:
    """RAY_AUTH_MODE=token and a fresh random RAY_AUTH_TOKEN, for every process of one local cluster."""
    import secrets

    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _reload_ray_config() -> None:
    """Make this process (the driver) read RAY_AUTH_* again: Ray caches its config when first imported.

    What Ray's own ray.init does when it turns token authentication on for a new local cluster
    (ray._private.authentication.authentication_token_setup._enable_token_auth).
    """
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# How long one `ray start` may take (it returns once the node registered with the GCS).
RAY_START_TIMEOUT_S = 120.0


def start_nodes(config: KvtideConfig, nodes: int, engines_per_node: list[int] | None = None,
                extra_env: dict[str, str] | None = None) -> LocalNodes:
    """Start the head and the other nodes with `ray start`; returns once all have joined.

    Each node's processes get their own temp dir under one root (Ray's socket paths must stay
    short, so the root is under the system temp dir). The processes outlive `ray start`;
    cluster.local.stop() finds and stops them (cluster.local.start makes this process adopt
    them first).
    """
    gcs_port = free_port()
    # Token authentication, as Ray turns on for a local ray.init() cluster, with one token per
    # cluster that every node and this driver present (not ~/.ray/auth_token: a token left there
    # by another cluster would enable it on the head only, and the other nodes could not join).
    os.environ.update(cluster_auth_env())
    _reload_ray_config()
    root = Path(tempfile.mkdtemp(prefix="kvtide-nodes-"))
    started: list[StartedNode] = []
    num_gpus = None if config.resources.device == "gpu" else 0
    for plan in plan_nodes(config, nodes, engines_per_node):
        temp_dir = root / f"n{plan.index}"
        temp_dir.mkdir()
        env = {**os.environ, **node_env(config, plan), **(extra_env or {})}
        result = subprocess.run([_ray_cli(), *ray_start_args(plan, gcs_port=gcs_port, temp_dir=temp_dir,
                                                             num_gpus=num_gpus)],
                                env=env, capture_output=True, text=True, timeout=RAY_START_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"ray start of node {plan.index} failed ({result.returncode}):\n"
                               f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        started.append(StartedNode(plan, temp_dir))
    return LocalNodes(address=f"127.0.0.1:{gcs_port}", nodes=started, root=root)


def node_processes(node: StartedNode) -> list:
    """The processes of `node`: those whose command line names its temp dir, and their descendants."""
    import psutil

    marker = str(node.temp_dir)
    found = {}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(proc.cmdline()):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
    return list(found.values())


def kill_node(node: StartedNode) -> int:
    """SIGKILL every process of `node` at once, as a host losing power would; returns how many."""
    import psutil

    procs = node_processes(node)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)
    return len(procs)


def remove_temp_dirs(nodes: LocalNodes) -> None:
    shutil.rmtree(nodes.root, ignore_errors=True)
