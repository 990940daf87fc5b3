"""kvtide's alert rules as code: one definition, two files.

    dashboards/generated/alerts.rules.yaml   a Prometheus rule file, no job selector (promtool, plain Prometheus)
    helm/kvtide/files/alerts.yaml            the chart's PrometheusRule `spec`: every selector carries
                                             KVTIDE_SELECTOR, which templates/prometheusrule.yaml replaces
                                             with this release's `job="<namespace>/<fullname>"`

Each rule is split into a condition-free `signal` (the quantity an SRE would graph) and a
`condition` around it, `expr = condition.format(signal=signal)`. The integration test
evaluates every `signal` on a real Prometheus scraping a real cluster and requires data,
so no rule can silently watch a series that does not exist; `promtool test rules`
(tests/unit/test_alerts.py) proves each `expr` fires on a bad series and stays silent on
a good one.

Autoscaler pinned at max: Serve's `serve_autoscaling_target_replicas` carries no max, and
kvtide's control law clamps to its bounds before Serve sees its answer (Serve's own
`desired_replicas` equals the target). The law reports a clamp as a `reason="bounds"`
decision; clamped while the autoscaler still sees pressure (KV use high or requests
waiting) means pinned at max_replicas: clamping at min_replicas happens only on slack.

Index trust: the router's view of each replica's cache is only as fresh as the digests it
holds (`ray_kvtide_router_digest_age_seconds`: healthy is under one stats period plus the
push delay), and only as good as its predictions turn out (`ray_kvtide_router_predictions_total`:
precision is the share of predicted hits the engine confirmed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtide.config import RoutingConfig
from kvtide.dashboards.catalog import ENGINE_DEPLOYMENT, REPO_ROOT
from kvtide.dashboards.promql import Selectors, quantile, rate_sum

RULES_FILE = REPO_ROOT / "dashboards" / "generated" / "alerts.rules.yaml"
CHART_RULES_FILE = REPO_ROOT / "helm" / "kvtide" / "files" / "alerts.yaml"
RUNBOOKS = "docs/runbooks.md"
CHART_SELECTOR = "KVTIDE_SELECTOR"


@dataclass(frozen=True)
class Slo:
    """Thresholds of the rules; defaults suit GPU serving (the CPU demo breaks the TTFT one)."""

    ttft_p99_s: float = 2.0
    max_5xx_ratio: float = 0.05
    kv_saturated_perc: float = 0.95
    max_preemptions_per_s: float = 0.1
    autoscaler_pressure_kv_perc: float = 0.85
    router_fallback_ratio: float = 0.5
    # A digest arrives every routing.stats_period_s (1 s by default) plus Ray's push delay; three
    # periods missed in a row is no jitter: the engine stopped reporting or Ray stopped pushing,
    # and the router routes on a stale view. A rule file is static, so this follows the default
    # period; a cluster that sets another one should scale it (Slo(digest_stale_s=...)).
    digest_stale_s: float = 3 * RoutingConfig().stats_period_s
    # Under half of the predicted hits confirmed: cache affinity is pulling requests to replicas
    # that prefill them anyway (evictions the digests miss, hashing that disagrees with vLLM's).
    min_index_precision: float = 0.5
    # ... judged only over at least this many predicted hits in the 10-minute window (one per
    # 12 s): below it one burst of concurrent requests on a new prefix (all predicted before the
    # first finished its prefill, so all false hits) would decide the ratio alone.
    min_predicted_hits: int = 50


@dataclass(frozen=True)
class AlertRule:
    name: str
    group: str
    signal: str  # condition-free PromQL: returns data whenever the watched thing exists
    condition: str  # "{signal} > 2": the alerting expression around it (plain replace, not format)
    for_: str
    severity: str
    summary: str
    description: str
    runbook: str  # one or two sentences: what to look at first
    needs: str | None = None  # like catalog.Metric.needs: when `signal` has data at all

    @property
    def expr(self) -> str:
        return self.condition.replace("{signal}", self.signal)

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOKS}#{self.name.lower()}"

    def to_rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook": self.runbook,
                "runbook_url": self.runbook_url,
            },
        }


def all_rules(sel: Selectors, slo: Slo = Slo()) -> list[AlertRule]:
    """Every rule kvtide knows, enabled or not (see `rules`)."""
    engine = {"deployment": ENGINE_DEPLOYMENT}
    requests = "ray_kvtide_requests_total"
    total = rate_sum(sel, requests, "5m", by="model")
    by_replica = "model_name, ReplicaId"
    auto_by = "application, deployment"
    predictions = "ray_kvtide_router_predictions_total"
    predicted_hits = rate_sum(sel, predictions, "10m", by="model", outcome="true_hit|false_hit")
    return [
        AlertRule(
            "KvtideNoReadyReplicas", "kvtide.availability",
            signal=f"sum({sel('ray_serve_deployment_replica_healthy', **engine)})",
            # No healthy engine, or nothing scraped at all (vector(0)); a deliberate scale to
            # zero (target 0, min_replicas 0) is not an outage.
            condition=("({signal} or vector(0)) < 1 unless on() "
                       f"(max({sel('ray_serve_autoscaling_target_replicas', **engine)}) == 0)"),
            for_="5m", severity="critical",
            summary="No kvtide engine replica is healthy",
            description="{{ $value }} engine replicas have passed Ray Serve's health check for 5 minutes "
                        "(or no kvtide series is scraped at all): the OpenAI endpoint cannot generate.",
            runbook="Check `kubectl get rayservice,pods`, the Serve controller log and the engine replicas' "
                    "logs for the startup or health-check error; then the Prometheus target page.",
        ),
        AlertRule(
            "KvtideHighServerErrorRate", "kvtide.availability",
            signal=f"({rate_sum(sel, requests, '5m', by='model', status='5..')} or {total} * 0) / {total}",
            condition=f"{{signal}} > {slo.max_5xx_ratio}",
            for_="10m", severity="critical",
            summary="kvtide answers more than {} of requests with a 5xx".format(f"{slo.max_5xx_ratio:.0%}"),
            description="{{ $value | humanizePercentage }} of requests to model {{ $labels.model }} "
                        "failed server-side over 5 minutes (503 also counts streams the engine failed mid-way).",
            runbook="Look for engine deaths and restarts (Engine detail dashboard, replica logs); "
                    "client errors (4xx) are not counted here.",
        ),
        AlertRule(
            "KvtideTTFTAboveSLO", "kvtide.latency",
            signal=quantile(0.99, sel, "ray_kvtide_time_to_first_token_seconds", "model", "5m"),
            condition=f"{{signal}} > {slo.ttft_p99_s}",
            for_="10m", severity="warning",
            summary=f"kvtide time to first token p99 above {slo.ttft_p99_s:g} s",
            description="p99 time to first token of {{ $labels.model }} is {{ $value | humanizeDuration }} "
                        f"(SLO {slo.ttft_p99_s:g} s) over the last 5 minutes.",
            runbook="Queueing or prefill-bound: check waiting requests and KV usage (Capacity dashboard); "
                    "add replicas or raise max_replicas.",
        ),
        AlertRule(
            "KvtideKVCacheSaturated", "kvtide.capacity",
            signal=f"max by ({by_replica}) ({sel('ray_vllm_kv_cache_usage_perc')})",
            condition=f"{{signal}} > {slo.kv_saturated_perc}",
            for_="15m", severity="warning",
            summary=f"kvtide engine KV cache above {slo.kv_saturated_perc:.0%} for 15 minutes",
            description="Replica {{ $labels.ReplicaId }} holds {{ $value | humanizePercentage }} of its KV blocks: "
                        "new requests queue and running ones get preempted.",
            runbook="Check routing balance (one hot replica?) and the autoscaler; add replicas or lower "
                    "max_num_seqs / max_model_len.",
        ),
        AlertRule(
            "KvtideSustainedPreemptions", "kvtide.capacity",
            # The counter appears at the first preemption; until then the signal reads 0 per replica.
            signal=(f"{rate_sum(sel, 'ray_vllm_num_preemptions_total', '5m', by=by_replica)} "
                    f"or sum by ({by_replica}) ({sel('ray_vllm_num_requests_running')}) * 0"),
            condition=f"({{signal}}) > {slo.max_preemptions_per_s}",
            for_="15m", severity="warning",
            summary="kvtide engines keep preempting requests",
            description="Replica {{ $labels.ReplicaId }} preempts {{ $value | humanize }} requests/s: "
                        "KV blocks run out and work is recomputed.",
            runbook="KV memory is too small for the load: add replicas, raise kv cache memory, "
                    "or lower max_num_seqs.",
        ),
        AlertRule(
            "KvtideAutoscalerPinnedAtMax", "kvtide.capacity",
            signal=(f"sum by ({auto_by}) "
                    f"(increase({sel('ray_kvtide_autoscaler_decisions_total', reason='bounds', **engine)}[15m]))"),
            condition=(f"{{signal}} > 0 and on ({auto_by}) ("
                       f"max by ({auto_by}) ({sel('ray_kvtide_autoscaler_kv_usage_perc', **engine)}) "
                       f"> {slo.autoscaler_pressure_kv_perc} or "
                       f"max by ({auto_by}) ({sel('ray_kvtide_autoscaler_num_waiting', **engine)}) > 0)"),
            for_="15m", severity="warning",
            summary="kvtide autoscaler wants more engine replicas than max_replicas allows",
            description="The KV autoscaler of {{ $labels.application }}/{{ $labels.deployment }} was clamped "
                        "by its bounds while under pressure for 15 minutes.",
            runbook="Raise replicas.max_replicas (and the worker group's maxReplicas / GPU quota) or shed load.",
            needs="engine autoscaling on",
        ),
        AlertRule(
            "KvtideRouterLoadFallbackHigh", "kvtide.routing",
            signal=(f"({rate_sum(sel, 'ray_kvtide_router_decisions_total', '5m', by='policy', outcome='load_fallback')}"
                    f" or {rate_sum(sel, 'ray_kvtide_router_decisions_total', '5m', by='policy')} * 0)"
                    f" / {rate_sum(sel, 'ray_kvtide_router_decisions_total', '5m', by='policy')}"),
            condition=f"{{signal}} > {slo.router_fallback_ratio}",
            for_="30m", severity="warning",
            summary="Most kvtide routing decisions fall back to load-only",
            description="{{ $value | humanizePercentage }} of {{ $labels.policy }} routing decisions ignored "
                        "cache affinity because the preferred replica was overloaded.",
            runbook="Replicas with the cached prefixes are saturated: add replicas or review the router's "
                    "load guard.",
        ),
        AlertRule(
            "KvtideRouterDigestStale", "kvtide.routing",
            # max over routers: one router routing on a stale view is enough to mislead its traffic.
            signal=f"max by (replica) ({sel('ray_kvtide_router_digest_age_seconds')})",
            condition=f"{{signal}} > {slo.digest_stale_s:g}",
            for_="1m", severity="warning",
            summary="A kvtide router's cache view of an engine replica is stale",
            description="The newest cache digest a router holds for replica {{ $labels.replica }} is "
                        "{{ $value | humanizeDuration }} old (expected under "
                        f"{slo.digest_stale_s:g} s): prefix-aware routing decides on an outdated view of its cache.",
            runbook="Check the replica's health and record_routing_stats errors "
                    "(ray_serve_routing_stats_error_total), the Serve controller's load, and the hosts' clock sync.",
            needs="routing.policy prefix_aware with engine prefix caching on",
        ),
        AlertRule(
            "KvtideRouterIndexPrecisionLow", "kvtide.routing",
            signal=(f"({rate_sum(sel, predictions, '10m', by='model', outcome='true_hit')} or {predicted_hits} * 0)"
                    f" / {predicted_hits}"),
            condition=(f"({{signal}}) < {slo.min_index_precision} and on (model) "
                       f"(sum by (model) (increase({sel(predictions, outcome='true_hit|false_hit')}[10m])) "
                       f">= {slo.min_predicted_hits})"),
            for_="5m", severity="warning",
            summary="Most of the router's predicted cache hits are not hits in the engine",
            description="Only {{ $value | humanizePercentage }} of the cache hits the router predicted for model "
                        "{{ $labels.model }} over 10 minutes were confirmed by the engine "
                        f"(threshold {slo.min_index_precision:.0%}, at least {slo.min_predicted_hits} predictions).",
            runbook="Compare digest age and the prediction error by direction (Routing & cache dashboard); "
                    "look for evictions (KV usage near 1, preemptions) and block-size or salt mismatches.",
            needs="routing.policy prefix_aware",
        ),
    ]


def rules(sel: Selectors, slo: Slo = Slo()) -> list[AlertRule]:
    """Every alert rule (each names only catalogued metrics: `metric()` raises on any other)."""
    return all_rules(sel, slo)


def rule_groups(sel: Selectors, slo: Slo = Slo()) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for rule in rules(sel, slo):
        groups.setdefault(rule.group, []).append(rule.to_rule())
    return {"groups": [{"name": name, "rules": items} for name, items in groups.items()]}


_HEADER = """\
# GENERATED by `python -m kvtide.dashboards.build` from dashboards/alerts.py: do not edit.
{what}
# Annotations hold Prometheus templates ({{{{ $labels.x }}}}, {{{{ $value }}}}); runbooks: {runbooks}.
"""


def rules_text(chart: bool = False) -> str:
    """The plain rule file, or (chart=True) the chart's files/alerts.yaml with KVTIDE_SELECTOR."""
    sel = Selectors(base=CHART_SELECTOR if chart else "")
    what = ("# The `spec` of the chart's PrometheusRule: templates/prometheusrule.yaml replaces\n"
            "# KVTIDE_SELECTOR with this release's scrape job matcher, job=\"<namespace>/<fullname>\"."
            if chart else
            "# A Prometheus rule file (rule_files:). Its selectors match every job: point this\n"
            "# Prometheus at one kvtide cluster, or use the Helm chart's copy, which selects its own job.")
    body = yaml.safe_dump(rule_groups(sel), sort_keys=False, width=120, allow_unicode=True)
    return _HEADER.format(what=what, runbooks=RUNBOOKS) + body


def write_rules() -> list[Path]:
    RULES_FILE.parent.mkdir(parents=True, exist_ok=True)
    RULES_FILE.write_text(rules_text(chart=False))
    CHART_RULES_FILE.write_text(rules_text(chart=True))
    return [RULES_FILE, CHART_RULES_FILE]
