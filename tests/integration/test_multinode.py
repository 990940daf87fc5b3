"""Two Ray nodes on one machine, each running an engine replica, HAProxy and a routing peer.

Its own cluster, not the session's (a process drives one Ray cluster at a time): `make test`
runs this module in a pytest run of its own (`-m multinode`). The nodes are started as Ray
documents, with `ray start` (cluster/nodes.py, what `kvtide serve --nodes 2` runs): node 0, the
head, serves HTTP on MN_PORT and exports metrics on MN_METRICS_PORT; node 1 on the next ports.
Three engine replicas: the head offers room for three engines, one of them held by a
placeholder actor until the node-loss test, so the deployment puts two engines on the head and
one on node 1; the node-loss test frees it, so the head can take the lost node's replica. Three,
not two: where two replicas both hold a group's prefix and a third does not, the group's owner
among the holders takes it (routing.tie_band_tokens); with two replicas both holding it, load
alone decides.

Load does not move a prompt off a replica holding it here (CACHE_FIRST_ROUTING): a pick-only
routing peer counts its picks since the engine's last report (~1 s) as load while they have
probably not finished, an estimate from the engine's recent request durations, so one peer's
recent picks can outweigh the band and move a group to the other holder, more often the faster
the machine. What these tests pin is what routing
peers that share no state agree on from the engines' digests; the load guard, the band and
replication are pinned by the policy's unit tables.

The tests run in file order on one cluster; the last kills node 1.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import httpx
import psutil
import pytest

import ray
from ray import serve
from support import REPO, finite, metric_sum, running_engines, running_prometheus, wait_for

from kvtide.autoscaling.warm_start import fleet_view
from kvtide.cluster import local
from kvtide.cluster.nodes import engine_cpus, kill_node
from kvtide.config import load_config
from kvtide.dashboards import build
from kvtide.dashboards.promql import resolve_grafana_vars
from kvtide.deployments.names import ENGINE_DEPLOYMENT, ROUTER_DEPLOYMENT

pytestmark = pytest.mark.multinode

MN_PORT = 18300
MN_METRICS_PORT = 18380
APP = local.APP_NAME
ENGINES = 3  # two on the head, one on node 1
ENGINE_CLASS = f"ServeReplica:{APP}:{ENGINE_DEPLOYMENT}"
GROUPS = 6
REQUESTS_PER_GROUP = 40
# Among holders, routing by cache and rendezvous alone (the module docstring says why): an uncached
# token outweighs any queue, the guard's slack is out of any load's reach, every replica ties with a
# first place that holds the prompt, no group is hot. A prompt nobody holds still goes by load.
CACHE_FIRST_ROUTING = ["routing.uncached_weight=1000", "routing.load_guard_slack=1000000",
                       "routing.tie_band_tokens=1000000000", "routing.replication_max_replicas=1"]
WARM_TOKENS = "ray_kvtide_engine_warmup_prefill_tokens_total"


@ray.remote(num_cpus=0)
class Placeholder:
    """Holds an engine's worth of the head's CPUs until it is killed."""

    def ready(self) -> bool:
        return True


@dataclass
class MultiNode:
    cluster: local.LocalCluster
    urls: list[str]  # each node's OpenAI API base URL, node 0 first
    metrics_urls: list[str]
    head_id: str
    worker_id: str
    placeholder: object


def _engines_by_node() -> dict[str, list[int]]:
    """Node id → pids of the live engine replica actors on it."""
    from ray.util.state import list_actors

    by_node: dict[str, list[int]] = defaultdict(list)
    for actor in list_actors(filters=[("class_name", "=", ENGINE_CLASS), ("state", "=", "ALIVE")], detail=True):
        by_node[actor.node_id].append(actor.pid)
    return dict(by_node)


@pytest.fixture(scope="module")
def multinode() -> MultiNode:
    config = load_config(REPO / "config/presets/cpu.yaml", [f"http.port={MN_PORT}", f"metrics.port={MN_METRICS_PORT}",
                                                            f"replicas.num_replicas={ENGINES}", *CACHE_FIRST_ROUTING])
    held: dict[str, object] = {}

    def hold_one_engine_on_the_head() -> None:
        head = next(n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        held["head_id"] = head["NodeID"]
        held["placeholder"] = Placeholder.options(
            num_cpus=engine_cpus(config),
            scheduling_strategy=NodeAffinitySchedulingStrategy(head["NodeID"], soft=False)).remote()
        ray.get(held["placeholder"].ready.remote(), timeout=60)

    with local.running(config, nodes=2, engines_per_node=[ENGINES, 1], metrics_report_interval_ms=1000,
                       before_deploy=hold_one_engine_on_the_head) as cluster:
        worker_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != held["head_id"])
        yield MultiNode(cluster, [n.plan.base_url for n in cluster.nodes.nodes],
                        [n.plan.metrics_url for n in cluster.nodes.nodes], held["head_id"], worker_id,
                        held["placeholder"])


def _complete(url: str, prompt: str, max_tokens: int = 4, timeout_s: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout_s,
                      json={"model": "kvtide-demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _group_prompt(group: str, i: int) -> str:
    # ~300 tokens shared by the group (its first 128 tokens name it), then the request's own tail.
    return f"Group {group} system prompt. " + " ".join(f"{group}-rule-{k}" for k in range(60)) + f" Question {i}?"


# Distinct prompts until each replica has answered one; new prefixes go to the emptiest cache, so
# a proxy that reaches both engines alternates within a few requests.
MAX_SPREAD_REQUESTS = 40


def _replicas_reached(url: str, tag: str, replicas: int = ENGINES) -> Counter:
    """Replicas that answered distinct prompts through `url`, sent until `replicas` of them have."""
    seen: Counter = Counter()
    for i in range(MAX_SPREAD_REQUESTS):
        reply = _complete(url, f"{tag} distinct prompt {i}: " + " ".join(f"w{i}-{k}" for k in range(80)))
        assert reply.status_code == 200, reply.text
        seen[reply.headers["x-kvtide-replica"]] += 1
        if len(seen) == replicas:
            break
    return seen


def test_engines_on_both_nodes_and_either_nodes_port_serves_them_all(multinode):
    """Two engines on the head, one on node 1; through either node's port, all three (on both nodes) serve."""
    placed = _engines_by_node()
    assert {node: len(pids) for node, pids in placed.items()} == {multinode.head_id: 2, multinode.worker_id: 1}, placed
    served_via = {node: _replicas_reached(url, f"node{node}") for node, url in enumerate(multinode.urls)}
    print(f"\nmultinode: replicas answering through each node's port: {served_via}")
    assert all(len(counts) == ENGINES for counts in served_via.values()), served_via


