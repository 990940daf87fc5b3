"""The metric catalog: every series kvtide's dashboards and alerts may name, as Prometheus sees it.

Why it exists: metrics are a contract (ARCHITECTURE decision 7). Dashboards and alert
rules are built only from names listed here (`metric()` raises on any other), and tests
hold the list to the truth:

    code (ray.util.metrics.*) ──► Ray metrics agent ──► scrape: ray_<name>[_total]
          │ static AST scan (unit)        │ real Prometheus (integration)
          ▼                               ▼
    CATALOG  ◄── every ray_kvtide_* in code/scrape is here; every entry here is exported

- kvtide's own series (`ray_kvtide_*`) are listed exhaustively: a test fails if code
  exports one the catalog lacks, or the catalog lists one no code exports. So a metric
  that does not exist yet is NOT listed; adding it once it is exported is one `Metric(...)`
  entry below, plus the panel or alert rule that uses it (a unit test requires one).
- vLLM's and Ray Serve's series are the subset kvtide relies on; a unit test checks each
  name against the installed vLLM / Ray sources, the integration test against a scrape.

Naming through Ray: Ray's agent prefixes `ray_`; a Counter gains `_total`; vLLM's
`vllm:x` is sanitized to `vllm_x` by its Ray wrapper, so `vllm:num_preemptions` is
scraped as `ray_vllm_num_preemptions_total`. Ray adds `RAY_LABELS` to every series (and
OpenTelemetry's `otel_scope_*`); on Kubernetes the PodMonitor adds `namespace`, `pod`,
`job`, `container`, `endpoint`.
"""

from __future__ import annotations

import ast
import enum
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Labels Ray's metrics agent puts on every series it exports.
RAY_LABELS = ("Component", "NodeAddress", "SessionName", "Version", "WorkerId")
# Labels vLLM's RayPrometheusStatLogger puts on every engine series (ReplicaId: the Serve replica).
VLLM_LABELS = ("model_name", "engine", "ReplicaId")
# kvtide's engine deployment name (kvtide.deployments.names.ENGINE_DEPLOYMENT; a unit test pins the two equal).
ENGINE_DEPLOYMENT = "Engine"


