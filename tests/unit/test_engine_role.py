"""An engine replica's moves between active, standby and retiring (a fake engine records the calls)."""

from __future__ import annotations

import asyncio

import pytest

from kvtide.deployments.engine.standby import ACTIVE, RETIRING, STANDBY, EngineRole


class FakeEngine:
    def __init__(self):
        self.calls: list[str] = []

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    async def sleep(self, level):
        self.calls.append(f"sleep({level})")

    async def wake_up(self):
        self.calls.append("wake_up")


def run_moves(moves: list[str], *, can_sleep: bool, in_flight=lambda: 0) -> tuple[EngineRole, list[str]]:
    engine = FakeEngine()

    async def warm_start():
        engine.calls.append("warm_start")

    role = EngineRole(engine, can_sleep=can_sleep, sleep_level=1, drain_timeout_s=5.0, in_flight=in_flight,
                      warm_start=warm_start)

    async def go():
        for wanted in moves:
            await role.apply(wanted)

    asyncio.run(go())
    return role, engine.calls


@pytest.mark.parametrize("moves, can_sleep, calls, routed, asleep", [
    ([STANDBY], True, ["reset_prefix_cache", "sleep(1)"], False, True),  # GPU: drop the cache, then sleep
    ([STANDBY], False, ["reset_prefix_cache"], False, False),  # CPU: awake, unrouted, empty
    ([STANDBY, ACTIVE], True, ["reset_prefix_cache", "sleep(1)", "wake_up", "warm_start"], True, False),
    ([STANDBY, ACTIVE], False, ["reset_prefix_cache", "warm_start"], True, False),
    ([STANDBY, STANDBY], True, ["reset_prefix_cache", "sleep(1)"], False, True),  # a repeat does nothing
    ([STANDBY, RETIRING], True, ["reset_prefix_cache", "sleep(1)"], False, True),  # already asleep: just retire
    ([RETIRING], True, ["reset_prefix_cache", "sleep(1)"], False, True),  # straight from active: drained first
    ([ACTIVE], True, [], True, False),  # the default: nothing to do
])
def test_moves_call_the_engine_as_the_role_table_says(moves, can_sleep, calls, routed, asleep):
    """Each move's engine calls, and whether the replica ends routed and asleep."""
    role, made = run_moves(moves, can_sleep=can_sleep)
    assert made == calls and role.routed is routed and role.asleep is asleep
    assert role.retired is (moves[-1] == RETIRING)


def test_a_move_to_standby_waits_for_requests_in_flight_before_dropping_the_cache():
    """The cache is dropped only once the requests running there have finished."""
    left = [3]

    def in_flight() -> int:
        left[0] = max(left[0] - 1, 0)  # one finishes per poll
        return left[0]

    role, calls = run_moves([STANDBY], can_sleep=False, in_flight=in_flight)
    assert left == [0] and calls == ["reset_prefix_cache"] and not role.routed


@pytest.mark.parametrize("can_sleep, moves, refuses", [
    (True, [STANDBY], True),  # asleep
    (True, [STANDBY, ACTIVE], False),  # woken and warm
    (False, [STANDBY], False),  # CPU: awake, unrouted, still serves a request that reaches it
    (True, [], False),  # active
])
def test_a_replica_refuses_requests_only_where_its_engine_sleeps_or_is_moving_to_or_from_sleep(can_sleep, moves,
                                                                                             refuses):
    """Which replicas answer a request with a retryable error instead of calling the engine."""
    role, _ = run_moves(moves, can_sleep=can_sleep)
    assert role.refuses_requests is refuses
