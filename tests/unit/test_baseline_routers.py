"""The pow2 and ray_prefix baselines (Ray's own routers) in direct mode's pick-only calls.

Ray's pick-only path keeps the first replica of the first rank and never calls
`on_request_routed`; these tests drive the routers as that path does, with stand-in replicas
and, for Ray's prefix tree, its PrefixTree class in-process (no Ray instance).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from ray.llm._internal.serve.routing_policies.prefix_aware import prefix_aware_router
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from kvtide.cluster.app import RAY_PREFIX_ROUTER_KWARGS
from kvtide.deployments.routing.ray_baselines import Pow2Router
from kvtide.deployments.routing.ray_prefix_baseline import RayPrefixRouter
from kvtide.deployments.messages import RoutingKey
from kvtide.deployments.routing.pick_load import PickOnlyLoad

DEPLOYMENT = DeploymentID(name="Engine", app_name="app")


class FakeReplica:
    """The attributes of a RunningReplica Ray's routers read."""

    def __init__(self, unique_id: str, running: int = 0, reported_s: float = 1.0):
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.routing_stats = {"reported_s": reported_s, "num_running": running, "num_waiting": 0}
        self.max_ongoing_requests = 100
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids = set()

    async def get_queue_len(self, deadline_s: float) -> int:
        return 0


class LocalTree:
    """Ray's PrefixTree behind the `.remote` calls the router makes (`ray.get` is patched to pass values through)."""

    def __init__(self):
        self._tree = PrefixTree()

    def __getattr__(self, name):
        method = getattr(self._tree, name)
        return type("Remote", (), {"remote": staticmethod(method)})


def pending(key: RoutingKey | object) -> PendingRequest:
    return PendingRequest(args=[key], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="r"))


def picks(router, replicas, keys) -> list[str]:
    async def run():
        router.update_replicas(replicas)
        out = []
        for key in keys:
            ranks = await router.choose_replicas(replicas, pending(key))
            out.append([r.replica_id.unique_id for r in ranks[0]])
        return out
    return asyncio.run(run())


def new_pow2() -> Pow2Router:
    router = Pow2Router(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    return router


def new_ray_prefix(monkeypatch) -> RayPrefixRouter:
    monkeypatch.setattr(prefix_aware_router.ray, "get", lambda value: value)
    router = RayPrefixRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**{**RAY_PREFIX_ROUTER_KWARGS, "do_eviction": False}, tree_actor=LocalTree())
    return router


def test_pick_only_load_counts_picks_until_the_replicas_next_report():
    """A pick counts as one queued request until the replica reports again; the report then stands alone."""
    load = PickOnlyLoad()
    load.sync({"a": {"reported_s": 1.0, "num_running": 1, "num_waiting": 1}})
    for _ in range(3):
        load.book("a")
    assert load.queued("a") == 3  # 3 picks outweigh the 2 reported
    load.sync({"a": {"reported_s": 1.0, "num_running": 1, "num_waiting": 1}})  # the same report again
    assert load.queued("a") == 3
    load.sync({"a": {"reported_s": 2.0, "num_running": 4, "num_waiting": 0}})
    assert load.queued("a") == 4
    load.sync({})
    assert load.queued("a") == 0


def test_pow2_pick_only_takes_the_shorter_queue_of_its_two_candidates():
    """Pick-only, pow2 names one replica, the less loaded (Ray's own pick-only path took the first of two at random)."""
    busy, idle = FakeReplica("busy", running=5), FakeReplica("idle")
    chosen = picks(new_pow2(), [busy, idle], [RoutingKey()] * 4)
    assert chosen[:4] == [["idle"]] * 4  # idle's own picks (1..4) stay under busy's 5


def test_pow2_pick_only_spreads_equal_replicas_by_counting_its_own_picks():
    """Between reports, each pick counts as load: equal replicas share a burst evenly."""
    replicas = [FakeReplica("a"), FakeReplica("b")]
    chosen = picks(new_pow2(), replicas, [RoutingKey()] * 6)
    assert Counter(c[0] for c in chosen) == {"a": 3, "b": 3}


def test_pow2_through_rays_normal_path_is_unchanged():
    """A request sent through Ray's normal path (not a RoutingKey) gets Ray's two candidates, for Ray to probe."""
    replicas = [FakeReplica("a"), FakeReplica("b")]
    chosen = picks(new_pow2(), replicas, [object()])
    assert sorted(chosen[0]) == ["a", "b"]


def test_ray_prefix_pick_only_learns_what_it_routed(monkeypatch):
    """Pick-only, Ray's prefix router books each pick in its tree: new prefixes spread, a repeat follows its prefix."""
    router = new_ray_prefix(monkeypatch)
    replicas = [FakeReplica("a"), FakeReplica("b")]
    first, second = "system prompt one " * 40, "another system prompt " * 40
    chosen = picks(router, replicas, [RoutingKey(prompt=first + "q1"), RoutingKey(prompt=second + "q2"),
                                      RoutingKey(prompt=first + "q3"), RoutingKey(prompt=second + "q4")])
    assert chosen[0] != chosen[1]  # the second prefix went to the empty tenant, not after the first
    assert chosen[2] == chosen[0] and chosen[3] == chosen[1]


@pytest.mark.parametrize("policy, cls", [("pow2", Pow2Router), ("ray_prefix", RayPrefixRouter)])
def test_the_baseline_policies_use_the_pick_only_aware_routers(policy, cls):
    """`routing.policy` pow2 / ray_prefix deploy these subclasses (by import path), not Ray's bare routers."""
    from kvtide.cluster.app import request_router_config
    from kvtide.config import KvtideConfig

    config = KvtideConfig.model_validate({"routing": {"policy": policy}})
    path = request_router_config(config).request_router_class
    assert path == f"{cls.__module__}:{cls.__name__}"


def test_pow2_never_picks_a_standby_though_rays_sampler_sees_every_replica():
    """Ray's pow2 samples all the replicas it knows, not the candidates it is handed: a standby is left out anyway."""
    standby = FakeReplica("b")
    standby.routing_stats["standby"] = True
    replicas = [FakeReplica("a"), standby, FakeReplica("c")]
    picked = picks(new_pow2(), replicas, [RoutingKey() for _ in range(40)])
    assert {r for rank in picked for r in rank} <= {"a", "c"}
