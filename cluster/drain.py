"""`kvtide drain-node`: hand this Ray node's share of the app to the rest of the cluster, then let it stop.

Run on the node that is going away, before Ray stops there (the chart's preStop runs
`kvtide drain-node --timeout-s N; ray stop`). It asks the GCS to drain this node, as
`ray drain-node` does (reason preemption, deadline now + N), waits until no Serve replica of the
app runs here and this node's Serve proxy is gone (or N has passed), says what it saw, and exits
0: it never holds a stop past N. It exits non-zero, with a message, only when it cannot reach Ray
(or cannot tell which node is this one).

What Ray 2.60 does with a draining node (paths under ray/, lines of the installed source):

- The raylet takes no new work, and once nothing holds a lease on it any more (every actor on
  it gone, zero-CPU ones included) it shuts itself down (_private/node.py:739; the raylet's
  LocalResourceManager::OnResourceOrStateChanged). So the node leaves the cluster on its own
  once Serve has moved everything off it, and only then.
- Serve's controller reads the draining nodes and their deadlines from the GCS every loop
  (serve/_private/cluster_node_info_cache.py:76) and, per deployment
  (serve/_private/deployment_state.py:7015, migrate_replicas_on_draining_nodes at :5928):
  a RUNNING replica on the node becomes PENDING_MIGRATION (:6034), still routed, and the scale
  step starts a replacement elsewhere, since PENDING_MIGRATION does not count toward the target;
  once the replacement runs, the old replica is stopped gracefully (:6074). It is stopped then
  whether or not its replacement runs once now >= deadline - graceful_shutdown_timeout_s
  (:5906): with N no longer than the request deadline (cluster/app.py sets
  graceful_shutdown_timeout_s to it), this node's replicas stop at once, gracefully, while their
  replacements start. A replica still starting there is stopped at once (:6052).
- A graceful stop of an engine replica (serve/_private/replica.py:2192, behind HAProxy :2121):
  it stays reachable for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S while HAProxy learns it
  is leaving, closes its listener (:2150; HAProxy retries a refused connection on another
  replica), and waits until no request is ongoing (a stream is ongoing until its last byte), for
  at most graceful_shutdown_timeout_s; then the destructor stops its engine.
- The routing peer is pinned to proxy nodes, and a draining node is none
  (serve/_private/controller.py:588), so the peer here is stopped
  (deployment_state.py:4033). The proxy here (HAProxy) is set draining
  (serve/_private/proxy_state.py:596): its health check answers "This node is being drained",
  so a load balancer sends it no new connection; Serve removes it once it has drained for
  RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S and holds no connection, its old processes from
  reloads included (serve/_private/haproxy.py:1993, proxy_state.py:1041). The streams it
  carries to replicas on other nodes finish first; a client's idle kept-alive connection holds
  it too, until Serve's keep-alive timeout closes it.
- The controller's own node keeps its proxy, and that proxy its routing peer
  (controller.py:598): there only the other replicas leave, and the raylet never idles.
- Every other node's HAProxy reloads as the replica set changes; its old process keeps the
  streams it holds until hard-stop-after, which KvtideConfig.ray_process_env sets past the
  request deadline.
- `ray start --block` drains its node the same way when it gets SIGTERM, but for
  RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S only (_private/node.py:666), shorter than a request may
  last; this command, run before the SIGTERM, gives the drain N.

So N should be at least the request deadline (frontend.admission.request_timeout_s): a longer N
also lets this node's replicas wait up to N minus that deadline for their replacements to run.
`ray stop` after it stops whatever is left. Pure parts (which node is this one, what is left on
it, when to stop waiting) are apart from the Ray glue (`RayGcs`) and unit-tested without Ray.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

# Ray Serve's actor names (ray.serve._private: common.REPLICA_ID_FULL_ID_STR_PREFIX,
# constants.SERVE_PROXY_NAME, constants.SERVE_CONTROLLER_NAME; a unit test compares them).
SERVE_NAMESPACE = "serve"
REPLICA_PREFIX = "SERVE_REPLICA::"
PROXY_PREFIX = "SERVE_PROXY_ACTOR-"
CONTROLLER_NAME = "SERVE_CONTROLLER_ACTOR"
DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"  # not rejectable: the node is going away
DRAIN_MESSAGE = "kvtide drain-node: this node is stopping"

# How often the drain is watched (each look is two GCS reads).
POLL_S = 1.0
# Longest a GCS call may take: connecting, the drain request, each look.
GCS_TIMEOUT_S = 30.0

EXIT_DRAINED = 0
EXIT_NO_RAY = 1  # the GCS cannot be reached, or refused the drain
EXIT_WHICH_NODE = 2  # this node cannot be told apart: pass --node-id


@dataclass(frozen=True)
class Node:
    node_id: str  # hex
    ip: str
    alive: bool
    is_head: bool


@dataclass(frozen=True)
class Actor:
    """A live actor, as the GCS lists it."""

    name: str
    namespace: str
    node_id: str  # hex


class Gcs(Protocol):
    """What the drain needs of Ray's GCS (`RayGcs` in a cluster; a fake in unit tests); each call
    gives up after `timeout_s`."""

    def nodes(self, timeout_s: float) -> list[Node]: ...

    def alive_actors(self, timeout_s: float) -> list[Actor]: ...

    def drain(self, node_id: str, deadline_ms: int, message: str, timeout_s: float) -> tuple[bool, str]: ...


class WhichNode(Exception):
    """This node cannot be told apart from the others (the message says what to pass)."""


def this_node(nodes: Iterable[Node], node_id: str | None, ip: str) -> Node | None:
    """The node to drain: `node_id` if given, else the one live node at `ip`; None when none is alive there.

    Several live nodes at one address (Ray nodes sharing a host) cannot be told apart by it: WhichNode.
    """
    nodes = list(nodes)
    if node_id is not None:
        named = [n for n in nodes if n.node_id == node_id.lower()]
        if not named:
            raise WhichNode(f"no Ray node has the id {node_id}; known: {', '.join(n.node_id for n in nodes) or 'none'}")
        return named[0]
    here = [n for n in nodes if n.alive and n.ip == ip]
    if len(here) > 1:
        raise WhichNode(f"{len(here)} live Ray nodes have the address {ip} "
                        f"({', '.join(n.node_id for n in here)}); name one with --node-id")
    return here[0] if here else None


def left_on_node(actors: Iterable[Actor], node_id: str, app: str, router_deployment: str) -> list[str]:
    """What of Serve the drain still waits for on `node_id`: the app's replicas and the node's proxy, by name.

    On the node of Serve's controller the proxy and its routing peer stay (Serve keeps a proxy beside
    its controller), so there only the app's other replicas are waited for.
    """
    on_node = [a for a in actors if a.node_id == node_id and a.namespace == SERVE_NAMESPACE]
    keeps_proxy = any(a.name == CONTROLLER_NAME for a in on_node)
    replica = f"{REPLICA_PREFIX}{app}#"
    router = f"{replica}{router_deployment}#"
    return sorted(a.name for a in on_node
                  if (a.name.startswith(replica) and not (keeps_proxy and a.name.startswith(router)))
                  or (a.name.startswith(PROXY_PREFIX) and not keeps_proxy))


def deadline_ms(now_s: float, timeout_s: float) -> int:
    """The drain's deadline as the GCS takes it: wall-clock milliseconds."""
    return int((now_s + timeout_s) * 1000)


