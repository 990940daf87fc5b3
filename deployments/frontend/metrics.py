"""OpenAI frontend metrics, exported through Ray's metrics agent (Prometheus names gain `ray_`).

They live where the frontend runs: an ingress replica (ingress mode) or an engine replica
serving HTTP itself (direct mode); the names are the same in both.

Latency histograms use buckets from 5 ms to 60 s: CPU demo engines sit at the top,
GPU engines at the bottom, and both must resolve p50 and p99.
"""

from __future__ import annotations

from ray.util import metrics

from kvtide.deployments.metric_sampling import RateCappedSampler
from kvtide.deployments.routing.trust import Comparison

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# Serving-path phases sit well under a millisecond on a good path: finer buckets at the bottom.
PHASE_BUCKETS_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 10.0, 60.0]
TTFT_PHASES = ("frontend", "transport", "engine")
ITL_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
# |engine cached − predicted| in tokens. Ray's histograms take positive boundaries only, so
# the sign is a label (direction: over / under / exact) and the buckets hold the magnitude.
# Exact matches (0) fall in the first bucket, [0, 1], so their quantiles read under a token.
# Errors come in whole KV blocks: 16 and 32 resolve one block at block size 16 or 32 (a
# digest period's drift), the doublings up to 16k a whole long prompt mispredicted.
PREDICTION_ERROR_BUCKETS_TOKENS = [1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class FrontendMetrics:
    """The frontend's own series; one instance per frontend (engine replica in direct mode, Ingress replica)."""

    def __init__(self) -> None:
        tags = ("model", "endpoint")
        self.ttft_s = metrics.Histogram(
            "kvtide_time_to_first_token_seconds", "Arrival at the frontend to the first output token.",
            boundaries=LATENCY_BUCKETS_S, tag_keys=tags)
        self.itl_s = metrics.Histogram(
            "kvtide_inter_token_latency_seconds", "Time between output tokens of a streamed request "
            "(a rate-capped random sample of them under load).",
            boundaries=ITL_BUCKETS_S, tag_keys=tags)
        self.itl_sampler = RateCappedSampler()  # per token: see kvtide.deployments.metric_sampling
        self.e2e_s = metrics.Histogram(
            "kvtide_e2e_latency_seconds", "Arrival at the frontend to the last byte of the response.",
            boundaries=LATENCY_BUCKETS_S, tag_keys=tags)
        self.requests = metrics.Counter(
            "kvtide_requests", "Finished requests by HTTP status.", tag_keys=("model", "endpoint", "status"))
        self.tenant_requests = metrics.Counter(
            "kvtide_tenant_requests", "Generation requests by tenant (the API key's, deployments/tenancy.py; none: "
            "keys off; unauthenticated: refused with 401) and HTTP status.", tag_keys=("model", "tenant", "status"))
        self.prompt_tokens = metrics.Counter(
            "kvtide_prompt_tokens", "Prompt tokens admitted.", tag_keys=tags)
        self.vllm_prompts_reused = metrics.Counter(
            "kvtide_vllm_prompts_reused", "Chats vLLM's layer ran on the prompt the routing peer rendered with vLLM's "
            "own renderer, instead of rendering it again (serving.peer_renders_chat).", tag_keys=("model",))
        self.output_tokens = metrics.Counter(
            "kvtide_output_tokens", "Output tokens generated.", tag_keys=tags)
        self.admission_rejections = metrics.Counter(
            "kvtide_admission_rejections", "Requests refused to protect the fleet, by reason "
            "(ingress_full, engine_queue_full: 429; timeout: 504).", tag_keys=("model", "reason"))

        self.ttft_phase_s = metrics.Histogram(
            "kvtide_ttft_phase_seconds", "Time to first token by phase: frontend (arrival to the engine call: gate, "
            "parse, tokenize), transport (routing, Ray hops, waiting for a replica), engine (the engine's own "
            "queue + prefill).", boundaries=PHASE_BUCKETS_S, tag_keys=("model", "phase"))

        # Index trust (deployments.routing.trust): recorded where the engine's cached count is
        # known, for requests whose router wrote a prediction (prefix_aware only).
        self.predictions = metrics.Counter(
            "kvtide_router_predictions", "Router cache predictions checked against the engine, by outcome "
            "(true_hit, false_hit, missed_hit, true_miss).", tag_keys=("model", "outcome"))
        self.prediction_error_tokens = metrics.Histogram(
            "kvtide_router_prediction_error_tokens", "Absolute difference between the engine's cached and the "
            "router's predicted prompt tokens, per request with a hit on either side; direction: over (router "
            "predicted more), under, exact.",
            boundaries=PREDICTION_ERROR_BUCKETS_TOKENS, tag_keys=("model", "direction"))

    def on_prediction(self, model: str, comparison: Comparison) -> None:
        self.predictions.inc(1, {"model": model, "outcome": comparison.outcome})
        # True misses (0 predicted, 0 cached) are only counted: in a workload without shared
        # prefixes they would pile up at 0 and hide the errors that matter.
        if comparison.outcome != "true_miss":
            self.prediction_error_tokens.observe(abs(comparison.error_tokens),
                                                 {"model": model, "direction": comparison.direction})

    def on_ttft_phases(self, model: str, frontend_s: float, transport_s: float, engine_s: float) -> None:
        for phase, value_s in zip(TTFT_PHASES, (frontend_s, transport_s, engine_s)):
            self.ttft_phase_s.observe(max(value_s, 0.0), {"model": model, "phase": phase})

    def on_inter_token_latency(self, now_s: float, per_token_s: float, tags: dict[str, str]) -> None:
        if self.itl_sampler.keep(now_s):
            self.itl_s.observe(per_token_s, tags)

    def on_rejected(self, model: str, reason: str) -> None:
        self.admission_rejections.inc(1, {"model": model, "reason": reason})

    def on_request_done(self, model: str, endpoint: str, status: int) -> None:
        self.requests.inc(1, {"model": model, "endpoint": endpoint, "status": str(status)})

    def on_tenant_request(self, model: str, tenant: str, status: int) -> None:
        self.tenant_requests.inc(1, {"model": model, "tenant": tenant, "status": str(status)})