def test_a_prompt_groups_requests_reach_one_replica_whichever_node_receives_them(multinode):
    """Shared-prefix groups, each request through the other node's port than the last: once both routing peers
    route from the engines' digests, each group's requests all reach one replica, through either port.

    A group's first requests can land on two replicas: a peer that has not yet seen the other's first pick
    in a digest (one stats period, ~1 s) holds no copy of the group in its view and sends it to the
    emptiest engine as it sees them. After that both peers see the same holders and pick the group's
    rendezvous owner among them. The second half of the run (120 requests, one at a time, against a 1 s
    digest period) is past that point by a wide margin.
    """
    served: dict[int, list[tuple[int, str]]] = defaultdict(list)
    checks_before = _agreement_checks(multinode)
    for i in range(REQUESTS_PER_GROUP):
        for group in range(GROUPS):
            node = (group + i) % 2
            reply = _complete(multinode.urls[node], _group_prompt(f"g{group}", i))
            assert reply.status_code == 200, reply.text
            served[group].append((node, reply.headers["x-kvtide-replica"]))
    settled = {g: {replica for _, replica in replies[REQUESTS_PER_GROUP // 2:]} for g, replies in served.items()}
    on_main = {g: Counter(r for _, r in replies).most_common(1)[0][1] for g, replies in served.items()}
    checks = _agreement_checks(multinode) - checks_before
    print(f"\nmultinode: {sum(on_main.values())} of {GROUPS * REQUESTS_PER_GROUP} requests on their group's main "
          f"replica (per group {on_main}); the routing peers' sampled agreement checks: {dict(checks)}; "
          f"sequence per group: {dict(served)}")
    assert all(len(replicas) == 1 for replicas in settled.values()), served


def _agreement_checks(multinode) -> Counter:
    """The routing peers' agreement checks so far, by (node, agrees), from each node's own metrics port."""
    from support import metric_values

    return Counter({(node, agrees): sum(metric_values(url, "ray_kvtide_router_agreement_checks_total", agrees=agrees))
                    for node, url in enumerate(multinode.metrics_urls) for agrees in ("true", "false")})


def test_warm_start_merges_both_nodes_hot_prefixes(multinode):
    """Each node's peer sees only its own traffic; a new replica warm-starts with both nodes' hot prefixes."""
    for i in range(4):  # group A only through node 0, group B only through node 1
        assert _complete(multinode.urls[0], _group_prompt("warmA", i)).status_code == 200
        assert _complete(multinode.urls[1], _group_prompt("warmB", i)).status_code == 200
    async def broadcast() -> list:  # what a new replica's warm start asks every routing peer
        peers = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=APP)
        return await peers.broadcast("hot_prefixes").results_async(timeout_s=30)

    views = asyncio.run(broadcast())
    tokenize = httpx.post(f"{multinode.urls[0]}/tokenize", timeout=30,
                          json={"model": "kvtide-demo", "prompt": "Group warmA system prompt. warmA-rule-0"}).json()
    stem_a = tokenize["tokens"][:8]
    stem_b = httpx.post(f"{multinode.urls[0]}/tokenize", timeout=30,
                        json={"model": "kvtide-demo", "prompt": "Group warmB system prompt. warmB-rule-0"}).json()["tokens"][:8]

    def holds(view, stem) -> list:
        return [tokens for tokens, _ in view if list(tokens[:len(stem)]) == stem]

    assert len(views) == 2, views
    assert sum(bool(holds(v, stem_a)) for v in views) == 1 and sum(bool(holds(v, stem_b)) for v in views) == 1
    assert not any(holds(v, stem_a) and holds(v, stem_b) for v in views), "each peer saw one node's traffic only"
    merged = fleet_view(views)
    expected_tokens = max(map(len, holds(merged, stem_a))) // 32 * 32 + max(map(len, holds(merged, stem_b))) // 32 * 32

    # Restart the head's engine: its replacement asks both peers and prefills both groups.
    def warm_tokens() -> float:
        return sum(metric_sum(url, WARM_TOKENS) for url in multinode.metrics_urls)

    before = warm_tokens()
    head_engine = next(a for a in _actor_names_on(multinode.head_id))
    ray.kill(ray.get_actor(head_engine, namespace="serve"), no_restart=True)
    wait_for(lambda: running_engines(APP) < ENGINES, 60, 0.2, "Serve to notice the killed replica")
    wait_for(lambda: running_engines(APP) == ENGINES, 300, 0.5, "the replacement replica to serve")
    wait_for(lambda: warm_tokens() - before >= expected_tokens, 30, 0.5,
             f"the replacement's warm-up of both nodes' prefixes ({expected_tokens} tokens)")
    print(f"\nmultinode: replacement prefilled {warm_tokens() - before:.0f} tokens (both groups' stems: "
          f"{expected_tokens})")


def _actor_names_on(node_id: str) -> list[str]:
    from ray.util.state import list_actors

    return [a.name for a in list_actors(filters=[("class_name", "=", ENGINE_CLASS), ("state", "=", "ALIVE")],
                                        detail=True) if a.node_id == node_id]


def test_prometheus_scrapes_both_nodes_and_every_dashboard_query_over_their_series_returns_data(multinode,
                                                                                                  tmp_path):
    """Prometheus, fed Ray's service-discovery file, scrapes both nodes; engine and router series come from each;
    every panel query over the scraped series returns a series."""
    discovery = multinode.cluster.nodes.head.temp_dir / "session_latest" / "prom_metrics_service_discovery.json"
    wait_for(discovery.exists, 60, 0.5, "Ray's Prometheus service-discovery file")
    scrape = f"  - job_name: ray\n    file_sd_configs: [{{files: ['{discovery}'], refresh_interval: 1s}}]\n"
    with running_prometheus(tmp_path, scrape) as prom:
        nodes_up = f'up{{instance=~".*:({MN_METRICS_PORT}|{MN_METRICS_PORT + 1})"}} == 1'
        wait_for(lambda: len(prom.query(nodes_up)) == 2, 60, 1.0, "both nodes' metrics agents to be up")
        for i in range(24):  # traffic through both ports while Prometheus watches
            assert _complete(multinode.urls[i % 2], _group_prompt("prom", i)).status_code == 200
        wait_for(lambda: len(prom.query("count by (instance) (ray_vllm_num_requests_running)")) == 2, 60, 1.0,
                 "each node's engine gauges")
        wait_for(lambda: len(prom.query("count by (instance) (ray_kvtide_router_decisions_total)")) == 2, 60, 1.0,
                 "each node's routing peer's decisions")
        names = prom.names()
        checks, skipped = [], []
        for spec in build.dashboard_specs():
            for panel in spec.panels():
                for query in panel.queries:
                    expr = resolve_grafana_vars(query.expr)
                    used = set(re.findall(r"\bray_\w+", expr))
                    (checks if used <= names else skipped).append((f"{spec.uid} / {panel.title}", expr))

        # A query counts once it has returned a series during the wait, not only if every query does at
        # one instant: an engine gauge re-set every few seconds was seen absent from one scrape and present
        # in the next (a fresh-clone run failed on all of them at once while each had been there before).
        answered: set[str] = set()

        def missing() -> list[str]:
            labels = [f"{title}: {expr}" for title, expr in checks]
            answered.update(label for label, (_, expr) in zip(labels, checks)
                            if label not in answered and prom.query(expr))
            return [label for label in labels if label not in answered]

        try:
            wait_for(lambda: not missing(), 90, 2.0, "every dashboard query over scraped series to return a series")
        except AssertionError:
            pytest.fail("no series:\n" + "\n".join(missing()))
        # A ratio over a rate window without such events is 0/0: a series, NaN (the single-node
        # observability test drives traffic that makes each one finite).
        nan = [title for title, expr in checks if not finite(prom.query(expr))]
        print(f"\nmultinode: {len(checks)} panel queries returned series from both nodes' scrape "
              f"({len(nan)} NaN for want of such events: {nan}); {len(skipped)} need series this traffic never "
              f"makes (autoscaling, admission rejections, preemptions, aborts)")
        assert len(checks) > len(skipped), (checks, skipped)


# --- node loss --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    node: int
    sent_s: float
    ended_s: float
    status: str  # the HTTP status, or the client error's name
    replica: str | None


def test_losing_a_node_moves_its_replica_to_the_survivor_and_fails_no_request_sent_to_the_survivor(multinode):
    """Node 1 killed under load: its replica returns on node 0, on its least-used core; every request sent to node 0 after the kill succeeds."""
    ray.kill(multinode.placeholder)  # room on the head for the lost node's replica
    worker_node = multinode.cluster.nodes.nodes[1]
    outcomes: list[Outcome] = []
    stop = threading.Event()
    lock = threading.Lock()

    def load(node: int, worker: int) -> None:
        i = 0
        while not stop.is_set():
            sent_s = time.monotonic()
            try:
                reply = _complete(multinode.urls[node], _group_prompt(f"kill{worker}", i), max_tokens=16,
                                  timeout_s=60)
                status, replica = str(reply.status_code), reply.headers.get("x-kvtide-replica")
            except httpx.HTTPError as exc:
                status, replica = type(exc).__name__, None
            with lock:
                outcomes.append(Outcome(node, sent_s, time.monotonic(), status, replica))
            i += 1
            if node == 1 and status != "200":
                return  # node 1 is gone: its port refuses at once, one refusal says so

    threads = [threading.Thread(target=load, args=(node, w), daemon=True) for node, w in ((0, 0), (0, 1), (1, 2))]
    for thread in threads:
        thread.start()
    wait_for(lambda: sum(o.status == "200" for o in outcomes) >= 12, 120, 0.2, "load on both nodes")
    worker_replica = Counter(o.replica for o in outcomes if o.node == 1 and o.replica)
    head_pids = set(_engines_by_node().get(multinode.head_id, []))
    killed_s, killed_wall_s = time.monotonic(), time.time()
    killed = kill_node(worker_node)
    wait_for(lambda: running_engines(APP) < ENGINES, 60, 0.2, "Serve to notice the lost replica")
    noticed_s = time.monotonic() - killed_s
    wait_for(lambda: len(_engines_by_node().get(multinode.head_id, [])) == ENGINES and running_engines(APP) == ENGINES,
             300, 0.5, "the lost replica to serve again on the survivor")
    recovered_s = time.monotonic() - killed_s
    recovered_at = time.monotonic()
    (new_pid,) = set(_engines_by_node()[multinode.head_id]) - head_pids
    created_s = psutil.Process(new_pid).create_time() - killed_wall_s  # Ray placed the replacement
    wait_for(lambda: sum(o.node == 0 and o.sent_s > recovered_at and o.status == "200" for o in outcomes) >= 8,
             120, 0.2, "requests after the recovery")
    stop.set()
    for thread in threads:
        thread.join(timeout=90)

    def summary(selected: list[Outcome]) -> dict[str, int]:
        return dict(Counter(o.status for o in selected))

    to_survivor_after = [o for o in outcomes if o.node == 0 and o.sent_s >= killed_s]
    in_flight = [o for o in outcomes if o.sent_s < killed_s <= o.ended_s]
    to_dead_after = [o for o in outcomes if o.node == 1 and o.sent_s >= killed_s]
    served_after = Counter(o.replica for o in to_survivor_after if o.replica)
    print(f"\nmultinode: killed node 1 ({killed} processes; replicas that had answered its port: {dict(worker_replica)}); Serve noticed after "
          f"{noticed_s:.1f} s; the replacement's process started {created_s:.1f} s after the kill and served "
          f"{recovered_s - created_s:.1f} s later (its start, under the load); all engines on node 0 serving "
          f"{recovered_s:.1f} s after the kill.\n"
          f"  in flight at the kill: {summary(in_flight)} (node 0's port: "
          f"{summary([o for o in in_flight if o.node == 0])}, node 1's: {summary([o for o in in_flight if o.node == 1])})\n"
          f"  sent to node 0 after the kill: {summary(to_survivor_after)}, by replica {dict(served_after)}\n"
          f"  sent to node 1 after the kill: {summary(to_dead_after)}")
    assert to_survivor_after and all(o.status == "200" for o in to_survivor_after), summary(to_survivor_after)
    assert all(o.status != "200" for o in to_dead_after), "nothing answers on a dead node's port"
    assert len(_replicas_reached(multinode.urls[0], "after-loss")) == ENGINES, "every replica on node 0 serves"
    # The replacement bound the least-used core (deployments/engine/core_claims.py), not its rank's.
    engines_per_core = Counter(core for pid in _engines_by_node()[multinode.head_id] for core in _bound_cores(pid))
    assert max(engines_per_core.values()) - min(engines_per_core.get(c, 0) for c in os.sched_getaffinity(0)) <= 1, \
        f"engines per core: {dict(engines_per_core)}"


def _bound_cores(replica_pid: int) -> set[int]:
    """The cores an engine replica's vLLM threads are bound to (each bound thread has a one-core affinity)."""
    cores: set[int] = set()
    for proc in psutil.Process(replica_pid).children(recursive=True):
        try:
            threads = proc.threads()
        except psutil.Error:
            continue
        for thread in threads:
            try:
                affinity = os.sched_getaffinity(thread.id)
            except OSError:
                continue
            if len(affinity) == 1:
                cores |= affinity
    return cores
