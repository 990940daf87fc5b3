"""PrefixAwareRouter (the Ray adapter) without a cluster: stats applied on arrival, sessions threaded through.

Ray Serve calls `update_replicas` whenever the replica list or a replica's routing stats
change, and `choose_replicas` per request, both on the router's event loop. These tests
drive both directly with stand-in replicas; no Ray instance is started.
"""

from __future__ import annotations

import asyncio
import time

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from kvtide.deployments.messages import GenerateRequest, RoutingKey, SamplingSpec
from kvtide.deployments.router import PrefixAwareRouter
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.snapshot import CacheDigest

BS = 4
PROMPT = tuple(block_hashes(list(range(32)), BS))  # 8 blocks
DEPLOYMENT = DeploymentID(name="Engine", app_name="app")


class FakeReplica:
    """The attributes of a RunningReplica the router reads."""

    def __init__(self, unique_id: str, routing_stats: dict | None = None):
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.routing_stats = routing_stats or {}
        self.max_ongoing_requests = 100

    async def get_queue_len(self, deadline_s: float) -> int:
        return 0


def digest_stats(engine_id: str, seq: int, hashes=PROMPT) -> dict:
    return {"digest": CacheDigest.from_hashes(engine_id, 1, seq, hashes), "reported_s": float(seq)}


def new_router() -> PrefixAwareRouter:
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BS, seed=0)
    return router


def pending(arg) -> PendingRequest:
    return PendingRequest(args=[arg], kwargs={}, metadata=None)


def ranked_ids(ranks) -> list[str]:
    return [replicas[0].replica_id.unique_id for replicas in ranks]


def test_digests_are_applied_when_stats_arrive_not_when_a_request_is_routed():
    """update_replicas applies digests; choose_replicas only reads the index (a digest not pushed stays unread)."""
    async def scenario():
        router = new_router()
        a, b = FakeReplica("a", digest_stats("engine-a", 1)), FakeReplica("b")
        router.update_replicas([a, b])
        assert router._state.index.match(PROMPT, time.monotonic()) == {"a": 8}
        # New stats on the replica object, but Ray has not pushed them: the decision must not decode them.
        b.routing_stats = digest_stats("engine-b", 1)
        decision = ranked_ids(await router.choose_replicas([a, b], pending(RoutingKey(block_hashes=PROMPT))))
        assert "b" not in router._state.index.match(PROMPT, time.monotonic())
        router.update_replicas([a, b])
        assert router._state.index.match(PROMPT, time.monotonic()) == {"a": 8, "b": 8}
        return decision

    assert asyncio.run(scenario())[0] == "a"


def test_a_replica_dropped_from_the_list_is_forgotten():
    """When Ray's replica list loses a replica, its cache and sessions leave the router state."""
    async def scenario():
        router = new_router()
        a, b = FakeReplica("a", digest_stats("engine-a", 1)), FakeReplica("b")
        router.update_replicas([a, b])
        router.update_replicas([b])
        return router._state.index.match(PROMPT, time.monotonic())

    assert asyncio.run(scenario()) == {}


def test_pick_only_session_key_is_booked_and_makes_the_next_turn_sticky():
    """A RoutingKey's session_key reaches the policy: a pick-only turn is remembered, and the next turn follows it."""
    async def scenario():
        router = new_router()
        a, b = FakeReplica("a", digest_stats("engine-a", 1)), FakeReplica("b")
        router.update_replicas([a, b])
        first = ranked_ids(await router.choose_replicas([a, b], pending(RoutingKey(session_key="chat"))))[0]
        booked = router._state.sessions.last_replica("chat", time.monotonic())
        # Say the last turn went to "b", which does not hold the prompt "a" holds: the session still wins.
        router._state.sessions.remember("chat", "b", time.monotonic())
        turn_2 = ranked_ids(await router.choose_replicas([a, b], pending(RoutingKey(PROMPT, session_key="chat"))))
        without = ranked_ids(await router.choose_replicas([a, b], pending(RoutingKey(PROMPT))))
        return first, booked, turn_2[0], without[0]

    first, booked, turn_2, without_session = asyncio.run(scenario())
    assert booked == first
    assert (turn_2, without_session) == ("b", "a")


def test_requests_without_a_session_key_attribute_still_route():
    """A GenerateRequest (no session_key field) routes on its blocks; a missing attribute means no session."""
    async def scenario():
        router = new_router()
        a, b = FakeReplica("a"), FakeReplica("b", digest_stats("engine-b", 1))
        router.update_replicas([a, b])
        request = GenerateRequest("r1", list(range(32)), SamplingSpec(max_tokens=1), block_hashes=PROMPT)
        return ranked_ids(await router.choose_replicas([a, b], pending(request)))

    assert asyncio.run(scenario())[0] == "b"
