"""Config → Ray Serve application.

`build_app` is the `import_path` target (`kvtide.cluster.app:build_app`) for `serve run`,
`serve deploy` and KubeRay's `serveConfigV2`: Serve passes the application's `args`
(the kvtide config as a dict) and gets back the bound application: in direct mode the engine
servers (each its own HTTP ingress behind HAProxy) with the routing peer HAProxy consults; in
ingress mode the Ingress deployment over the engine deployment.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from kvtide.autoscaling.ray_policy import autoscaling_config
from kvtide.config import DEMO_MODEL, KvtideConfig, config_to_dict, parse_config
# How long a stopping engine replica may drain when requests have no deadline (one constant with
# HAProxy's hard-stop-after, KvtideConfig.ray_process_env: an old HAProxy outlasts the drain).
from kvtide.config.model import DRAIN_TIMEOUT_WITHOUT_DEADLINE_S
from kvtide.deployments.engine.placement import placement_bundles, replica_actor_options
from kvtide.deployments.frontend.admission import admission_limits
from kvtide.deployments.engine.replica import EngineReplica
from kvtide.deployments.ingress import Ingress
from kvtide.deployments.names import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, ROUTER_DEPLOYMENT
from kvtide.deployments.router_peer import RouterPeer
from kvtide.deployments.server import EngineServer
from kvtide.deployments.routing.ray_router import PrefixAwareRouter, RoundRobinRouter

# Serve slots above the admission gate in direct mode, for bursts (and probes, /v1/models):
# a slot costs nothing, and a request refused by the gate holds one for microseconds.
DIRECT_BURST_SLOTS = 512
UNBOUNDED_SERVE_QUEUE = -1  # Serve's value for "no max_queued_requests"


def engine_deployment_options(config: KvtideConfig) -> dict[str, Any]:
    """Replica count, placement group, health-check, queue and drain settings of the engine deployment."""
    limits = admission_limits(config)
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": replica_actor_options(config),
        "placement_group_bundles": placement_bundles(config),
        "placement_group_strategy": "STRICT_PACK",
        # Each replica batches in vLLM; Serve's queue cap only bounds what is in flight. In
        # direct mode HTTP requests take these slots too, far above the replica's admission
        # gate: a burst gets slots at once and the gate answers the excess with OpenAI-JSON
        # 429s, and a routing peer never sees the replica "full" and backs off (Serve's
        # router waits while a replica's ongoing requests are at this cap).
        "max_ongoing_requests": (limits.max_ongoing_requests + DIRECT_BURST_SLOTS if config.http.mode == "direct"
                                 else max(2 * config.engine.max_num_seqs, 8)),
        # Ingress mode: past this many requests waiting for a replica at one ingress's handle
        # (engines missing: died, not scaled up yet), the handle raises BackPressureError → 429.
        # Direct mode: unbounded. Serve counts every request of a simultaneous burst as queued
        # while it awaits its slot, free or not, and past this limit answers a plain-text 429
        # itself (any burst larger than the limit, with slots free), before the gate can answer
        # with OpenAI JSON. HAProxy's maxconn (4096 by default) bounds how many can wait.
        "max_queued_requests": (UNBOUNDED_SERVE_QUEUE if config.http.mode == "direct"
                                else limits.max_queued_requests_per_handle),
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=limits.retry_after_s),
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        # Scale-down and upgrades drain: a stopping replica takes no new requests and gets
        # up to the request deadline to finish those in flight before it is killed.
        "graceful_shutdown_wait_loop_s": 1,
        "graceful_shutdown_timeout_s": limits.request_timeout_s or DRAIN_TIMEOUT_WITHOUT_DEADLINE_S,
        "request_router_config": request_router_config(config),
    }
    if config.replicas.autoscaling:
        options["autoscaling_config"] = autoscaling_config(
            config.autoscaling, config.replicas.min_replicas, config.replicas.max_replicas,
            config.replicas.initial_replicas)
    else:
        options["num_replicas"] = config.replicas.num_replicas
    return options


def ingress_deployment_options(config: KvtideConfig) -> dict[str, Any]:
    """Replica count and Serve's per-replica cap of the ingress deployment (above the admission gate)."""
    return {
        "name": INGRESS_DEPLOYMENT,
        "num_replicas": config.frontend.num_replicas,
        "ray_actor_options": {"num_cpus": 1},
        "max_ongoing_requests": admission_limits(config).ingress_max_ongoing_requests,
    }


