"""PrefixAwareRouter (the Ray adapter) without a cluster: stats applied on arrival, sessions threaded through,
predictions written into the request's slot, digest ages reported.

Ray Serve calls `update_replicas` whenever the replica list or a replica's routing stats
change, and `choose_replicas` per request, both on the router's event loop. These tests
drive both directly with stand-in replicas; no Ray instance is started.
"""

from __future__ import annotations

import asyncio
import time

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from fakes import settle_digest_slices

from kvtide.deployments.messages import GenerateRequest, RoutingKey, SamplingSpec
from kvtide.deployments.routing.ray_router import DIGEST_AGE_RECORD_INTERVAL_S, PrefixAwareRouter
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.snapshot import CacheDigest
from kvtide.deployments.routing.trust import Prediction, read_prediction

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


async def update(router: PrefixAwareRouter, replicas: list) -> None:
    """Ray's push, then the loop turns that apply its digests slice by slice (a decision may run between two)."""
    router.update_replicas(replicas)
    await settle_digest_slices(router)


def pending(arg) -> PendingRequest:
    return PendingRequest(args=[arg], kwargs={}, metadata=None)


def ranked_ids(ranks) -> list[str]:
    return [replicas[0].replica_id.unique_id for replicas in ranks]


def test_digests_are_applied_when_stats_arrive_not_when_a_request_is_routed():
    """update_replicas applies digests; choose_replicas only reads the index (a digest not pushed stays unread)."""
    async def scenario():
        router = new_router()
        a, b = FakeReplica("a", digest_stats("engine-a", 1)), FakeReplica("b")
        await update(router, [a, b])
        assert router._state.index.match(PROMPT, time.monotonic()) == {"a": 8}
        # New stats on the replica object, but Ray has not pushed them: the decision must not decode them.
        b.routing_stats = digest_stats("engine-b", 1)
        decision = ranked_ids(await router.choose_replicas([a, b], pending(RoutingKey(block_hashes=PROMPT))))
        assert "b" not in router._state.index.match(PROMPT, time.monotonic())
        await update(router, [a, b])
        assert router._state.index.match(PROMPT, time.monotonic()) == {"a": 8, "b": 8}
        return decision

    assert asyncio.run(scenario())[0] == "a"


def test_a_replica_dropped_from_the_list_is_forgotten():
    """When Ray's replica list loses a replica, its cache and sessions leave the router state."""
    async def scenario():
        router = new_router()
        a, b = FakeReplica("a", digest_stats("engine-a", 1)), FakeReplica("b")
        await update(router, [a, b])
        await update(router, [b])
        return router._state.index.match(PROMPT, time.monotonic())

    assert asyncio.run(scenario()) == {}


def test_pick_only_session_key_is_booked_and_makes_the_next_turn_sticky():
    """A RoutingKey's session_key reaches the policy: a pick-only turn is remembered, and the next turn follows it."""
    async def scenario():
        router = new_router()
        a, b = FakeReplica("a", digest_stats("engine-a", 1)), FakeReplica("b")
        await update(router, [a, b])
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
        await update(router, [a, b])
        request = GenerateRequest("r1", list(range(32)), SamplingSpec(max_tokens=1), block_hashes=PROMPT)
        return ranked_ids(await router.choose_replicas([a, b], pending(request)))

    assert asyncio.run(scenario())[0] == "b"


def test_each_decision_writes_its_prediction_into_the_requests_slot():
    """The replica ranked first, its cached tokens and those no other replica holds land in the very RoutingKey /
    GenerateRequest Ray passed."""
    async def scenario():
        router = new_router()
        a, b = FakeReplica("a"), FakeReplica("b", digest_stats("engine-b", 1))
        await update(router, [a, b])
        key = RoutingKey(block_hashes=PROMPT)
        request = GenerateRequest("r1", list(range(33)), SamplingSpec(max_tokens=1), block_hashes=PROMPT[:2])
        cold = RoutingKey(block_hashes=tuple(block_hashes(list(range(100, 132)), BS)))
        # The GenerateRequest first: a pick-only RoutingKey books its pick as load on "b".
        for arg in (request, key, cold):
            await router.choose_replicas([a, b], pending(arg))
        await router.choose_replicas([a, b], pending(object()))  # no slot: nothing to write, no error
        untouched = RoutingKey(block_hashes=PROMPT)
        await router.choose_replicas([], pending(untouched))  # no candidate, no pick, no prediction
        return key, request, cold, untouched

    key, request, cold, untouched = asyncio.run(scenario())
    assert read_prediction(key.decision) == Prediction("b", 8 * BS, 8 * BS)  # "a" holds none of it
    assert read_prediction(request.decision) == Prediction("b", 2 * BS, 2 * BS)
    cold_prediction = read_prediction(cold.decision)
    assert cold_prediction is not None and cold_prediction.cached_tokens == 0
    assert read_prediction(untouched.decision) is None


class FakeGauge:
    def __init__(self) -> None:
        self.sets: list[tuple[str, float]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.sets.append((tags["replica"], value))


def test_digest_ages_are_set_per_replica_at_most_every_interval_and_not_for_gone_replicas():
    """Each stamped replica's age is set when stats arrive, throttled to one pass per interval; a gone one stops."""
    stamp_s = time.time() - 2.0

    def stamped(engine_id: str) -> dict:
        return {"digest": CacheDigest.from_hashes(engine_id, 1, 1, PROMPT, timestamp_s=stamp_s), "reported_s": 1.0}

    async def scenario():
        router = new_router()
        gauge = router._metrics.digest_age_s = FakeGauge()
        a, b = FakeReplica("a", stamped("engine-a")), FakeReplica("b", stamped("engine-b"))
        await update(router, [a, b])
        first = list(gauge.sets)
        last_s = router._digest_ages_set_s
        gauge.sets.clear()
        router._record_digest_ages(last_s + DIGEST_AGE_RECORD_INTERVAL_S / 2)
        throttled = list(gauge.sets)
        await update(router, [b])  # "a" left
        gauge.sets.clear()
        router._record_digest_ages(router._digest_ages_set_s + DIGEST_AGE_RECORD_INTERVAL_S)
        return first, throttled, gauge.sets

    first, throttled, after_a_left = asyncio.run(scenario())
    assert sorted(rid for rid, _ in first) == ["a", "b"]
    assert all(2.0 <= age_s < 60.0 for _, age_s in first)
    assert throttled == []
    assert [rid for rid, _ in after_a_left] == ["b"]


def test_a_standby_replica_is_never_ranked_while_an_active_one_can_serve():
    """Routers leave out a replica whose routing stats say standby, even one holding the prompt's blocks."""
    async def run() -> None:
        router = new_router()
        holder = FakeReplica("engine-a", {**digest_stats("engine-a", 1), "standby": True})
        other = FakeReplica("engine-b", {"reported_s": 1.0, "standby": False})
        await update(router, [holder, other])
        assert ranked_ids(await router.choose_replicas([holder, other], pending(RoutingKey(PROMPT)))) == ["engine-b"]
        # Every candidate a standby: they stay candidates (a sleeping one answers a retryable error).
        ranks = await router.choose_replicas([holder], pending(RoutingKey(PROMPT)))
        assert ranked_ids(ranks) == ["engine-a"]

    asyncio.run(run())
