"""`kvtide drain-node` (cluster/drain.py): which node, what is left on it, when the wait ends, what it exits with."""

from __future__ import annotations

import pytest

from kvtide.cluster import drain
from kvtide.cluster.cli import build_parser
from kvtide.cluster.drain import Actor, Node, WhichNode, drain_node, left_on_node, this_node

HEAD, WORKER, OTHER = "aa" * 28, "bb" * 28, "cc" * 28
NODES = [Node(HEAD, "10.0.0.1", True, True), Node(WORKER, "10.0.0.2", True, False),
         Node(OTHER, "10.0.0.3", False, False)]


def _replica(app: str, deployment: str, node: str, rid: str = "r1") -> Actor:
    return Actor(f"SERVE_REPLICA::{app}#{deployment}#{rid}", "serve", node)


def test_this_node_is_the_live_one_at_this_address_or_the_one_named():
    """The live node at the address (none: None); --node-id names one outright; two at one address need --node-id."""
    assert this_node(NODES, None, "10.0.0.2").node_id == WORKER
    assert this_node(NODES, None, "10.0.0.3") is None and this_node(NODES, None, "10.0.0.9") is None
    assert this_node(NODES, OTHER.upper(), "10.0.0.2").node_id == OTHER
    with pytest.raises(WhichNode, match="no Ray node has the id"):
        this_node(NODES, "dd" * 28, "10.0.0.2")
    with pytest.raises(WhichNode, match="--node-id"):
        this_node(NODES + [Node("ee" * 28, "10.0.0.2", True, False)], None, "10.0.0.2")


def test_left_on_a_worker_are_the_apps_replicas_and_its_proxy_and_on_the_controllers_node_what_serve_moves():
    """A worker waits for its engine, routing peer and proxy; the controller's node keeps its proxy and peer."""
    actors = [_replica("kvtide", "Engine", WORKER), _replica("kvtide", "Router", WORKER),
              Actor(f"SERVE_PROXY_ACTOR-{WORKER}", "serve", WORKER), _replica("other", "Engine", WORKER),
              Actor("SERVE_REPLICA::kvtide#Engine#x", "elsewhere", WORKER), _replica("kvtide", "Engine", HEAD, "r2"),
              _replica("kvtide", "Router", HEAD, "r3"), Actor(f"SERVE_PROXY_ACTOR-{HEAD}", "serve", HEAD),
              Actor("SERVE_CONTROLLER_ACTOR", "serve", HEAD)]
    assert left_on_node(actors, WORKER, "kvtide", "Router") == [
        f"SERVE_PROXY_ACTOR-{WORKER}", "SERVE_REPLICA::kvtide#Engine#r1", "SERVE_REPLICA::kvtide#Router#r1"]
    assert left_on_node(actors, HEAD, "kvtide", "Router") == ["SERVE_REPLICA::kvtide#Engine#r2"]


class FakeGcs:
    """The GCS as the drain sees it: a script of what is alive on the worker at each look."""

    def __init__(self, looks: list[list[Actor] | Exception], node_leaves_at: int | None = None,
                 drain_answer: tuple[bool, str] | Exception = (True, "")):
        self.looks, self.node_leaves_at, self.drain_answer = looks, node_leaves_at, drain_answer
        self.drained: list[tuple[str, int, float]] = []
        self.look = 0

    def nodes(self, timeout_s: float) -> list[Node]:
        alive = self.node_leaves_at is None or self.look < self.node_leaves_at
        return [NODES[0], Node(WORKER, "10.0.0.2", alive, False)]

    def alive_actors(self, timeout_s: float) -> list[Actor]:
        look = self.looks[min(self.look, len(self.looks) - 1)]
        self.look += 1
        if isinstance(look, Exception):
            raise look
        return look

    def drain(self, node_id: str, deadline_ms: int, message: str, timeout_s: float) -> tuple[bool, str]:
        if isinstance(self.drain_answer, Exception):
            raise self.drain_answer
        self.drained.append((node_id, deadline_ms, timeout_s))
        return self.drain_answer