class Kind(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Source(str, enum.Enum):
    """Who exports the series; the docs group by it."""

    FRONTEND = "frontend"  # deployments/frontend/metrics.py
    ROUTER = "router"  # deployments/routing/ray_router.py
    AUTOSCALER = "autoscaler"  # autoscaling/metrics.py
    ENGINE = "engine"  # the engine replica: vLLM through vllm.v1.metrics.ray_wrappers, and kvtide's own
    SERVE = "serve"  # Ray Serve's controller, proxy and replicas


@dataclass(frozen=True)
class Metric:
    """One metric family as scraped from Ray's metrics port.

    `labels` are the family's own labels (Ray's `RAY_LABELS` come on top); `model_label`
    names the label that carries the served model name, so dashboards can filter by
    `$model`; `needs` says what must happen before the series exists at all (None: it
    exists once the cluster served one request).
    """

    name: str
    kind: Kind
    source: Source
    labels: tuple[str, ...]
    unit: str
    help: str
    model_label: str | None = None
    needs: str | None = None

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this family."""
        if self.kind is Kind.HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


_I, _R, _A, _E, _S = Source.FRONTEND, Source.ROUTER, Source.AUTOSCALER, Source.ENGINE, Source.SERVE
_C, _G, _H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
_ING = ("model", "endpoint")
_AUTO = ("deployment", "application")
ROUTER_ON = "a kvtide request router (routing.policy prefix_aware or round_robin) and one request"
AUTOSCALING_ON = "engine autoscaling on (replicas.min_replicas/max_replicas) and one controller tick"
ADMISSION_REJECTED = "a first request refused by admission control (429 at capacity, 504 past its deadline)"
PREDICTION_CHECKED = "routing.policy prefix_aware and one finished request it routed"
PREDICTED_HIT_CHECKED = "routing.policy prefix_aware and one finished request with a cache hit predicted or reported"
DIGEST_HELD = "routing.policy prefix_aware with engine prefix caching on (engines report cache digests)"
AGREEMENT_CHECKED = "routing.policy prefix_aware, two engine replicas or more, and one request with a full block"

CATALOG: tuple[Metric, ...] = (
    # --- frontend (deployments/frontend/metrics.py) --------------------------------------
    Metric("ray_kvtide_time_to_first_token_seconds", _H, _I, _ING, "s",
           "Arrival at the frontend to the first output token (buckets 5 ms .. 60 s).", "model"),
    Metric("ray_kvtide_inter_token_latency_seconds", _H, _I, _ING, "s",
           "Time between output tokens of a streamed request, per token; under load a random sample of at most "
           "200 tokens a second per replica (quantiles hold, `_count` is not a token count).", "model"),
    Metric("ray_kvtide_ttft_phase_seconds", _H, _I, ("model", "phase"), "s",
           "Time to first token by phase: frontend (arrival to the engine call), transport (routing, Ray hops, "
           "waiting for a replica), engine (the engine's own queue + prefill).", "model"),
    Metric("ray_kvtide_e2e_latency_seconds", _H, _I, _ING, "s",
           "Arrival at the frontend to the last byte of the response.", "model"),
    Metric("ray_kvtide_requests_total", _C, _I, (*_ING, "status"), "requests",
           "Finished requests by HTTP status (499: client went away; 503 mid-stream engine failure).", "model"),
    Metric("ray_kvtide_tenant_requests_total", _C, _I, ("model", "tenant", "status"), "requests",
           "Generation requests by tenant (an API key's; none: keys off; unauthenticated: 401) and HTTP status.",
           "model"),
    Metric("ray_kvtide_prompt_tokens_total", _C, _I, _ING, "tokens", "Prompt tokens admitted.", "model"),
    Metric("ray_kvtide_vllm_prompts_reused_total", _C, _I, ("model",), "requests",
           "Chats vLLM's layer ran on the prompt the routing peer rendered with vLLM's own renderer, instead of "
           "rendering it again.", "model",
           needs="serving.peer_renders_chat on, its renderer built, and one chat that vLLM's layer answers"),
    Metric("ray_kvtide_output_tokens_total", _C, _I, _ING, "tokens", "Output tokens generated.", "model"),
    Metric("ray_kvtide_admission_rejections_total", _C, _I, ("model", "reason"), "requests",
           "Requests refused to protect the fleet, by reason (ingress_full, engine_queue_full: 429; timeout: 504).",
           "model", needs=ADMISSION_REJECTED),
    # Index trust (deployments/routing/trust.py), recorded by the frontend where the engine's cached
    # count is known; named router_* because they judge the router's index.
    Metric("ray_kvtide_router_predictions_total", _C, _I, ("model", "outcome"), "requests",
           "Router cache predictions checked against the engine when the request finished, by outcome: true_hit "
           "(router predicted cached tokens, engine had some), false_hit (predicted, engine had none), missed_hit "
           "(predicted none, engine had some), true_miss. Precision = true_hit / (true_hit + false_hit), recall = "
           "true_hit / (true_hit + missed_hit). Dropped when another replica served the request than the one "
           "predicted.", "model", needs=PREDICTION_CHECKED),
    Metric("ray_kvtide_router_prediction_error_tokens", _H, _I, ("model", "direction"), "tokens",
           "Absolute difference between the engine's cached and the router's predicted prompt tokens, per "
           "checked request with a hit on either side (true misses are only counted); direction: over (router "
           "predicted more than the engine had), under, exact. Buckets 1 (exact) .. 16384.", "model",
           needs=PREDICTED_HIT_CHECKED),
    # --- engine replica, kvtide's own (deployments/engine/replica.py) --------------------------------
    Metric("ray_kvtide_engine_aborted_requests_total", _C, _E, ("model",), "requests",
           "Requests aborted inside the engine because the caller went away (vLLM does not count aborts).",
           "model", needs="a first abort (client disconnect mid-request)"),
    Metric("ray_kvtide_engine_warmup_prefill_tokens_total", _C, _E, ("model",), "tokens",
           "Prompt tokens a new replica prefilled (hot shared prefixes) before taking traffic.",
           "model", needs=AUTOSCALING_ON),
    Metric("ray_kvtide_engine_booked_requests_total", _C, _E, ("model", "path"), "requests",
           "Generation requests the engine replica booked for the routers (deployments/engine/request_book.py), by "
           "the path that made them: kvtide (its own) or vllm_layer (vLLM's serving layer: tools, Responses, "
           "Messages, logprobs, ...).", "model", needs="a first generation request"),
    Metric("ray_kvtide_engine_booked_prefill_tokens_total", _C, _E, ("model", "path"), "tokens",
           "Uncached prompt tokens booked as pending prefill (the replica's own block set's view), by path.",
           "model", needs="a first generation request with a prompt token not cached"),
    Metric("ray_kvtide_engine_exclusive_hit_tokens_total", _C, _E, ("model", "path"), "tokens",
           "Prompt tokens served from cached blocks no other replica held when the request was routed "
           "(routing.trust): the cache's worth to a cache-aware scale-down, by path.", "model",
           needs=PREDICTED_HIT_CHECKED),
    Metric("ray_kvtide_engine_start_phase_seconds", _G, _E, ("model", "phase"), "seconds",
           "Seconds the replica's start-up spent per phase: process (actor process start to constructor), "
           "import (vLLM in the replica), engine (engine-core spawn, model load, KV cache, CUDA graphs), "
           "warm_start (hot-prefix prefill); wake (a woken standby: vLLM's wake and the warm-up prefill).", "model",
           needs="a replica that finished starting"),
    # KV tiers (deployments/engine/stats.py, KvTierMetrics): per replica (ReplicaId: vLLM's label and value), every
    # series from the replica's start, zeros where no CPU tier runs (engine.kv_offload off; always on CPU).
    Metric("ray_kvtide_engine_cached_blocks", _G, _E, ("model", "ReplicaId", "tier"), "blocks",
           "Full KV blocks the replica holds in its prefix cache, by tier: gpu, or cpu (host memory, vLLM's KV "
           "offloading, engine.kv_offload), as its cache digest advertises them to the routers.", "model"),
    Metric("ray_kvtide_engine_prefix_hit_tokens_total", _C, _E, ("model", "ReplicaId", "tier"), "tokens",
           "Prompt tokens served from cached KV, by tier: gpu (vLLM's prefix cache, as vllm:prefix_cache_hits) or "
           "cpu (loaded back from the CPU tier by vLLM's OffloadingConnector: its connector prefix-cache hits).",
           "model"),
    Metric("ray_kvtide_engine_kv_transfer_bytes_total", _C, _E, ("model", "ReplicaId", "direction"), "bytes",
           "KV bytes moved between the replica's GPUs and its CPU tier, by direction: offload (GPU to CPU, each "
           "block stored) or onload (CPU to GPU, a CPU-tier hit loaded back); from the OffloadingConnector's "
           "transfer stats, summed over the engine's workers.", "model"),
    Metric("ray_kvtide_engine_onload_tokens_per_second", _G, _E, ("model", "ReplicaId"), "tokens/s",
           "Prompt tokens' KV per second the replica loads from its CPU tier, as it reports to the routers "
           "(onload_tokens_per_s): measured over its recent onloads, else engine.kv_offload.load_gib_per_s over "
           "its KV bytes per token; 0 without a CPU tier or while not known.", "model"),
    # --- router (deployments/routing/ray_router.py; in the routing peer's or each Ingress replica's process) --
    Metric("ray_kvtide_router_decisions_total", _C, _R, ("policy", "outcome", "route"), "decisions",
           "Routing decisions by policy, outcome (cache_hit, load_fallback, no_match) and route (session: the "
           "replica of the session's last turn; replicated: a hot prefix group spread over k >= 2 replicas; "
           "single: one replica's cache or load).", needs=ROUTER_ON),
    Metric("ray_kvtide_router_matched_prefix_tokens", _H, _R, ("policy",), "tokens",
           "Cached prefix tokens on the chosen replica, per decision.", needs=ROUTER_ON),
    Metric("ray_kvtide_router_matched_tokens_total", _C, _R, ("policy", "tier"), "tokens",
           "Matched prefix tokens on the chosen replica, summed over decisions, by the tier the router expects them "
           "from: gpu (its prefix cache) or cpu (loaded from its CPU KV tier, RoutingDecision.cpu_matched_tokens). "
           "Both series from the router's start, cpu at 0 without CPU tiers.", needs=ROUTER_ON),
    Metric("ray_kvtide_router_decision_latency_seconds", _H, _R, ("policy",), "s",
           "Time to rank replicas for one request.", needs=ROUTER_ON),
    Metric("ray_kvtide_router_digest_age_seconds", _G, _R, ("replica",), "s",
           "Per engine replica (Serve's unique replica id), how old the newest cache digest this router holds is: "
           "the router's wall clock minus the engine's stamp (host clock skew included). Set at most twice a "
           "second, when stats arrive or a decision is made; a replica that left stops being set and Ray's "
           "agent drops its series after two export intervals.", needs=DIGEST_HELD),
    Metric("ray_kvtide_router_agreement_checks_total", _C, _R, ("policy", "agrees", "reason"), "decisions",
           "Sampled routing decisions (one in AGREEMENT_SAMPLE_EVERY of those with a full block and two candidates "
           "or more, deployments/routing/agreement.py) ranked again from shared state alone: the engines' digests "
           "and the same snapshots, without this router's routing history, session memory or hot-group demand. "
           "agrees: true when the first choice is the same (a router on another node would pick alike); reason, "
           "when false: the private input that moved the pick (session, history, replication, other); none when "
           "it agrees.", needs=AGREEMENT_CHECKED),
    # --- autoscaler (autoscaling/metrics.py) ----------------------------------------------
    Metric("ray_kvtide_autoscaler_desired_replicas", _G, _A, _AUTO, "replicas",
           "Engine replicas the KV autoscaler wants (running + starting), after bounds.", needs=AUTOSCALING_ON),
    Metric("ray_kvtide_autoscaler_running_replicas", _G, _A, _AUTO, "replicas",
           "Engine replicas running when the autoscaler decided.", needs=AUTOSCALING_ON),
    Metric("ray_kvtide_autoscaler_starting_replicas", _G, _A, _AUTO, "replicas",
           "Engine replicas still starting when the autoscaler decided.", needs=AUTOSCALING_ON),
    Metric("ray_kvtide_autoscaler_kv_usage_perc", _G, _A, _AUTO, "ratio 0..1",
           "Mean KV-block utilization over the autoscaler's look-back window.", needs=AUTOSCALING_ON),
    Metric("ray_kvtide_autoscaler_num_waiting", _G, _A, _AUTO, "requests",
           "Requests waiting in the engines' queues, summed over replicas.", needs=AUTOSCALING_ON),
    Metric("ray_kvtide_autoscaler_decisions_total", _C, _A, (*_AUTO, "reason"), "decisions",
           "Autoscaler decisions, one per controller tick, by reason "
           "(kv_high, queueing, preemption, kv_low, bounds, hold).", needs=AUTOSCALING_ON),
    Metric("ray_kvtide_autoscaler_standby_replicas", _G, _A, _AUTO, "replicas",
           "Engine replicas kept out of routing as standby (asleep on GPU) or retiring, when the kv policy "
           "assigns roles (autoscaling.standby_replicas, scale_down_chooser cache_aware).", needs=AUTOSCALING_ON),
    # --- engine: vLLM (vllm/v1/metrics/loggers.py, exported by ray_wrappers) -------------------
    Metric("ray_vllm_kv_cache_usage_perc", _G, _E, VLLM_LABELS, "ratio 0..1",
           "KV-cache blocks held by requests; 1 means full.", "model_name"),
    Metric("ray_vllm_num_requests_running", _G, _E, VLLM_LABELS, "requests",
           "Requests in the engine's running batch.", "model_name"),
    Metric("ray_vllm_num_requests_waiting", _G, _E, VLLM_LABELS, "requests",
           "Requests queued in the engine, waiting for KV blocks or a batch slot.", "model_name"),
    Metric("ray_vllm_num_preemptions_total", _C, _E, VLLM_LABELS, "preemptions",
           "Requests preempted (KV blocks reclaimed, recomputed later).", "model_name",
           needs="a first preemption (vLLM skips zero increments)"),
    Metric("ray_vllm_prefix_cache_queries_total", _C, _E, VLLM_LABELS, "tokens",
           "Prompt tokens looked up in the prefix cache.", "model_name"),
    Metric("ray_vllm_prefix_cache_hits_total", _C, _E, VLLM_LABELS, "tokens",
           "Prompt tokens found in the prefix cache.", "model_name"),
    Metric("ray_vllm_prompt_tokens_total", _C, _E, VLLM_LABELS, "tokens",
           "Prefill tokens processed (cache hits excluded from compute, not from this count).", "model_name"),
    Metric("ray_vllm_generation_tokens_total", _C, _E, VLLM_LABELS, "tokens",
           "Output tokens generated by the engine.", "model_name"),
    Metric("ray_vllm_request_success_total", _C, _E, (*VLLM_LABELS, "finished_reason"), "requests",
           "Requests the engine finished, by reason (stop, length, abort).", "model_name"),
    Metric("ray_vllm_time_to_first_token_seconds", _H, _E, VLLM_LABELS, "s",
           "Engine-side time to first token (queue + prefill).", "model_name"),
    Metric("ray_vllm_inter_token_latency_seconds", _H, _E, VLLM_LABELS, "s",
           "Engine-side time between output tokens; sampled like the one above.", "model_name"),
    Metric("ray_vllm_e2e_request_latency_seconds", _H, _E, VLLM_LABELS, "s",
           "Engine-side request latency, arrival to finish.", "model_name"),
    Metric("ray_vllm_request_queue_time_seconds", _H, _E, VLLM_LABELS, "s",
           "Time a request spent waiting in the engine's queue.", "model_name"),
    # --- Ray Serve (ray/serve/_private) --------------------------------------------------
    Metric("ray_serve_num_http_requests_total", _C, _S, ("route", "method", "application", "status_code"),
           "requests", "HTTP requests answered by Serve, by status code."),
    Metric("ray_serve_num_http_error_requests_total", _C, _S, ("route", "error_code", "method", "application"),
           "requests", "HTTP responses with a 4xx or 5xx status, as Serve counts them."),
    Metric("ray_serve_deployment_replica_healthy", _G, _S, ("deployment", "replica", "application"),
           "0/1", "1 per healthy replica of a deployment, 0 once it stops or fails its health check."),
    Metric("ray_serve_autoscaling_target_replicas", _G, _S, ("deployment", "application"),
           "replicas", "Replicas Serve is driving the deployment to (fixed count, or the autoscaler's)."),
    Metric("ray_serve_deployment_queued_queries", _G, _S, ("deployment", "application", "handle", "actor_id"),
           "requests", "Requests queued at a deployment handle, not yet assigned to a replica."),
)

_BY_NAME = {m.name: m for m in CATALOG}
assert len(_BY_NAME) == len(CATALOG), "duplicate catalog entry"


def metric(name: str) -> Metric:
    """The catalog entry for `name`; a KeyError naming the fix for anything else."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in dashboards/catalog.py: add a Metric entry once code exports it") from None


