"""Local bootstrap: start Ray on this machine, deploy kvtide, tear everything down.

Used by `kvtide serve` (and so `make serve`) and by the integration tests. Ray's
logical CPUs are sized from the config, not from the cores: a laptop with 2 cores can
still host two CPU engine replicas (their OpenMP threads are bound to distinct cores).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator

from kvtide.config import KvtideConfig
from kvtide.deployments.placement import logical_cpus_needed

logger = logging.getLogger("kvtide.local")

APP_NAME = "kvtide"


@dataclass(frozen=True)
class LocalCluster:
    """Where a running local kvtide answers."""

    base_url: str
    metrics_url: str
    model_name: str


def apply_ray_process_env(config: KvtideConfig) -> None:
    """Put the config's process-level Ray settings in this process's environment.

    Ray Serve reads them at import, in every process: the driver (its app build checks the
    HAProxy flag), and the controller, proxies and replicas that inherit this environment.
    So this runs before this process imports ray.serve; the config wins over an inherited
    value. The Helm chart sets the same variables on every Ray container.
    """
    import sys

    env = config.ray_process_env()
    if "ray.serve" in sys.modules:
        from ray.serve._private import constants

        if constants.RAY_SERVE_ENABLE_HA_PROXY != (env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"):
            raise RuntimeError(
                f"http.mode={config.http.mode} needs RAY_SERVE_ENABLE_HA_PROXY={env['RAY_SERVE_ENABLE_HA_PROXY']} "
                "before ray.serve is imported, and this process imported it already; start a new process "
                "(or export the variable before starting it)")
    os.environ.update(env)


def start(config: KvtideConfig, *, num_cpus: float | None = None,
          metrics_report_interval_ms: int | None = None) -> LocalCluster:
    """Start Ray + Serve and deploy the app; returns once every replica is serving.

    `metrics_report_interval_ms` shortens Ray's metric export period (default 10 s);
    tests use 1 s so what they assert on shows up in the scrape sooner.
    """
    apply_ray_process_env(config)
    import ray
    from ray import serve

    from kvtide.cluster.app import build_from_config

    replicas = config.replicas.max_replicas if config.replicas.autoscaling else config.replicas.num_replicas
    cpus = num_cpus or max(float(os.cpu_count() or 1), logical_cpus_needed(config, replicas or 1) + 1)
    ray.init(
        num_cpus=cpus,
        num_gpus=None if config.resources.device == "gpu" else 0,
        _metrics_export_port=config.metrics.port,
        include_dashboard=True,
        logging_level=logging.WARNING,
        _system_config=({"metrics_report_interval_ms": metrics_report_interval_ms}
                        if metrics_report_interval_ms else None),
    )
    started_s = time.monotonic()
    try:
        serve.start(http_options={"host": config.http.host, "port": config.http.port})
        # Returns once every replica passed its constructor; raises if the app fails to deploy.
        serve.run(build_from_config(config), name=APP_NAME, route_prefix="/", blocking=False)
    except BaseException:
        stop()
        raise
    logger.info("kvtide deployed in %.1f s", time.monotonic() - started_s)
    host = "127.0.0.1" if config.http.host in ("0.0.0.0", "::") else config.http.host
    return LocalCluster(
        base_url=f"http://{host}:{config.http.port}",
        metrics_url=f"http://127.0.0.1:{config.metrics.port}/metrics",
        model_name=config.model_name,
    )


# How long a stop lets in-flight requests finish (Serve drains its replicas) before Ray is
# shut down under them. Idle replicas drain at once.
STOP_DRAIN_TIMEOUT_S = 20.0
# How long Ray's own processes get to exit after ray.shutdown() before they are killed.
STOP_KILL_AFTER_S = 3.0


def stop(drain_timeout_s: float = STOP_DRAIN_TIMEOUT_S) -> None:
    """Shut Serve and Ray down; no replica, engine or Ray process outlives this.

    Serve drains first (requests in flight finish), for at most `drain_timeout_s`; then Ray
    shuts down, and whatever this process started that is still alive a few seconds later
    (Ray's agents, vLLM engine cores and workers) is killed.
    """
    import threading

    import psutil
    import ray
    from ray import serve

    started = psutil.Process().children(recursive=True)
    # A start interrupted by a signal may have disconnected from Ray already; serve.shutdown()
    # would then start a new local Ray instance just to find nothing to stop.
    if ray.is_initialized():
        drain = threading.Thread(target=lambda: _suppressed(serve.shutdown), name="kvtide-serve-shutdown",
                                 daemon=True)
        drain.start()
        drain.join(drain_timeout_s)
        if drain.is_alive():
            logger.warning("Serve did not drain within %.0f s; stopping Ray under the requests in flight",
                           drain_timeout_s)
    ray.shutdown()
    leftovers = [p for p in started + psutil.Process().children(recursive=True) if p.is_running()]
    _, alive = psutil.wait_procs(leftovers, timeout=STOP_KILL_AFTER_S)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=STOP_KILL_AFTER_S)


def _suppressed(fn) -> None:
    with contextlib.suppress(Exception):
        fn()


@contextlib.contextmanager
def running(config: KvtideConfig, **kwargs) -> Iterator[LocalCluster]:
    cluster = start(config, **kwargs)
    try:
        yield cluster
    finally:
        stop()
