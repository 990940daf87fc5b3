"""Local bootstrap: start Ray on this machine, deploy kvtide, tear everything down.

Used by `kvtide serve` (and so `make serve`) and by the integration tests. Ray's
logical CPUs are sized from the config, not from the cores: a laptop with 2 cores can
still host two CPU engine replicas (their OpenMP threads are bound to distinct cores).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvtide.cluster.haproxy_shim import shim_path
from kvtide.cluster.nodes import LocalNodes, remove_temp_dirs, start_nodes
from kvtide.cluster.startup import FAILURE_PREFIXES, StartupWatch
from kvtide.config import KvtideConfig
from kvtide.deployments.engine.placement import logical_cpus_needed
from kvtide.deployments.internal_auth import SECRET_FILE_ENV

logger = logging.getLogger("kvtide.local")

APP_NAME = "kvtide"


@dataclass(frozen=True)
class LocalCluster:
    """Where a running local kvtide answers (`nodes`: the Ray nodes, when it spans several)."""

    base_url: str
    metrics_url: str
    model_name: str
    nodes: LocalNodes | None = None


def apply_ray_process_env(config: KvtideConfig) -> None:
    """Put the config's process-level Ray settings in this process's environment.

    Ray Serve reads them at import, in every process: the driver (its app build checks the
    HAProxy flag), and the controller, proxies and replicas that inherit this environment.
    So this runs before this process imports ray.serve; the config wins over an inherited
    value. The Helm chart sets the same variables on every Ray container.
    """
    env = {**config.ray_process_env(), **internal_env()}
    if "ray.serve" in sys.modules:
        from ray.serve._private import constants

        if constants.RAY_SERVE_ENABLE_HA_PROXY != (env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"):
            raise RuntimeError(
                f"http.mode={config.http.mode} needs RAY_SERVE_ENABLE_HA_PROXY={env['RAY_SERVE_ENABLE_HA_PROXY']} "
                "before ray.serve is imported, and this process imported it already; start a new process "
                "(or export the variable before starting it)")
    os.environ.update(env)


def internal_env() -> dict[str, str]:
    """What this machine's Ray nodes need beyond the config: kvtide's HAProxy (cluster/haproxy_shim.py, the
    console script beside this Python) and a cluster secret for the internal hops (deployments/internal_auth.py).

    The secret is made once per process, 32 random bytes in a file only its owner reads, unless the
    environment names one already (KVTIDE_INTERNAL_SECRET_FILE)."""
    global _secret_file
    env = {"RAY_SERVE_HAPROXY_BINARY_PATH": str(shim_path())}
    if os.environ.get(SECRET_FILE_ENV):
        return env
    if _secret_file is None:
        fd, path = tempfile.mkstemp(prefix="kvtide-internal-secret-")  # mode 0600
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        _secret_file = path
    return {**env, SECRET_FILE_ENV: _secret_file}


_secret_file: str | None = None


def start(config: KvtideConfig, *, num_cpus: float | None = None,
          metrics_report_interval_ms: int | None = None, nodes: int = 1,
          engines_per_node: list[int] | None = None,
          before_deploy: Callable[[], None] | None = None) -> LocalCluster:
    """Start Ray + Serve and deploy the app; returns once every replica is serving.

    `metrics_report_interval_ms` shortens Ray's metric export period (default 10 s);
    tests use 1 s so what they assert on shows up in the scrape sooner. `nodes` > 1 starts
    that many Ray nodes on this machine with `ray start` (cluster/nodes.py: node i serves
    HTTP on http.port + i, its metrics on metrics.port + i), each offering the CPUs of
    `engines_per_node[i]` engines (default: the replicas dealt out evenly). `before_deploy`
    runs once Ray is up, before the app is deployed (a test reserving resources on a node).
    """
    apply_ray_process_env(config)
    import ray
    from ray import serve

    from kvtide.cluster.app import build_from_config

    local_nodes = None
    if nodes > 1:
        global _started_nodes
        _adopt_orphans()  # before `ray start`: its daemons are re-parented here when it exits
        extra_env = ({"RAY_metrics_report_interval_ms": str(metrics_report_interval_ms)}
                     if metrics_report_interval_ms else None)
        try:
            local_nodes = _started_nodes = start_nodes(config, nodes, engines_per_node, extra_env)
            ray.init(address=local_nodes.address, logging_level=logging.WARNING)
        except BaseException:
            stop()  # the nodes started before the failure
            raise
    else:
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
        if before_deploy is not None:
            before_deploy()
        # A proxy on every node: a client reaches the cluster through any node's port. Across nodes
        # every address (as serve-config's): a node's HAProxy reaches the others' replicas at their
        # node's address, and replicas bind the same host as the proxies.
        host = "0.0.0.0" if nodes > 1 else config.http.host
        serve.start(proxy_location="EveryNode", http_options={"host": host, "port": config.http.port})
        # Not serve.run: it waits without a bound, and Serve retries a failing replica forever
        # once a sibling runs. _run without blocking is what serve.run calls before its wait.
        serve._run(build_from_config(config), name=APP_NAME, route_prefix="/", _blocking=False)
        wait_until_running(serve)
    except BaseException:
        stop()
        raise
    logger.info("kvtide deployed in %.1f s", time.monotonic() - started_s)
    host = "127.0.0.1" if config.http.host in ("0.0.0.0", "::") else config.http.host
    return LocalCluster(
        base_url=f"http://{host}:{config.http.port}",
        metrics_url=f"http://127.0.0.1:{config.metrics.port}/metrics",
        model_name=config.model_name,
        nodes=local_nodes,
    )


# The nodes start() began with `ray start` (None: a single in-process node); stop() removes their temp dirs.
_started_nodes: LocalNodes | None = None


# How long replicas may keep failing to start before start() gives up (see cluster/startup.py).
# Longer than an 8B engine's start on a GPU (1-2 min), so one transient failure and its retry fit.
REPLICA_FAILURE_GRACE_S = 180.0
STARTUP_POLL_S = 1.0


def wait_until_running(serve: Any, grace_s: float = REPLICA_FAILURE_GRACE_S) -> None:
    """Poll Serve until the app runs; raise StartupFailed if it failed or its replicas keep failing."""
    watch = StartupWatch(grace_s)
    reported = set()
    while True:
        app = serve.status().applications.get(APP_NAME)
        if app is not None:
            messages = {name: d.message or "" for name, d in app.deployments.items()}
            for name, msg in messages.items():
                if msg.startswith(FAILURE_PREFIXES) and msg not in reported:
                    reported.add(msg)  # an operator sees why now, not only after the grace period
                    logger.warning("kvtide: %s: %s", name, msg[-2000:])
            if watch.serving(str(getattr(app.status, "value", app.status)), app.message or "", messages, time.monotonic()):
                return
        time.sleep(STARTUP_POLL_S)  # polling Serve's controller: no event to wait on


# How long a stop lets in-flight requests finish (Serve drains its replicas) before Ray is
# shut down under them. With nothing in flight there is nothing to drain, and the stop skips it.
STOP_DRAIN_TIMEOUT_S = 20.0
# How long Ray's own processes get to exit after ray.shutdown() before they are killed.
STOP_KILL_AFTER_S = 3.0
# How long an engine's processes (vLLM's engine core and workers) get to exit after SIGTERM before
# they are killed. Their teardown takes well under a second; what follows is the interpreter's
# last garbage collection over torch's heap (3-6 s per process on 2 cores), which frees nothing
# that a kill does not.
ENGINE_EXIT_GRACE_S = 3.0
# How long counting the requests in flight may take; an answer later than this counts as unknown.
IN_FLIGHT_QUERY_TIMEOUT_S = 2.0


def stop(drain_timeout_s: float = STOP_DRAIN_TIMEOUT_S) -> None:
    """Shut Serve and Ray down; no replica, engine or Ray process outlives this.

    With requests in flight, Serve drains first (they finish) for at most `drain_timeout_s`.
    Then the engines this process started are stopped, before the rest of Ray so GPUs are
    freed first; then Ray shuts down, and whatever this process started that is still alive
    (Ray's agents, dashboard modules, HAProxy) is terminated, and killed a few seconds later.
    """
    import psutil
    import ray

    _adopt_orphans()
    started = psutil.Process().children(recursive=True)
    # A start interrupted by a signal may have disconnected from Ray already; serve.shutdown()
    # would then start a new local Ray instance just to find nothing to stop.
    if ray.is_initialized():
        # A request arriving after this count arrived after the stop began: it is not waited for.
        in_flight = requests_in_flight()
        if serve_drain_needed(in_flight, ray_outlives_stop=not _started_ray_here(started)):
            _drain_serve(drain_timeout_s)
        else:
            logger.info("nothing in flight: stopping without Serve's drain")
        _stop_engines(started)
    ray.shutdown()
    _terminate_then_kill(started + psutil.Process().children(recursive=True), STOP_KILL_AFTER_S)
    global _started_nodes
    if _started_nodes is not None:
        remove_temp_dirs(_started_nodes)
        _started_nodes = None


# prctl(2) option: orphaned descendants are re-parented to this process instead of init.
PR_SET_CHILD_SUBREAPER = 36


def _adopt_orphans() -> None:
    """From now on, this process inherits its orphaned descendants (Linux), so it can stop and reap them.

    Stopping Ray orphans processes: the dashboard's modules outlive the dashboard, a killed
    engine core leaves its workers, HAProxy its manager. Re-parented to init they escape a
    children() sweep, or linger as zombies (a container's init may reap late).
    """
    if sys.platform != "linux":
        return
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def serve_drain_needed(in_flight: int | None, *, ray_outlives_stop: bool) -> bool:
    """Whether a stop goes through Serve's graceful shutdown rather than straight to stopping Ray.

    Serve's drain holds every replica for its minimum draining period (2 s) and then waits for
    the engines' own shutdown, idle or not. That buys nothing when no request is in flight and
    Ray goes down next; it is needed when requests are (or may be: `None`, the count failed) in
    flight, and when Ray outlives the stop (a cluster this process only connected to), where
    only Serve removes the app.
    """
    return ray_outlives_stop or in_flight is None or in_flight > 0


def requests_in_flight(timeout_s: float = IN_FLIGHT_QUERY_TIMEOUT_S) -> int | None:
    """Requests the app's Serve replicas hold now (what Serve's drain waits for); None if unknown."""
    import ray
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX
    from ray.serve._private.constants import SERVE_NAMESPACE

    prefix = f"{REPLICA_ID_FULL_ID_STR_PREFIX}{APP_NAME}#"
    try:
        replicas = [ray.get_actor(actor["name"], namespace=SERVE_NAMESPACE)
                    for actor in ray.util.list_named_actors(all_namespaces=True)
                    if actor["namespace"] == SERVE_NAMESPACE and actor["name"].startswith(prefix)]
        return sum(ray.get([replica.get_num_ongoing_requests.remote() for replica in replicas],
                           timeout=timeout_s))
    except Exception:  # a replica gone or stuck: the count is unknown, so Serve drains
        logger.warning("could not count the requests in flight; draining", exc_info=True)
        return None


def _drain_serve(drain_timeout_s: float) -> None:
    """Serve's graceful shutdown, for at most `drain_timeout_s` (Ray is stopped under it after that)."""
    import threading

    from ray import serve

    drain = threading.Thread(target=lambda: _suppressed(serve.shutdown), name="kvtide-serve-shutdown",
                             daemon=True)
    drain.start()
    drain.join(drain_timeout_s)
    if drain.is_alive():
        logger.warning("Serve did not drain within %.0f s; stopping Ray under the requests in flight",
                       drain_timeout_s)


def _started_ray_here(procs: list) -> bool:
    """Whether this process started the Ray instance it is connected to (its GCS is a child)."""
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.name() == "gcs_server":
                return True
    return False


def _stop_engines(procs: list) -> None:
    """SIGTERM the processes of the engine replicas among `procs`; kill them after a grace period.

    vLLM's engine core takes SIGTERM as its shutdown (its executor then stops its workers).
    Engines Serve already drained are gone and this finds nothing. Ray's later shutdown would
    stop the replicas too, but the raylet first, with the engines under it.
    """
    import psutil

    engines = engine_processes(procs)
    for proc in engines:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    # Python's multiprocessing resource tracker ignores SIGTERM by design and exits with its
    # parent (the replica, stopped with Ray): waiting for it would always take the whole grace.
    _kill(wait_exited([proc for proc in engines if not _is_resource_tracker(proc)], ENGINE_EXIT_GRACE_S))


def engine_processes(procs: list) -> list:
    """The processes under the engine replicas among `procs` (vLLM's engine cores, workers, helpers)."""
    import psutil

    from kvtide.deployments.names import ENGINE_DEPLOYMENT

    # Ray titles an actor's worker process "ray::<actor class>"; Serve's replica class is
    # "ServeReplica:<app>:<deployment>".
    title = f"ray::ServeReplica:{APP_NAME}:{ENGINE_DEPLOYMENT}"
    found = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if " ".join(proc.cmdline()).startswith(title):
                found += proc.children(recursive=True)
    return found


def _is_resource_tracker(proc) -> bool:
    import psutil

    with contextlib.suppress(psutil.Error):
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    return False


def _terminate_then_kill(procs: list, grace_s: float) -> None:
    """SIGTERM every process of `procs` still running at once; SIGKILL those alive `grace_s` later."""
    import psutil

    procs = list({proc.pid: proc for proc in procs}.values())
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if _running(proc):
                proc.terminate()
    _kill(wait_exited(procs, grace_s))


def _kill(procs: list) -> None:
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait_exited(procs, STOP_KILL_AFTER_S)


# How often a stop checks whether the processes it signalled have exited.
EXIT_POLL_S = 0.05


def wait_exited(procs: list, timeout_s: float) -> list:
    """Wait at most `timeout_s` for every process of `procs` to exit; returns those still running.

    A zombie has exited: it only awaits its parent's wait(). (psutil.wait_procs counts a zombie
    that is not this process's child as running until its parent reaps it, seconds later.)
    """
    import psutil

    deadline_s = time.monotonic() + timeout_s
    while True:
        alive = [proc for proc in procs if _running(proc)]
        if not alive or time.monotonic() >= deadline_s:
            break
        time.sleep(EXIT_POLL_S)
    # Reap this process's own children among them (they would stay zombies while it lives).
    psutil.wait_procs([proc for proc in procs if proc not in alive], timeout=0)
    return alive


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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