def series_names() -> dict[str, Metric]:
    """Every stored sample name (histograms: _bucket/_sum/_count) → its family."""
    return {series: m for m in CATALOG for series in m.series}


def kvtide_metrics() -> tuple[Metric, ...]:
    return tuple(m for m in CATALOG if m.name.startswith("ray_kvtide_"))


# --- static check: what kvtide's own code exports ---------------------------------------------

_RAY_METRIC_CLASSES = {"Counter": Kind.COUNTER, "Gauge": Kind.GAUGE, "Histogram": Kind.HISTOGRAM}
KVTIDE_PACKAGES = ("cluster", "deployments", "autoscaling", "benchmarks")


def exported_metric_names_from_code(root: Path = REPO_ROOT) -> dict[str, Kind]:
    """`ray_*` names kvtide's packages create through `ray.util.metrics`, found by AST.

    Catches `metrics.Counter("kvtide_x", ...)`, `Counter(name="kvtide_x")` and the like
    with a literal name; Ray's naming applies (`ray_` prefix, counters gain `_total`). The
    integration test's scrape is the definitive check; this one runs in milliseconds.
    """
    found: dict[str, Kind] = {}
    for package in KVTIDE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(), filename=str(path))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                cls = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if cls not in _RAY_METRIC_CLASSES:
                    continue
                name_node = node.args[0] if node.args else next(
                    (kw.value for kw in node.keywords if kw.arg == "name"), None)
                if not (isinstance(name_node, ast.Constant) and isinstance(name_node.value, str)):
                    continue
                if not _imports_ray_metrics(tree):
                    continue
                kind = _RAY_METRIC_CLASSES[cls]
                suffix = "_total" if kind is Kind.COUNTER and not name_node.value.endswith("_total") else ""
                found[f"ray_{name_node.value}{suffix}"] = kind
    return found


def _imports_ray_metrics(tree: ast.AST) -> bool:
    """Only modules that import ray.util.metrics count (prometheus_client has a Counter too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("ray.util", "ray.util.metrics"):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("ray.util.metrics") for a in node.names):
            return True
    return False