class Clock:
    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _drain(gcs: FakeGcs, timeout_s: float = 30.0) -> tuple[int, list[str], Clock]:
    clock, lines = Clock(), []
    status = drain_node(gcs, NODES[1], timeout_s, "kvtide", "Router", lines.append, clock=lambda: clock.now,
                        wall=lambda: 1_000.0 + clock.now, sleep=clock.sleep, poll_s=1.0)
    return status, lines, clock


ENGINE, PEER, PROXY = (_replica("kvtide", "Engine", WORKER), _replica("kvtide", "Router", WORKER),
                       Actor(f"SERVE_PROXY_ACTOR-{WORKER}", "serve", WORKER))


def test_the_drain_asks_ray_with_a_deadline_and_ends_once_nothing_of_the_app_is_left():
    """Preemption drain, deadline now + timeout (ms); each departure logged; exit 0 once engine, peer and proxy left."""
    gcs = FakeGcs([[ENGINE, PEER, PROXY], [ENGINE, PROXY], [ENGINE, PROXY], [PROXY], []])
    status, lines, clock = _drain(gcs)
    assert status == drain.EXIT_DRAINED and gcs.drained == [(WORKER, 1_130_000, 30.0)]
    assert clock.now == 104.0 and "drained in 4.0 s" in lines[-1]
    assert any("left the node: kvtide#Router#r1" in line and "still here: proxy, kvtide#Engine#r1" in line
               for line in lines), lines


def test_a_node_that_left_the_cluster_is_drained():
    """Once the raylet exited on its own (drained and idle), the wait ends."""
    status, lines, _ = _drain(FakeGcs([[ENGINE]], node_leaves_at=3))
    assert status == drain.EXIT_DRAINED and "left the cluster" in lines[-1]


def test_the_wait_ends_at_the_timeout_with_exit_0_and_never_sleeps_past_it():
    """What never leaves is named at the timeout; the stop goes on (exit 0) exactly at the timeout."""
    status, lines, clock = _drain(FakeGcs([[ENGINE]]), timeout_s=2.5)
    assert status == drain.EXIT_DRAINED and clock.now == 102.5 and clock.sleeps == [1.0, 1.0, 0.5]
    assert "timed out after 2.5 s; still on the node: kvtide#Engine#r1" in lines[-1]


def test_a_failed_look_is_retried_and_a_refused_or_failed_drain_request_exits_1():
    """A GCS read that fails is logged and made again; a drain Ray refuses, or cannot be asked, exits 1."""
    status, lines, _ = _drain(FakeGcs([[ENGINE], TimeoutError("slow"), []]))
    assert status == drain.EXIT_DRAINED and any("could not read" in line for line in lines)
    status, lines, _ = _drain(FakeGcs([[]], drain_answer=(False, "no")))
    assert status == drain.EXIT_NO_RAY and "refused" in lines[-1]
    status, lines, _ = _drain(FakeGcs([[]], drain_answer=ConnectionError("gone")))
    assert status == drain.EXIT_NO_RAY and "failed" in lines[-1]


def test_serves_actor_names_are_rays():
    """The names the drain looks for are the ones Ray Serve gives its replicas, proxies and controller."""
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE, SERVE_PROXY_NAME
    from ray.serve._private.utils import format_actor_name

    assert drain.REPLICA_PREFIX == REPLICA_ID_FULL_ID_STR_PREFIX and drain.SERVE_NAMESPACE == SERVE_NAMESPACE
    assert drain.CONTROLLER_NAME == SERVE_CONTROLLER_NAME
    assert format_actor_name(SERVE_PROXY_NAME, WORKER) == drain.PROXY_PREFIX + WORKER


def test_drain_node_is_a_command_and_an_unreachable_ray_exits_1_within_its_timeout(capsys):
    """`kvtide drain-node --timeout-s N` parses; with no GCS at the address it exits 1 with a message, in time."""
    import time

    args = build_parser().parse_args(["drain-node", "--timeout-s", "1", "--address", "127.0.0.1:1"])
    started = time.monotonic()
    assert args.func(args) == drain.EXIT_NO_RAY
    assert time.monotonic() - started < 10
    assert "cannot reach Ray" in capsys.readouterr().out
