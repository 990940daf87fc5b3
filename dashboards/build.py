"""kvtide's Grafana dashboards as code, and the generator of every committed artifact.

    python -m kvtide.dashboards.build      # rewrites dashboards/generated/, the chart's copies, docs/metrics.md

Four dashboards, each answering one SRE question:

    kvtide-overview   are we meeting the SLOs?  TTFT/ITL/e2e p50/p90/p99, req/s, tokens/s, errors, replicas
    kvtide-routing    is the cache working?     prefix-cache hit rate per replica, load imbalance, router,
                                                whether routers on different nodes agree, whether the
                                                router's cache index can be trusted, hits by KV tier
    kvtide-capacity   do we need more engines?  KV usage, waiting, preemptions, replicas, the KV autoscaler,
                                                the CPU KV tier (blocks held, bytes moved, onload rate)
    kvtide-engine     what is this replica doing?  every engine signal, one row per `$replica`

Template variables (the same on every dashboard):

    datasource  a Prometheus data source
    namespace   Kubernetes namespace; the PodMonitor adds `namespace`, a local cluster has none.
                "All" is the regex .*, which also matches series WITHOUT the label, so one
                dashboard serves both.
    cluster     Ray's `SessionName`: the one label that identifies a Ray cluster both locally
                and on Kubernetes (Ray's agent stamps it on every series; `pod`/`namespace`
                exist only under the PodMonitor). A RayService upgrade starts a new Ray
                cluster and so a new SessionName; "All" (the default) keeps history across
                upgrades, picking one isolates a single cluster's lifetime.
    model       the served model name (`model` on frontend series, `model_name` on vLLM's;
                the catalog says which label each family uses).
    replica     (engine dashboard) vLLM's `ReplicaId`, the Ray Serve replica id.

Every panel names only catalogued metrics (`catalog.metric()` raises on any other), and
a unit test checks that every catalogued metric appears in some panel or alert rule.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from kvtide.dashboards.catalog import ENGINE_DEPLOYMENT, REPO_ROOT
from kvtide.dashboards.panels import (
    DashboardSpec,
    PanelSpec,
    Query,
    RowSpec,
    VariableSpec,
    render,
)
from kvtide.dashboards.promql import Selectors, quantile, rate_sum

GENERATED_DIR = REPO_ROOT / "dashboards" / "generated"
CHART_DASHBOARDS_DIR = REPO_ROOT / "helm" / "kvtide" / "dashboards"
W = "$__rate_interval"
QUANTILES = ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"))

BASE = 'namespace=~"$namespace",SessionName=~"$cluster"'
S = Selectors(base=BASE, model="$model")  # every dashboard query selects through this
ANCHOR = "ray_vllm_num_requests_running"  # always present once an engine runs: variables list from it
ENGINE = {"deployment": ENGINE_DEPLOYMENT}
AUTOSCALER_NEEDS = "engine autoscaling on"

VARIABLES = (
    VariableSpec("namespace", "Namespace", f"label_values({ANCHOR}, namespace)"),
    VariableSpec("cluster", "Ray cluster (SessionName)", f'label_values({ANCHOR}{{namespace=~"$namespace"}}, SessionName)'),
    VariableSpec("model", "Model", f"label_values({ANCHOR}{{{BASE}}}, model_name)"),
)


def _quantiles(sel: Selectors, name: str, by: str = "") -> tuple[Query, ...]:
    prefix = "{{" + by + "}} " if by else ""
    return tuple(Query(quantile(q, sel, name, by, W), f"{prefix}{label}") for q, label in QUANTILES)


def _rate_share(sel: Selectors, name: str, part: dict[str, str], whole: dict[str, str] | None = None,
                by: str = "") -> str:
    """rate(`name` matching `part`) / rate(`name` matching `whole`), summed `by`; 0, not "No data", while
    no series matches `part` (a counter appears at its first increment)."""
    denominator = rate_sum(sel, name, W, by=by, **(whole or {}))
    return f"({rate_sum(sel, name, W, by=by, **part)} or {denominator} * 0) / {denominator}"


def _share(sel: Selectors, status_regex: str) -> str:
    """Share of frontend requests whose status matches; 0 (not "No data") while none did."""
    return _rate_share(sel, "ray_kvtide_requests_total", {"status": status_regex})


def _per_replica_rate(sel: Selectors, name: str) -> str:
    return rate_sum(sel, name, W, by="ReplicaId")


def _preemptions(sel: Selectors) -> str:
    # vLLM creates the counter at the first preemption: until then show 0 per replica.
    return (f"{_per_replica_rate(sel, 'ray_vllm_num_preemptions_total')} "
            f"or sum by (ReplicaId) ({sel('ray_vllm_num_requests_running')}) * 0")


def _hit_rate(sel: Selectors, by: str) -> str:
    grouping = f" by ({by})" if by else ""
    hits = f"sum{grouping} (rate({sel('ray_vllm_prefix_cache_hits_total')}[{W}]))"
    queries = f"sum{grouping} (rate({sel('ray_vllm_prefix_cache_queries_total')}[{W}]))"
    return f"({hits} or {queries} * 0) / {queries}"


def _prediction_share(sel: Selectors, part: str, whole: str) -> str:
    """rate(predictions with outcome `part`) / rate(those with outcome in `whole`)."""
    return _rate_share(sel, "ray_kvtide_router_predictions_total", {"outcome": part}, {"outcome": whole})


HIT_TOKENS = "ray_kvtide_engine_prefix_hit_tokens_total"
CACHED_BLOCKS = "ray_kvtide_engine_cached_blocks"
TRANSFER_BYTES = "ray_kvtide_engine_kv_transfer_bytes_total"


def _cached_blocks_panel(title: str, width: int = 8) -> PanelSpec:
    return PanelSpec(title, (Query(f"sum by (ReplicaId, tier) ({S(CACHED_BLOCKS)})", "{{ReplicaId}} {{tier}}"),),
                     unit="short", width=width,
                     description="Full KV blocks each replica holds, by tier: gpu (its prefix cache) and cpu (host "
                                 "memory, engine.kv_offload), as its cache digest tells the routers. A cpu tier "
                                 "keeps prefixes the GPU evicted; it reads 0 where no CPU tier runs.")


def _replicas_panel() -> PanelSpec:
    return PanelSpec(
        "Engine replicas", (
            Query(f"sum({S('ray_serve_deployment_replica_healthy', **ENGINE)})", "healthy"),
            Query(f"max({S('ray_serve_autoscaling_target_replicas', **ENGINE)})", "target"),
        ),
        unit="short", description="Healthy engine replicas (Serve health checks) against Serve's target count.",
        preview=True)


# --- the dashboards ----------------------------------------------------------------------


def overview() -> DashboardSpec:
    requests = "ray_kvtide_requests_total"
    slo = RowSpec("Service level (measured at the frontend)", (
        PanelSpec("Requests / s", (Query(rate_sum(S, requests, W)),), unit="reqps", kind="stat", width=6, height=4),
        PanelSpec("Output tokens / s", (Query(rate_sum(S, "ray_kvtide_output_tokens_total", W)),),
                  unit="short", kind="stat", width=6, height=4),
        PanelSpec("5xx share", (Query(_share(S, "5..")),), unit="percentunit", kind="stat", width=6, height=4),
        PanelSpec("TTFT p99", (Query(quantile(0.99, S, "ray_kvtide_time_to_first_token_seconds", "", W)),),
                  unit="s", kind="stat", width=6, height=4),
        PanelSpec("Time to first token", _quantiles(S, "ray_kvtide_time_to_first_token_seconds"), unit="s", width=8,
                  description="Arrival at the frontend to the first output token.", preview=True),
        PanelSpec("Inter-token latency", _quantiles(S, "ray_kvtide_inter_token_latency_seconds"), unit="s", width=8,
                  description="Gap between output tokens of streamed requests, per token.", preview=True),
        PanelSpec("End-to-end latency", _quantiles(S, "ray_kvtide_e2e_latency_seconds"), unit="s", width=8,
                  description="Arrival at the frontend to the last byte.", preview=True),
        PanelSpec("TTFT by phase (p50)",
                  (Query(quantile(0.5, S, "ray_kvtide_ttft_phase_seconds", "phase", W), "{{phase}}"),),
                  unit="s", width=24, preview=True,
                  description="Where time to first token goes: frontend (gate, parse, tokenize), transport "
                              "(routing, Ray hops, waiting for a replica) and the engine's own queue + prefill. "
                              "The serving path's cost is frontend + transport."),
    ))
    traffic = RowSpec("Traffic", (
        PanelSpec("Requests / s by endpoint and status",
                  (Query(rate_sum(S, requests, W, by="endpoint, status"), "{{endpoint}} {{status}}"),),
                  unit="reqps", width=8, preview=True),
        PanelSpec("Tokens / s", (
            Query(rate_sum(S, "ray_kvtide_prompt_tokens_total", W), "prompt"),
            Query(rate_sum(S, "ray_kvtide_output_tokens_total", W), "output"),
        ), unit="short", width=8, preview=True),
        PanelSpec("Error share", (Query(_share(S, "5.."), "5xx"), Query(_share(S, "4.."), "4xx")),
                  unit="percentunit", width=8, description="Share of finished requests by status class; "
                  "503 also counts streams the engine failed mid-way (sent as HTTP 200).", preview=True),
        PanelSpec("Requests / s by tenant and status",
                  (Query(rate_sum(S, "ray_kvtide_tenant_requests_total", W, by="tenant, status"),
                         "{{tenant}} {{status}}"),),
                  unit="reqps", width=12,
                  description="Each API key is a tenant (named in the keys file, else key-<hash>); none: keys "
                              "off; unauthenticated: refused with 401. 429s here include a tenant's own rate limit "
                              "(frontend.auth.tenant_requests_per_s)."),
        PanelSpec("Refused by admission / s by reason",
                  (Query(rate_sum(S, "ray_kvtide_admission_rejections_total", W, by="reason"), "{{reason}}"),),
                  unit="reqps", width=12, no_value="nothing refused",
                  description="429 (ingress_full, engine_queue_full) and 504 (timeout): load the fleet shed "
                              "to keep admitted requests fast. Sustained: add replicas or raise limits."),
        PanelSpec("Aborted in the engine / s",
                  (Query(rate_sum(S, "ray_kvtide_engine_aborted_requests_total", W), "aborted"),),
                  unit="reqps", width=12, no_value="no aborts",
                  description="Requests whose caller went away mid-generation; their KV blocks were freed."),
    ))
    replicas = RowSpec("Replicas", (
        _replicas_panel(),
        PanelSpec("Serve HTTP requests / s by status code",
                  (Query(rate_sum(S, "ray_serve_num_http_requests_total", W, by="status_code"), "{{status_code}}"),),
                  unit="reqps", description="What Ray Serve's HTTP layer answered, health probes included."),
        PanelSpec("Serve HTTP errors / s by code",
                  (Query(rate_sum(S, "ray_serve_num_http_error_requests_total", W, by="error_code"),
                         "{{error_code}}"),),
                  unit="reqps", no_value="no errors", description="Error answers counted by Ray Serve's HTTP layer."),
    ))
    return DashboardSpec("kvtide-overview", "kvtide / Overview",
                         "SLOs of the OpenAI endpoint: latency percentiles, throughput, errors, replicas.",
                         VARIABLES, (slo, traffic, replicas))


def routing() -> DashboardSpec:
    running = S("ray_vllm_num_requests_running")
    waiting = S("ray_vllm_num_requests_waiting")
    in_flight = f"sum by (ReplicaId) ({running}) + sum by (ReplicaId) ({waiting})"
    prompt_rate = _per_replica_rate(S, "ray_vllm_prompt_tokens_total")
    agreement = "ray_kvtide_router_agreement_checks_total"
    cache = RowSpec("Prefix cache", (
        PanelSpec("Prefix-cache hit rate per replica", (Query(_hit_rate(S, "ReplicaId"), "{{ReplicaId}}"),),
                  unit="percentunit", max=1, width=16, preview=True,
                  description="Prompt tokens found in the replica's prefix cache / tokens looked up. "
                              "Prefix-aware routing raises it; a drop after a scale-up is expected."),
        PanelSpec("Prefix-cache hit rate (all replicas)", (Query(_hit_rate(S, "")),),
                  unit="percentunit", kind="stat", width=8),
    ))
    balance = RowSpec("Balance", (
        PanelSpec("Prompt tokens / s per replica", (Query(prompt_rate, "{{ReplicaId}}"),),
                  unit="short", width=8, preview=True),
        PanelSpec("Load imbalance (busiest / mean prompt tokens/s)",
                  (Query(f"max({prompt_rate}) / clamp_min(avg({prompt_rate}), 1e-9)"),),
                  unit="short", width=8, preview=True,
                  description="1 = perfectly even; 2 = the busiest replica prefills twice the mean. "
                              "Cache affinity trades some balance for hits; load guards cap it."),
        PanelSpec("Requests in flight per replica", (Query(in_flight, "{{ReplicaId}}"),),
                  unit="short", width=8, preview=True),
    ))
    router = RowSpec("Router", (
        PanelSpec("Routing decisions / s by outcome",
                  (Query(rate_sum(S, "ray_kvtide_router_decisions_total", W, by="policy, outcome"),
                         "{{policy}} {{outcome}}"),),
                  unit="ops", width=6),
        PanelSpec("Routing decisions / s by route",
                  (Query(rate_sum(S, "ray_kvtide_router_decisions_total", W, by="route"), "{{route}}"),),
                  unit="ops", width=6,
                  description="session: sent to the replica of the session's previous turn; replicated: a hot "
                              "prefix group spread over several replicas (routing.replication_*); single: "
                              "one replica's cache or load decided."),
        PanelSpec("Matched prefix tokens per decision",
                  _quantiles(S, "ray_kvtide_router_matched_prefix_tokens"), unit="short", width=6,
                  preview=True),
        PanelSpec("Routing decision latency", _quantiles(S, "ray_kvtide_router_decision_latency_seconds"), unit="s",
                  width=6),
        PanelSpec("Router agreement per node (share of checked picks)",
                  (Query(_rate_share(S, agreement, {"agrees": "true"}, by="NodeAddress"), "{{NodeAddress}}"),),
                  unit="percentunit", max=1, width=12,
                  description="Routers share no state: one per node, they agree because they read the same "
                              "engine digests and break ties by rendezvous hashing. A sample of each router's "
                              "decisions is ranked again from that shared state alone (no routing history of "
                              "its own, no session memory, no hot-prefix replication); this is the share whose "
                              "first choice is the same, i.e. a pick a router on another node would make too. "
                              "Low: picks follow what this router alone remembers, so routers on different "
                              "nodes send one prefix to different replicas (split caches, repeated prefills). "
                              "Expected to dip with sticky sessions, hot-prefix replication and bursts of new "
                              "prefixes before the next digest; the next panel says which."),
        PanelSpec("Agreement checks / s by reason",
                  (Query(rate_sum(S, agreement, W, by="reason"), "{{reason}}"),),
                  unit="ops", width=12,
                  description="Checked picks, by what moved a pick off the shared-state choice: session (the "
                              "replica of the session's last turn), history (blocks this router routed that no "
                              "digest shows yet), replication (a hot prefix group's credit on a member), other. "
                              "none: the pick agreed."),
    ))
    predictions = "ray_kvtide_router_predictions_total"
    trust = RowSpec("Index trust (router prediction vs engine)", (
        PanelSpec("Index precision and recall", (
            Query(_prediction_share(S, "true_hit", "true_hit|false_hit"), "precision"),
            Query(_prediction_share(S, "true_hit", "true_hit|missed_hit"), "recall"),
        ), unit="percentunit", max=1, width=12, preview=True,
            description="Precision: share of the cache hits the router predicted that the engine confirmed "
                        "(false hits pull requests to replicas that prefill anyway). Recall: share of the engine's "
                        "hits the router had predicted (missed hits are affinity left unused). prefix_aware only."),
        PanelSpec("Checked predictions / s by outcome",
                  (Query(rate_sum(S, predictions, W, by="outcome"), "{{outcome}}"),), unit="reqps", width=12,
                  description="Each finished request the router predicted for, classified against the engine's "
                              "cached prompt tokens: true_hit, false_hit, missed_hit, true_miss."),
        PanelSpec("Prediction error in tokens by direction",
                  tuple(Query(quantile(q, S, "ray_kvtide_router_prediction_error_tokens", "direction", W),
                              f"{{{{direction}}}} {label}") for q, label in QUANTILES[:2]),
                  unit="short", width=12, preview=True,
                  description="How many prompt tokens the router's prediction was off by (engine cached vs "
                              "predicted), for requests with a hit on either side. over: the router expected more "
                              "(evicted, or its own routing history the engine never confirmed); under: the "
                              "engine had more (a digest not applied yet); exact reads under 1 token."),
        PanelSpec("Cache-digest age per replica",
                  (Query(f"max by (replica) ({S('ray_kvtide_router_digest_age_seconds')})", "{{replica}}"),),
                  unit="s", width=12, preview=True,
                  description="How old the newest cache digest a router holds for each engine replica is (the "
                              "oldest over routers). Healthy: under one stats period plus Ray's push delay; "
                              "includes clock skew between hosts."),
    ))
    books = RowSpec("Engine books by path (kvtide's own, vLLM's layer: tools, Responses, Messages)", (
        PanelSpec("Booked requests / s by path",
                  (Query(rate_sum(S, "ray_kvtide_engine_booked_requests_total", W, by="path"), "{{path}}"),
                   Query(rate_sum(S, "ray_kvtide_vllm_prompts_reused_total", W),
                         "vllm_layer, rendered by the routing peer")),
                  unit="reqps", width=8,
                  description="Generations the engines booked for the routers (pending prefill, hits), by the "
                              "path that made them: kvtide (plain chat and completions) or vllm_layer (tools, "
                              "structured outputs, logprobs, Responses, Messages). Both are routed and scaled on. "
                              "Of the vllm_layer chats, those whose prompt the routing peer rendered with vLLM's "
                              "own renderer (serving.peer_renders_chat: vLLM skips rendering it again)."),
        PanelSpec("Booked uncached prompt tokens / s by path",
                  (Query(rate_sum(S, "ray_kvtide_engine_booked_prefill_tokens_total", W, by="path"), "{{path}}"),),
                  unit="short", width=8,
                  description="Prompt tokens the engines had to prefill (not in their prefix cache when booked), "
                              "the cost the router weighs as pending prefill."),
        PanelSpec("Exclusive hit tokens / s by path",
                  (Query(rate_sum(S, "ray_kvtide_engine_exclusive_hit_tokens_total", W, by="path"), "{{path}}"),),
                  unit="short", width=8, no_value="no exclusive hits",
                  description="Prompt tokens served from cached blocks no other replica held when the request was "
                              "routed: what a replica's cache is worth to a cache-aware scale-down."),
    ))
    tiers = RowSpec("KV tiers (GPU prefix cache, then the CPU tier: engine.kv_offload)", (
        PanelSpec("Prefix hit tokens / s per replica by tier",
                  (Query(rate_sum(S, HIT_TOKENS, W, by="ReplicaId, tier"), "{{ReplicaId}} {{tier}}"),),
                  unit="short", width=8,
                  description="Prompt tokens served from cached KV: gpu, from the replica's prefix cache; cpu, "
                              "loaded back from its CPU tier (cheaper than a prefill, dearer than a GPU hit). "
                              "cpu reads 0 where no CPU tier runs."),
        PanelSpec("Router matched tokens / s by tier",
                  (Query(rate_sum(S, "ray_kvtide_router_matched_tokens_total", W, by="tier"), "{{tier}}"),),
                  unit="short", width=8,
                  description="Matched prefix tokens on the replicas the router chose, by the tier it expected "
                              "them from. Compare with the engines' hits by tier (left): a router cpu match the "
                              "engine serves as a prefill is a CPU-tier block evicted before the request came."),
        _cached_blocks_panel("Cached blocks per replica by tier"),
    ))
    return DashboardSpec("kvtide-routing", "kvtide / Routing & cache",
                         "Whether prefix-aware routing pays: cache hit rate per replica and the balance it costs.",
                         VARIABLES, (cache, balance, router, trust, books, tiers))


def capacity() -> DashboardSpec:
    auto = {"deployment": ENGINE_DEPLOYMENT}
    kv = RowSpec("KV cache and queues", (
        PanelSpec("KV-cache usage per replica", (Query(f"max by (ReplicaId) ({S('ray_vllm_kv_cache_usage_perc')})",
                                                       "{{ReplicaId}}"),),
                  unit="percentunit", max=1, width=8, preview=True,
                  description="Blocks held by running requests. Near 1 the engine preempts and queues."),
        PanelSpec("Requests waiting per replica", (Query(f"sum by (ReplicaId) ({S('ray_vllm_num_requests_waiting')})",
                                                         "{{ReplicaId}}"),), unit="short", width=8, preview=True),
        PanelSpec("Preemptions / s per replica", (Query(_preemptions(S), "{{ReplicaId}}"),), unit="short", width=8,
                  preview=True, description="Requests evicted to free KV blocks, recomputed later: wasted compute."),
        PanelSpec("Requests running per replica", (Query(f"sum by (ReplicaId) ({S('ray_vllm_num_requests_running')})",
                                                         "{{ReplicaId}}"),), unit="short", width=8),
        PanelSpec("Engine queue time", _quantiles(S, "ray_vllm_request_queue_time_seconds"), unit="s", width=8),
        PanelSpec("Requests queued at the engine handle",
                  (Query(f"sum({S('ray_serve_deployment_queued_queries', **auto)})", "queued"),), unit="short",
                  width=8, description="Requests the ingress holds because every replica is at max_ongoing_requests."),
    ))
    replicas = RowSpec("Replicas and the KV autoscaler", (
        _replicas_panel(),
        PanelSpec("KV autoscaler: replicas", (
            Query(f"max({S('ray_kvtide_autoscaler_desired_replicas', **auto)})", "desired"),
            Query(f"max({S('ray_kvtide_autoscaler_running_replicas', **auto)})", "running"),
            Query(f"max({S('ray_kvtide_autoscaler_starting_replicas', **auto)})", "starting"),
            Query(f"max({S('ray_kvtide_autoscaler_standby_replicas', **auto)})", "standby"),
        ), unit="short", no_value="autoscaling off", needs=AUTOSCALER_NEEDS),
        PanelSpec("KV autoscaler: inputs", (
            Query(f"max({S('ray_kvtide_autoscaler_kv_usage_perc', **auto)})", "mean KV usage"),
            Query(f"max({S('ray_kvtide_autoscaler_num_waiting', **auto)})", "waiting"),
        ), unit="short", no_value="autoscaling off", needs=AUTOSCALER_NEEDS),
        PanelSpec("KV autoscaler: decisions / s by reason",
                  (Query(rate_sum(S, "ray_kvtide_autoscaler_decisions_total", W, by="reason", **auto), "{{reason}}"),),
                  unit="ops", no_value="autoscaling off", needs=AUTOSCALER_NEEDS,
                  description="'bounds' means the law wanted to move past min/max_replicas."),
        PanelSpec("Warm-up prefill tokens / s",
                  (Query(rate_sum(S, "ray_kvtide_engine_warmup_prefill_tokens_total", W), "prefilled"),),
                  unit="short", no_value="no replica started warm",
                  description="Hot shared prefixes a new replica prefilled before taking traffic (cache-warm start)."),
        PanelSpec("Replica start-up, s by phase (slowest replica)",
                  (Query(f"max by (phase) ({S('ray_kvtide_engine_start_phase_seconds')})", "{{phase}}"),),
                  unit="s", no_value="no replica started",
                  description="Where a new replica's time to serve goes: process start, vLLM import, engine "
                              "(engine-core spawn, model load, KV cache, CUDA graphs), warm start. The autoscaler's "
                              "reaction time is the decision plus this."),
    ))
    tier = RowSpec("CPU KV tier (engine.kv_offload)", (
        _cached_blocks_panel("KV blocks held per replica by tier"),
        PanelSpec("KV offload / onload per replica, bytes / s",
                  (Query(rate_sum(S, TRANSFER_BYTES, W, by="ReplicaId, direction"), "{{ReplicaId}} {{direction}}"),),
                  unit="binBps", width=8,
                  description="KV moved between each replica's GPUs and its CPU tier: offload (GPU to CPU, blocks "
                              "stored as they are computed) and onload (CPU to GPU, CPU-tier hits loaded back). "
                              "Onload near the host link's bandwidth: CPU-tier hits queue behind each other."),
        PanelSpec("CPU-tier onload rate per replica, tokens / s",
                  (Query(f"max by (ReplicaId) ({S('ray_kvtide_engine_onload_tokens_per_second')})",
                         "{{ReplicaId}}"),),
                  unit="short", width=8,
                  description="Prompt tokens' KV per second each replica loads from its CPU tier, as it reports to "
                              "the routers (measured over recent onloads, else engine.kv_offload.load_gib_per_s): "
                              "what a CPU-tier match costs in the router's eyes. 0: no CPU tier, or not known."),
    ))
    return DashboardSpec("kvtide-capacity", "kvtide / Capacity & autoscaling",
                         "Is there room for more load: KV usage, queues, preemptions, replica counts.",
                         VARIABLES, (kv, replicas, tier))


def engine() -> DashboardSpec:
    sel = Selectors(base=BASE, model="$model", extra={"ReplicaId": "$replica"})
    replica_var = VariableSpec(
        "replica", "Replica", f'label_values({ANCHOR}{{{BASE},model_name=~"$model"}}, ReplicaId)', all_value=None)
    row = RowSpec("Replica $replica", (
        PanelSpec("KV-cache usage", (Query(f"max({sel('ray_vllm_kv_cache_usage_perc')})", "KV usage"),),
                  unit="percentunit", max=1, width=8, preview=True),
        PanelSpec("Requests running / waiting", (
            Query(f"sum({sel('ray_vllm_num_requests_running')})", "running"),
            Query(f"sum({sel('ray_vllm_num_requests_waiting')})", "waiting"),
        ), unit="short", width=8, preview=True),
        PanelSpec("Tokens / s", (
            Query(rate_sum(sel, "ray_vllm_prompt_tokens_total", W), "prompt"),
            Query(rate_sum(sel, "ray_vllm_generation_tokens_total", W), "generation"),
        ), unit="short", width=8, preview=True),
        PanelSpec("Engine time to first token", _quantiles(sel, "ray_vllm_time_to_first_token_seconds"),
                  unit="s", width=8, preview=True),
        PanelSpec("Engine inter-token latency", _quantiles(sel, "ray_vllm_inter_token_latency_seconds"),
                  unit="s", width=8, preview=True),
        PanelSpec("Engine request latency", _quantiles(sel, "ray_vllm_e2e_request_latency_seconds"),
                  unit="s", width=8),
        PanelSpec("Prefix-cache hit rate", (Query(_hit_rate(sel, ""), "hit rate"),), unit="percentunit", max=1,
                  width=8, preview=True),
        PanelSpec("Preemptions / s", (Query(f"sum({_preemptions(sel)})", "preemptions"),), unit="short", width=8),
        PanelSpec("Finished requests / s by reason",
                  (Query(rate_sum(sel, "ray_vllm_request_success_total", W, by="finished_reason"),
                         "{{finished_reason}}"),), unit="reqps", width=8),
        PanelSpec("Prefix hit tokens / s by tier", (Query(rate_sum(sel, HIT_TOKENS, W, by="tier"), "{{tier}}"),),
                  unit="short", width=8, description="gpu: the prefix cache; cpu: loaded from the CPU tier."),
        PanelSpec("KV blocks held by tier", (Query(f"sum by (tier) ({sel(CACHED_BLOCKS)})", "{{tier}}"),),
                  unit="short", width=8),
        PanelSpec("CPU tier transfers, bytes / s",
                  (Query(rate_sum(sel, TRANSFER_BYTES, W, by="direction"), "{{direction}}"),),
                  unit="binBps", width=8, description="offload: GPU to CPU; onload: CPU to GPU."),
    ), repeat="replica")
    return DashboardSpec("kvtide-engine", "kvtide / Engine detail",
                         "One row per engine replica (vLLM's own view): KV, batch, latency, cache, preemptions.",
                         (*VARIABLES, replica_var), (row,))


def dashboard_specs() -> tuple[DashboardSpec, ...]:
    """Every dashboard kvtide ships."""
    return (overview(), routing(), capacity(), engine())


def build_all() -> dict[str, dict[str, Any]]:
    """File name → Grafana dashboard JSON model."""
    return {f"{spec.uid}.json": render(spec) for spec in dashboard_specs()}


def to_text(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2, sort_keys=True) + "\n"


def write_dashboards(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, dashboard in build_all().items():
        path = directory / name
        path.write_text(to_text(dashboard))
        paths.append(path)
    return paths


def generate() -> list[Path]:
    """Rewrite every committed artifact: dashboards (both copies), alert rules, docs/metrics.md."""
    from kvtide.dashboards import alerts, docs

    for stale in [*GENERATED_DIR.glob("*.json"), *CHART_DASHBOARDS_DIR.glob("*.json")]:
        stale.unlink()
    generated = write_dashboards(GENERATED_DIR)
    copies = [Path(shutil.copyfile(path, CHART_DASHBOARDS_DIR / path.name)) for path in generated]
    written = [*generated, *copies, *alerts.write_rules()]
    written.append(docs.write_metrics_md(dashboard_specs()))
    return written


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO_ROOT))
    sys.exit(0)
