"""The `routing:` section: which request router picks an engine replica, and its knobs.

Declared once, here. The prefix_aware policy (`kvtide.deployments.routing.policy`) takes
this model as its tunables and its module docstring gives each default's reason; the Ray
router adapter receives it as plain data (`model_dump`) and validates it back.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvtide.config.base import Strict

RoutingPolicy = Literal["prefix_aware", "pow2", "round_robin", "ray_prefix"]


class RoutingConfig(Strict):
    """Which request router picks the engine replica for a request, and its knobs.

    prefix_aware: kvtide's router (deployments.routing.policy documents the algorithm);
    pow2: Ray Serve's power-of-two choices; round_robin; ray_prefix: Ray Serve LLM's
    PrefixCacheAffinityRouter. The last three are baselines for `kvtide bench compare`.
    """

    policy: RoutingPolicy = Field(
        "prefix_aware", description="Request router: prefix_aware (kvtide), pow2, round_robin or ray_prefix.")
    stats_period_s: float = Field(1.0, gt=0, description="How often engines report load and cache digests to routers.")
    # The bounds below keep the policy's invariant "at least one replica is under the load
    # guard" true (factor >= 1, slack >= 0).
    tokens_per_queued_request: float = Field(
        256.0, ge=0, description="prefix_aware: prefill-token cost of one request already queued on a replica.")
    uncached_weight: float = Field(
        2.0, ge=1.0, description="prefix_aware: weight of a request's own uncached prompt tokens against work "
                                 "already queued (1: its wait alone; 2: also the fleet's prefill it spends).")
    load_guard_factor: float = Field(
        1.25, ge=1.0, description="prefix_aware: a replica above factor x mean load (+ slack) loses its affinity.")
    load_guard_slack: float = Field(2.0, ge=0, description="prefix_aware: requests of slack added to the load guard.")
    tie_band_tokens: float = Field(
        512.0, ge=0, description="prefix_aware: replicas under the guard whose cost is within this many tokens of "
                                 "the best tie for first, and the tie goes by what every router sees alike (the "
                                 "holders of the prefix, the emptiest engine, rendezvous weights): independent "
                                 "routers then agree on a group; past it, load decides (0: exact ties only).")
    kv_usage_guard_perc: float = Field(
        0.95, gt=0, le=1.0, description="prefix_aware: a replica whose KV cache is this full counts as overloaded.")
    history_ttl_s: float = Field(
        10.0, gt=0, description="prefix_aware: how long the router's own routing counts as cached without a digest.")
    # Hot-prefix replication and session affinity (the policy's docstring gives the reasons).
    replication_key_tokens: int = Field(
        128, ge=1, description="prefix_aware: requests sharing their first this many tokens (whole blocks, at least "
                               "one) form one prefix group, for hot-prefix replication and deterministic tiebreaks.")
    replication_fill: float = Field(
        0.5, gt=0, le=1.0, description="prefix_aware: share of the load-guard limit one replica may carry of a single "
                                       "prefix group before the group is spread over one more replica.")
    replication_max_replicas: int = Field(
        8, ge=1, description="prefix_aware: most replicas a hot prefix group is deliberately spread over (1 disables).")
    replication_half_life_s: float = Field(
        10.0, gt=0,
        description="prefix_aware: half-life, in seconds, of the request counts estimating each group's traffic share.")
    session_ttl_s: float = Field(
        60.0, gt=0,
        description="prefix_aware: how long a session sticks to the replica of its last turn (under the load guard).")
    cpu_tier_aware: bool = Field(
        True, description="prefix_aware: count the prompt blocks a replica holds in its CPU KV tier (engine.kv_offload) "
                          "at their load cost; false: route on GPU blocks alone (the tier still serves its hits).")
