"""Polling, metric-reading and app-deploying helpers shared by the integration tests."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

REPO = Path(__file__).resolve().parents[2]


WORDS = "red green blue cyan magenta yellow black white orange purple brown pink gray olive navy teal".split()


def words_text(seed: int, num_words: int) -> str:
    """A prompt of `num_words` words drawn by `seed` (about two tokens each on the demo model)."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def wait_for(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last value: {last!r}")


def metric_values(metrics_url: str, name: str, **labels: str) -> list[float]:
    """Values of every sample of `name` (exact sample name) matching `labels` in one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=30).text
    values = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                values.append(sample.value)
    return values


def metric_sum(metrics_url: str, name: str, **labels: str) -> float:
    return sum(metric_values(metrics_url, name, **labels))


def deploy_app(cluster_config, app: str, overrides: list[str]) -> None:
    """Deploy a second kvtide app at /<app> in the session's Ray instance (returns once it serves).

    Served as model `app`, on the session cluster's ports, from the embedded CPU config plus
    `overrides`: destructive or oddly shaped tests get a fleet of their own.
    """
    from ray import serve

    from kvtide.cluster.app import build_from_config
    from kvtide.config import load_config

    config = load_config(REPO / "config/presets/cpu.yaml", [
        f"http.port={cluster_config.http.port}", f"metrics.port={cluster_config.metrics.port}",
        f"served_model_name={app}", *overrides])
    serve.run(build_from_config(config), name=app, route_prefix=f"/{app}", blocking=False)


def running_engines(app: str) -> int:
    """Engine replicas of `app` in state RUNNING (0 when the app is gone)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "Engine" not in status.deployments:
        return 0
    return status.deployments["Engine"].replica_states.get("RUNNING", 0)


def decided_engines(app: str) -> int:
    """Engine replicas of `app` decided and not leaving (STARTING, UPDATING or RUNNING)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "Engine" not in status.deployments:
        return 0
    states = status.deployments["Engine"].replica_states
    return sum(states.get(state, 0) for state in ("STARTING", "UPDATING", "RUNNING"))


def engine_actor_names(app: str) -> list[str]:
    """Ray actor names of `app`'s engine replicas (namespace 'serve')."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#Engine#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


# --- a real Prometheus --------------------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


class ThreadClients:
    """One httpx.Client per calling thread, used as one client (`get`, `post`, `stream`, ...).

    For tests that send from many threads. httpcore's sync pool is not safe to share under
    load: one thread's pass over the pool can close a connection it has just handed to another
    thread's queued request (encode/httpcore#1110), which that thread sees as a read hanging to
    its timeout or as EBADF. A pool used by one thread has no one to race with."""

    def __init__(self, **client_kwargs: Any):
        self._client_kwargs = client_kwargs
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()

    def _client(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(**self._client_kwargs)
            with self._lock:
                self._clients.append(client)
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client(), name)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def __enter__(self) -> "ThreadClients":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prom:
    """A Prometheus process and its HTTP API."""

    def __init__(self, url: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr, **({"time": at} if at else {})}
        body = self.http.get("/api/v1/query", params=params).json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        body = self.http.get("/api/v1/query_range",
                             params={"query": expr, "start": start, "end": end, "step": step_s}).json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def names(self) -> set[str]:
        return set(self.http.get("/api/v1/label/__name__/values").json()["data"])


def finite(result: list[dict[str, Any]]) -> bool:
    """Whether a query result holds at least one finite value."""
    return any(math.isfinite(float(r["value"][1])) for r in result)


@contextlib.contextmanager
def running_prometheus(work: Path, scrape_configs: str, rule_files: list[str] = ()) -> Iterator[Prom]:
    """Debian's Prometheus scraping every second with `scrape_configs` (YAML list items), stopped on exit."""
    if not Path(PROMETHEUS).exists():
        raise AssertionError("prometheus binary missing: apt-get install -y --no-install-recommends prometheus")
    port = free_port()
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: {list(map(str, rule_files))}\n"
        "scrape_configs:\n" + scrape_configs)
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    prom = Prom(f"http://127.0.0.1:{port}")
    try:
        def ready() -> bool:
            assert proc.poll() is None, (work / "prometheus.log").read_text()
            try:
                return prom.http.get("/-/ready").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, 60, 0.2, "Prometheus to be ready")
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# Tries of an abort before a test gives up on one landing while its request runs (see below).
ABORT_TRIES = 3


def generated_until_aborted(client: httpx.Client, model: str, request_id: str,
                            max_tokens: int) -> tuple[int, list[Any]]:
    """A streamed tokens-in request aborted by /inference/v1/abort_requests once its first event arrived:
    (tokens it generated, the finish reasons it reported).

    A try whose request ran to max_tokens is made again with a new id (ABORT_TRIES at most): on the 2-core
    machine a server (bare vLLM, in a full suite run) has answered an abort only after its request ran to
    the end. An abort that never stops a request still fails, after the last try."""
    for attempt in range(ABORT_TRIES):
        tokens, reasons = _abort_try(client, model, f"{request_id}-{attempt}", max_tokens)
        if tokens < max_tokens:
            return tokens, reasons
    raise AssertionError(f"{request_id}: the request ran to max_tokens despite its abort, {ABORT_TRIES} times")


def _abort_try(client: httpx.Client, model: str, request_id: str, max_tokens: int,
               abort_client: httpx.Client | None = None) -> tuple[int, list[Any]]:
    """One try: the stream read on its own thread while the abort is sent after its first event (by
    `abort_client`, default `client`)."""
    body = {"model": model, "token_ids": [5, 6, 7], "request_id": request_id, "stream": True,
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}
    events: list[str] = []
    first_event, failure = threading.Event(), []

    def read() -> None:
        try:
            with client.stream("POST", "/inference/v1/generate", json=body) as resp:
                if resp.status_code != 200:
                    failure.append(f"generate answered {resp.status_code}: {resp.read()!r}")
                    return
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_event.set()
        except httpx.HTTPError as exc:
            failure.append(repr(exc))
        finally:
            first_event.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first_event.wait(120), "no first event in 120 s"
    # vLLM's engine knows the request as generate-tokens-<request_id>
    aborted = (abort_client or client).post("/inference/v1/abort_requests",
                                            json={"request_ids": [f"generate-tokens-{request_id}"]})
    assert aborted.status_code == 200, aborted.text
    reader.join(300)
    assert not reader.is_alive() and not failure, failure or "the stream did not end in 300 s"
    choices = [c for event in events if event != "[DONE]" for c in json.loads(event)["choices"]]
    return sum(len(c.get("token_ids") or []) for c in choices), [c.get("finish_reason") for c in choices]