def short(name: str) -> str:
    """An actor name without Serve's prefix (`kvtide#Engine#ab12`, `proxy`), for the log."""
    if name.startswith(PROXY_PREFIX):
        return "proxy"
    return name.removeprefix(REPLICA_PREFIX)


def drain_node(gcs: Gcs, node: Node, timeout_s: float, app: str, router_deployment: str,
               log: Callable[[str], None], started: float | None = None,
               clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
               sleep: Callable[[float], None] = time.sleep, poll_s: float = POLL_S) -> int:
    """Drain `node` and watch it until nothing of the app is left there, the node is gone, or
    `timeout_s` passed since `started` (clock time; default now).

    Returns the exit status: EXIT_DRAINED however the wait ends (a stop is never held past the
    timeout), EXIT_NO_RAY when the drain request fails. A look at the GCS that fails is logged and
    the next one made.
    """
    started = clock() if started is None else started

    def remaining_s() -> float:
        return max(0.0, timeout_s - (clock() - started))

    def call_timeout_s() -> float:  # a GCS call never outlasts the drain (a floor: a call needs some time)
        return max(1.0, min(GCS_TIMEOUT_S, remaining_s()))

    try:
        accepted, why = gcs.drain(node.node_id, deadline_ms(wall(), remaining_s()), DRAIN_MESSAGE, call_timeout_s())
    except Exception as exc:  # the GCS went away, or the call timed out
        log(f"the drain request for node {node.node_id} failed: {type(exc).__name__}: {exc}")
        return EXIT_NO_RAY
    if not accepted:
        log(f"Ray refused to drain node {node.node_id}: {why}")
        return EXIT_NO_RAY
    log(f"node {node.node_id} ({node.ip}{', head' if node.is_head else ''}) is draining; "
        f"waiting up to {timeout_s:g} s for the app '{app}' and this node's proxy to leave it")
    seen: list[str] | None = None
    while True:
        elapsed = clock() - started
        try:
            if not any(n.node_id == node.node_id and n.alive for n in gcs.nodes(call_timeout_s())):
                log(f"drained in {elapsed:.1f} s: the node left the cluster (its raylet stops once nothing runs there)")
                return EXIT_DRAINED
            left = left_on_node(gcs.alive_actors(call_timeout_s()), node.node_id, app, router_deployment)
        except Exception as exc:
            log(f"could not read the cluster's state ({type(exc).__name__}: {exc}); looking again")
            left = seen
        if left is not None and left != seen:
            if seen is not None:
                gone = sorted(set(seen) - set(left))
                log(f"after {elapsed:.1f} s: left the node: {', '.join(map(short, gone)) or 'nothing'}; "
                    f"still here: {', '.join(map(short, left)) or 'nothing'}")
            else:
                log(f"on the node now: {', '.join(map(short, left)) or 'nothing of the app'}")
            seen = left
        if seen == []:
            log(f"drained in {elapsed:.1f} s: no replica of '{app}' and no proxy left on the node")
            return EXIT_DRAINED
        if elapsed >= timeout_s:
            log(f"timed out after {timeout_s:g} s; still on the node: "
                f"{', '.join(map(short, seen or [])) or 'unknown'} (what stops with the node now is cut)")
            return EXIT_DRAINED
        sleep(min(poll_s, remaining_s()))