# Ray Serve LLM's documented settings for its prefix-aware router (the ray_prefix baseline).
RAY_PREFIX_ROUTER_KWARGS = {
    "imbalanced_threshold": 5,
    "match_rate_threshold": 0.15,
    "do_eviction": True,
    "eviction_threshold_chars": 500_000,
    "eviction_target_chars": 400_000,
    "eviction_interval_secs": 30,
}


def request_router_config(config: KvtideConfig) -> RequestRouterConfig | None:
    """The engine deployment's router for `routing.policy` (pow2 and ray_prefix: Ray's routers, deployments.routing.ray_baselines)."""
    routing = config.routing
    # The baselines are Ray's own routers, wrapped so that direct mode's pick-only calls route
    # as those routers were designed to (deployments.routing.ray_baselines says why); by import
    # path, so that only a process that routes with them imports Ray Serve LLM.
    if routing.policy == "pow2":
        return RequestRouterConfig(request_router_class="kvtide.deployments.routing.ray_baselines:Pow2Router",
                                   request_routing_stats_period_s=routing.stats_period_s)
    if routing.policy == "round_robin":
        return RequestRouterConfig(request_router_class=RoundRobinRouter,
                                   request_routing_stats_period_s=routing.stats_period_s)
    if routing.policy == "ray_prefix":
        return RequestRouterConfig(request_router_class="kvtide.deployments.routing.ray_prefix_baseline:RayPrefixRouter",
                                   request_router_kwargs=RAY_PREFIX_ROUTER_KWARGS,
                                   request_routing_stats_period_s=routing.stats_period_s)
    kwargs = {"block_size": config.engine.block_size, "routing": routing.model_dump(mode="json")}
    return RequestRouterConfig(request_router_class=PrefixAwareRouter, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=routing.stats_period_s)


def router_peer_options(config: KvtideConfig) -> dict[str, Any]:
    """Direct mode's routing peer: Ray pins http.router_replicas_per_node replicas to each HAProxy node
    (RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE, set with the cluster's environment; num_replicas is ignored)."""
    return {
        "name": ROUTER_DEPLOYMENT,
        # Light (tokenize + rank) and pinned beside HAProxy: it must not wait for a CPU bundle.
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 4096,
        # Its "requests" are HAProxy's consults, one per client POST (whose own line the engine
        # replica logs): an access line each is noise, and Serve buffers them 1,000 at a time,
        # formatting the lot on the peer's event loop, in front of the consults then waiting.
        "logging_config": {"enable_access_log": False},
    }


def build_from_config(config: KvtideConfig) -> Application:
    if config.model == DEMO_MODEL:
        # Build the local demo checkpoint once, here, and hand its path to every replica.
        from kvtide.deployments.engine.demo_model import build_demo_model

        config = config.model_copy(update={"model": str(build_demo_model()),
                                           "served_model_name": config.model_name})
    config_dict = config_to_dict(config)
    if config.http.mode == "direct":
        # Engine replicas are the HTTP ingress; HAProxy asks the peer which one takes a POST.
        engine = serve.deployment(EngineServer).options(**engine_deployment_options(config)).bind(config_dict)
        peer = serve.deployment(RouterPeer).options(**router_peer_options(config)).bind(engine, config_dict)
        return engine._with_ingress_request_router(peer)
    engine = serve.deployment(EngineReplica).options(**engine_deployment_options(config)).bind(config_dict)
    ingress = serve.deployment(Ingress).options(**ingress_deployment_options(config))
    return ingress.bind(engine, config_dict)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ray Serve application builder: `args` is the kvtide config as plain data."""
    return build_from_config(parse_config(args))
