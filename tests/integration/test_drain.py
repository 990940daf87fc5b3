"""An engine replica's node drained under load, as a pod stopping for an upgrade: `kvtide drain-node` on it.

Its own cluster of two Ray nodes on this machine (cluster/nodes.py, as test_multinode.py starts
them; `make test` runs the `multinode` modules in a pytest run of their own): one engine replica on
the head, one on node 1, and room on the head for a third, held by a placeholder actor until the
drain so that the first two land one per node. Long streams run through both nodes' HAProxy, to
replicas on both nodes, while node 1 is drained with the command its pod's preStop runs: Serve
starts a replacement on the head and stops node 1's replica gracefully, node 1's HAProxy drains,
and every other HAProxy reloads as the replica set changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

import ray
from ray import serve
from support import REPO, ThreadClients, running_engines, wait_for

from kvtide.cluster import local
from kvtide.cluster.nodes import engine_cpus
from kvtide.config import load_config
from kvtide.deployments.names import ENGINE_DEPLOYMENT

pytestmark = pytest.mark.multinode

DRAIN_PORT = 18400
DRAIN_METRICS_PORT = 18480
APP = local.APP_NAME
ENGINE_CLASS = f"ServeReplica:{APP}:{ENGINE_DEPLOYMENT}"
STREAMS = 20
# Tokens per stream (ignore_eos): enough that the streams outlast, several times over, the time
# Serve takes to stop node 1's replica once the drain begins (its controller loop, on a machine the
# streams keep busy), so the replica is stopped while it holds streams; few enough that each
# engine's share of them fits its KV cache (config/presets/cpu.yaml) without preemption.
STREAM_TOKENS = 1000
# The drain's bound (--timeout-s): no longer than the request deadline (the preset's
# frontend.admission.request_timeout_s), so Serve stops node 1's replica at once, its streams
# running, rather than after its replacement starts.
DRAIN_TIMEOUT_S = 300
STREAM_BOUND_S = 300.0
REPLACEMENT_BOUND_S = 300.0


@ray.remote(num_cpus=0)
class Placeholder:
    """Holds an engine's worth of the head's CPUs until it is killed."""

    def ready(self) -> bool:
        return True


@dataclass
class TwoNodes:
    cluster: local.LocalCluster
    urls: list[str]  # each node's OpenAI API, the head's first
    head_id: str
    worker_id: str
    placeholder: object


@pytest.fixture(scope="module")
def two_nodes() -> TwoNodes:
    config = load_config(REPO / "config/presets/cpu.yaml", [
        f"http.port={DRAIN_PORT}", f"metrics.port={DRAIN_METRICS_PORT}", "replicas.num_replicas=2"])
    assert DRAIN_TIMEOUT_S <= config.frontend.admission.request_timeout_s  # see DRAIN_TIMEOUT_S
    held: dict[str, object] = {}

    def hold_one_engine_on_the_head() -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        head = next(n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
        held["head_id"] = head["NodeID"]
        held["placeholder"] = Placeholder.options(
            num_cpus=engine_cpus(config),
            scheduling_strategy=NodeAffinitySchedulingStrategy(head["NodeID"], soft=False)).remote()
        ray.get(held["placeholder"].ready.remote(), timeout=60)

    with local.running(config, nodes=2, engines_per_node=[2, 1], before_deploy=hold_one_engine_on_the_head) as cluster:
        worker_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != held["head_id"])
        yield TwoNodes(cluster, [n.plan.base_url for n in cluster.nodes.nodes], held["head_id"], worker_id,
                       held["placeholder"])


def _engines_by_node() -> dict[str, list[str]]:
    """Node id → replica ids of the live engine replicas on it."""
    from ray.util.state import list_actors

    by_node: dict[str, list[str]] = {}
    for actor in list_actors(filters=[("class_name", "=", ENGINE_CLASS), ("state", "=", "ALIVE")], detail=True):
        by_node.setdefault(actor.node_id, []).append(actor.name.rsplit("#", 1)[1])
    return by_node


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    via: int  # the node whose port it was sent to
    status: int = 0
    replica: str = ""
    error: str | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False
    ended_s: float = 0.0
    first_token: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def outcome(self) -> str:
        """"complete": its 200, every token, finish_reason length, [DONE]; else what it got. A retry HAProxy made
        before the first byte (a replica refusing, or its retryable 503) is invisible here: the stream completes."""
        if (self.status == 200 and self.done and self.error is None and self.finish_reason == "length"
                and self.completion_tokens == STREAM_TOKENS):
            return "complete"
        return f"status={self.status} error={self.error} finish={self.finish_reason} " \
               f"tokens={self.completion_tokens} done={self.done}"


def _stream(client: httpx.Client, url: str, i: int, result: Stream) -> None:
    body = {"model": "kvtide-demo", "prompt": f"stream {i}: " + " ".join(f"w{i}-{k}" for k in range(40)),
            "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            result.status, result.replica = resp.status_code, resp.headers.get("x-kvtide-replica", "")
            if resp.status_code != 200:
                resp.read()
                result.error = (resp.json().get("error") or {}).get("code") if resp.headers.get(
                    "content-type", "").startswith("application/json") else resp.text[:200]
                return
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.done = True
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    result.error = event["error"].get("code")
                for choice in event.get("choices") or []:
                    result.first_token.set()
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if event.get("usage"):
                    result.completion_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        result.error = f"client:{type(exc).__name__}"
    finally:
        result.ended_s = time.monotonic()
        result.ended.set()


def test_draining_a_node_under_long_streams_cuts_none_and_its_replica_returns_elsewhere(two_nodes):
    """20 long streams through both nodes' ports; `kvtide drain-node` on node 1: every stream ends whole (node 1's
    replica stopped while holding some), the command exits 0 within its timeout, a replacement serves on the head."""
    placed = _engines_by_node()
    assert {node: len(ids) for node, ids in placed.items()} == {two_nodes.head_id: 1, two_nodes.worker_id: 1}, placed
    (victim,) = placed[two_nodes.worker_id]
    client = ThreadClients(timeout=httpx.Timeout(STREAM_BOUND_S, connect=10))
    results = [Stream(via=i % 2) for i in range(STREAMS)]
    stopping_seen: list[float] = []
    watching = threading.Event()

    def watch_for_the_stop() -> None:
        """When Serve first reports an engine replica STOPPING (node 1's: nothing else stops)."""
        while not watching.is_set():
            states = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT].replica_states
            if states.get("STOPPING") and not stopping_seen:
                stopping_seen.append(time.monotonic())
            watching.wait(0.2)

    with ThreadPoolExecutor(STREAMS + 1) as pool:
        futures = [pool.submit(_stream, client, two_nodes.urls[r.via], i, r) for i, r in enumerate(results)]
        wait_for(lambda: all(r.first_token.is_set() or r.ended.is_set() for r in results), 180, 0.2,
                 "every stream's first token")
        assert all(r.first_token.is_set() for r in results), [r.outcome for r in results]
        served = Counter(r.replica for r in results)
        watcher = pool.submit(watch_for_the_stop)
        ray.kill(two_nodes.placeholder)  # room on the head for node 1's replacement
        drain_started = time.monotonic()
        # As node 1's pod runs it in its preStop: this node found by its address, the GCS by its address.
        drain = subprocess.Popen(
            [sys.executable, "-m", "kvtide.cluster.cli", "drain-node", "--timeout-s", str(DRAIN_TIMEOUT_S),
             "--address", two_nodes.cluster.nodes.address,
             "--node-ip-address", two_nodes.cluster.nodes.nodes[1].plan.ip],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for future in futures:
            future.result(timeout=STREAM_BOUND_S + 30)
        streams_done_s = time.monotonic() - drain_started
        # Its streams over, the client leaves: node 1's HAProxy drains once it holds no connection, and an
        # idle kept-alive one would hold it until Serve's keep-alive timeout.
        client.close()
        try:
            drain_log, _ = drain.communicate(timeout=DRAIN_TIMEOUT_S + 60)
        finally:
            drain.kill()
            watching.set()
        drain_s = time.monotonic() - drain_started
        watcher.result(timeout=30)

    on_victim = [r for r in results if r.replica == victim]
    outcomes = Counter(r.outcome for r in results)
    stop_s = stopping_seen[0] - drain_started if stopping_seen else None
    held_s = max(r.ended_s for r in on_victim) - stopping_seen[0] if on_victim and stopping_seen else None
    print(f"\ndrain: streams per replica {dict(served)} (node 1's: {victim}); outcomes {dict(outcomes)}; "
          f"node 1's replica STOPPING {stop_s if stop_s is None else round(stop_s, 1)} s after the drain began, "
          f"its last stream ended {held_s if held_s is None else round(held_s, 1)} s after that; every stream "
          f"ended {streams_done_s:.1f} s after the drain began; drain-node exited {drain.returncode} after "
          f"{drain_s:.1f} s:\n{drain_log}")
    assert outcomes == Counter({"complete": STREAMS}), outcomes
    assert drain.returncode == 0 and drain_s < DRAIN_TIMEOUT_S, drain_log
    assert "drained in" in drain_log, drain_log
    # What this test is for: node 1's replica was stopped while it held streams, and they finished.
    assert on_victim and stopping_seen and held_s > 0, (dict(served), stopping_seen)

    wait_for(lambda: running_engines(APP) == 2 and two_nodes.worker_id not in _engines_by_node(),
             REPLACEMENT_BOUND_S, 0.5, "two engine replicas serving, none on the drained node")
    reply = httpx.post(f"{two_nodes.urls[0]}/v1/completions", timeout=120,
                       json={"model": "kvtide-demo", "prompt": "after the drain", "max_tokens": 4})
    assert reply.status_code == 200, reply.text