# --- Ray glue ------------------------------------------------------------------------------


class RayGcs:
    """Ray's GCS, reached the way `ray drain-node` reaches it: no driver, so nothing of this process
    runs on the node being drained (its raylet exits under it once drained)."""

    def __init__(self, address: str | None, connect_timeout_s: float = GCS_TIMEOUT_S):
        import ray
        from ray._private import services

        self.address = services.canonicalize_bootstrap_address_or_die(address)
        self.client = _within(connect_timeout_s, lambda: ray._raylet.GcsClient(address=self.address),
                              f"Ray's GCS at {self.address}")

    def nodes(self, timeout_s: float) -> list[Node]:
        from ray.core.generated import gcs_pb2

        alive = gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE")
        return [Node(node_id.hex(), info.node_manager_address, info.state == alive, info.is_head_node)
                for node_id, info in self.client.get_all_node_info(timeout=timeout_s).items()]

    def alive_actors(self, timeout_s: float) -> list[Actor]:
        async def read():
            return await self.client.async_get_all_actor_info(actor_state_name="ALIVE", timeout=timeout_s)

        return [Actor(a.name, a.ray_namespace, a.address.node_id.hex()) for a in asyncio.run(read()).values()]

    def drain(self, node_id: str, deadline_ms: int, message: str, timeout_s: float) -> tuple[bool, str]:
        from ray.core.generated import autoscaler_pb2

        # The node id as hex: the GCS decodes it with FromHex (ray/_private/node.py says so).
        return self.client.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(DRAIN_REASON), message,
                                      deadline_ms, timeout=timeout_s)


def _within(timeout_s: float, call: Callable[[], object], what: str) -> object:
    """`call()`'s result, or ConnectionError once `timeout_s` passed (Ray's own connect can wait longer)."""
    result: list[object] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="kvtide-gcs-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if failure:
        raise ConnectionError(f"cannot reach {what}: {type(failure[0]).__name__}: {failure[0]}") from failure[0]
    if not result:
        raise ConnectionError(f"cannot reach {what} within {timeout_s:g} s")
    return result[0]


def main(timeout_s: float, address: str | None = None, node_id: str | None = None,
         node_ip_address: str | None = None, app: str | None = None) -> int:
    """`kvtide drain-node`: the exit status (module docstring)."""
    from kvtide.cluster.serve_config import APP_NAME
    from kvtide.deployments.names import ROUTER_DEPLOYMENT

    def log(line: str) -> None:
        print(f"kvtide drain-node: {line}", flush=True)

    started = time.monotonic()  # the timeout counts from here: connecting spends it too
    app = app or APP_NAME
    try:
        gcs = RayGcs(address, max(1.0, min(GCS_TIMEOUT_S, timeout_s)))
        if node_ip_address is None and node_id is None:
            from ray._private import services

            node_ip_address = services.get_node_ip_address()
        node = this_node(gcs.nodes(max(1.0, min(GCS_TIMEOUT_S, timeout_s))), node_id, node_ip_address or "")
    except WhichNode as exc:
        log(str(exc))
        return EXIT_WHICH_NODE
    except Exception as exc:  # no Ray instance found, the GCS unreachable, a call timed out
        log(f"cannot reach Ray: {type(exc).__name__}: {exc}")
        return EXIT_NO_RAY
    if node is None:
        log(f"no live Ray node at {node_ip_address}: nothing to drain")
        return EXIT_DRAINED
    if not node.alive:
        log(f"node {node.node_id} has left the cluster already: nothing to drain")
        return EXIT_DRAINED
    return drain_node(gcs, node, timeout_s, app, ROUTER_DEPLOYMENT, log, started)
