"""This engine replica's role (active, standby, retiring) and the moves between them.

The autoscaler assigns roles (`autoscaling.standby`) and publishes them in Ray's internal KV
(`autoscaling.roles_channel`); each replica polls its own and moves itself:

    active → standby    out of routing at once (its routing stats say standby), in-flight
                        requests drain, the prefix cache is dropped (its worth is gone: a
                        standby is empty), then vLLM sleep mode where the platform has it (GPU:
                        weights offloaded, KV freed); on CPU the engine stays awake, unrouted
    standby → active    wake (GPU), prefill the fleet's hot prefixes (warm start, as a new
                        replica does), then back in routing
    → retiring          as standby, then the health check fails on purpose: Serve stops this
                        replica and the autoscaler lowers the count (see autoscaling.standby)

Invariants:
- Moves run one at a time, in the order the roles arrive; a role seen mid-move is applied next.
- A sleeping engine is never handed a request, nor one moving to or from sleep: the replica
  answers it with a retryable 503 (HAProxy, or the ingress, retries it on another replica).
- Routers leave a replica out from the stats pull after its move starts until it is warm again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from kvtide.deployments.logs import replica_logger

logger = replica_logger("engine")

ACTIVE, STANDBY, RETIRING = "active", "standby", "retiring"
# How often a replica reads its role: a wake starts within this of the decision.
ROLE_POLL_S = 0.25
# In-flight requests a move to standby waits for before it drops the cache (they finish there).
DRAIN_POLL_S = 0.1


class EngineRole:
    """One replica's role and its moves; `engine` is vLLM's AsyncLLM."""

    def __init__(self, engine, *, can_sleep: bool, sleep_level: int, drain_timeout_s: float,
                 in_flight: Callable[[], int], warm_start: Callable[[], Awaitable[None]]):
        self.engine = engine
        self.can_sleep = can_sleep
        self.sleep_level = sleep_level
        self.drain_timeout_s = drain_timeout_s
        self.in_flight = in_flight
        self.warm_start = warm_start
        self.role = ACTIVE  # a replica serves until told otherwise (roles off: always)
        self.routed = True  # whether routers may send it requests
        self.asleep = False
        self.moves = 0
        self.last_wake_s: float | None = None  # seconds the last standby → active took (wake + warm start)

    @property
    def refuses_requests(self) -> bool:
        """A sleeping engine, or one on its way to or from sleep, takes no request (it gets a retryable error).

        An engine that cannot sleep (CPU) serves whatever still reaches it while unrouted.
        """
        return self.asleep or (self.can_sleep and not self.routed)

    @property
    def retired(self) -> bool:
        """Ready to be stopped: drained, empty, asleep where it can sleep."""
        return self.role == RETIRING and not self.routed

    async def apply(self, wanted: str) -> None:
        """Move to `wanted` (one of ACTIVE, STANDBY, RETIRING) if not there already."""
        if wanted == self.role:
            return
        self.moves += 1
        if wanted == ACTIVE:
            started_s = time.monotonic()
            if self.asleep:
                await self.engine.wake_up()
                self.asleep = False
            await self.warm_start()
            self.role, self.routed = ACTIVE, True
            self.last_wake_s = time.monotonic() - started_s
            logger.info("role: active (woken and warm in %.2f s)", self.last_wake_s)
            return
        was_routed = self.routed
        self.role, self.routed = wanted, False
        if was_routed:
            await self._drain()
            await self.engine.reset_prefix_cache()
            if self.can_sleep:
                await self.engine.sleep(self.sleep_level)
                self.asleep = True
        logger.info("role: %s (%s)", wanted, "asleep" if self.asleep else "awake, unrouted")

    async def _drain(self) -> None:
        deadline_s = time.monotonic() + self.drain_timeout_s
        while self.in_flight() > 0 and time.monotonic() < deadline_s:
            await asyncio.sleep(DRAIN_POLL_S)
