"""The ray_prefix baseline: Ray Serve LLM's PrefixCacheAffinityRouter, whole on pick-only calls.

Its own module because importing Ray Serve LLM takes ~2 s, which only a process routing with
it should pay; why the wrapper exists is in `deployments.routing.ray_baselines`.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from kvtide.deployments.routing.ray_baselines import PickOnlyShortestQueue


class RayPrefixRouter(PickOnlyShortestQueue, PrefixCacheAffinityRouter):
    """Ray Serve LLM's PrefixCacheAffinityRouter; pick-only, the shortest queue of its choice, then booked."""

    def _on_picked(self, pending_request: PendingRequest, replica: RunningReplica) -> None:
        # Inserts the prompt's text into Ray's prefix tree for this replica, as Ray's normal path
        # does once a request is sent (the result argument is unused there).
        self.on_request_routed(pending_request, replica.replica_id, None)
