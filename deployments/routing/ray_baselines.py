"""Ray's own routers as the `pow2` and `ray_prefix` baselines, made whole for pick-only calls.

In direct mode (the default) a routing peer asks Ray Serve to name a replica
(`choose_replica(RoutingKey, _reserve=False)`) and HAProxy sends the request. Ray's pick-only
path takes the first replica of the first rank a router returns and stops there: no
queue-length probe between candidates, no `on_request_routed`. Ray's routers rely on both:

- `PowerOfTwoChoicesRequestRouter` returns its two random candidates as one rank, for the
  caller to keep the shorter queue; pick-only, the first of the two won: a random pick.
- Ray Serve LLM's `PrefixCacheAffinityRouter` learns what each replica holds only from
  `on_request_routed` (it inserts the prompt into its prefix tree there). Pick-only, the tree
  stays empty, every request ties among "smallest tenants" and the first one wins: every
  request goes to the same replica (benchmarks/results/compare-cpu-tiebreak).

Ray Serve LLM's direct streaming (`ray/llm/_internal/serve/core/ingress/router.py`) picks
the same way, so this is also how Ray's own app behaves with those routers today; a baseline
that stands for "Ray's router" must route as the router was designed to. The subclasses
below do, and only on pick-only calls (a call through Ray's normal path is unchanged):
among the first rank's replicas the shortest queue wins (ties at random, as Ray's probe of
equal queues would), the queue being the engine's last report plus the picks since
(`routing.pick_load`); then the prefix router books the pick as `on_request_routed` would.
`RayPrefixRouter` lives in `deployments.routing.ray_prefix_baseline`: importing Ray Serve LLM takes ~2 s,
which only a ray_prefix process should pay.
"""

from __future__ import annotations

import random
from typing import Any, List, Optional

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from kvtide.deployments.routing.ray_router import is_pick_only, pinned_rank, routable
from kvtide.deployments.routing.pick_load import PickOnlyLoad


class PickOnlyShortestQueue:
    """Mixin (before Ray's router in the bases): a pinned request its replica (ray_router.pinned_rank);
    pick-only calls get one replica, the shortest queue."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._pick_load = PickOnlyLoad()
        self._tie_rng = random.Random()

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._pick_load.sync({r.replica_id.unique_id: r.routing_stats or {} for r in replicas})

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if (pinned := pinned_rank(candidate_replicas, pending_request)) is not None:
            return pinned
        serving = routable(candidate_replicas)
        # Ray's pow2 samples every replica it knows, not the candidates it is handed: a standby is taken
        # out of its ranks here (an empty rank makes Ray ask again).
        serving_ids = {r.replica_id for r in serving}
        ranks = [[r for r in rank if r.replica_id in serving_ids]
                 for rank in await super().choose_replicas(serving, pending_request)]
        if not is_pick_only(pending_request):
            return ranks
        rank = next((r for r in ranks if r), None)
        if rank is None:
            return ranks
        load = self._pick_load
        best = min(rank, key=lambda r: (load.queued(r.replica_id.unique_id), self._tie_rng.random()))
        load.book(best.replica_id.unique_id)
        self._on_picked(pending_request, best)
        return [[best]]

    def _on_picked(self, pending_request: PendingRequest, replica: RunningReplica) -> None:
        """What Ray's normal path would tell the router once the request is sent (nothing, by default)."""


class Pow2Router(PickOnlyShortestQueue, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's power of two choices; pick-only, the shorter queue of the two sampled replicas."""
