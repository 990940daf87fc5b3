"""The autoscaler's own series, exported through Ray's metrics agent (Prometheus names gain `ray_`).

    kvtide_autoscaler_desired_replicas{deployment,application}   gauge: the law's answer
    kvtide_autoscaler_running_replicas{deployment,application}   gauge: replicas serving now
    kvtide_autoscaler_starting_replicas{deployment,application}  gauge: replicas on the way
    kvtide_autoscaler_kv_usage_perc{deployment,application}      gauge: mean KV-block use, 0..1
    kvtide_autoscaler_num_waiting{deployment,application}        gauge: waiting requests, all replicas
    kvtide_autoscaler_decisions{deployment,application,reason}   counter (exported `_total`): one per tick
    kvtide_autoscaler_standby_replicas{deployment,application}   gauge: standby (and retiring) replicas kept

The policy runs in the Serve controller, which rebuilds the policy object on every
redeploy; the metric objects are created on first use and then reused for the life of
the process (Ray metric names are process-global), hence the module-level holder. This
module is imported by reference, not pickled with the policy, so the holder really is
one per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtide.autoscaling.control_law import Decision

if TYPE_CHECKING:
    from kvtide.autoscaling.standby import RolePlan

_TAGS = ("deployment", "application")


class AutoscalerMetrics:
    """The gauges and counter above; `on_decision` sets them from one decision."""

    def __init__(self) -> None:
        from ray.util import metrics

        self.desired_replicas = metrics.Gauge(
            "kvtide_autoscaler_desired_replicas", "Engine replicas the KV autoscaler wants (running + starting).",
            tag_keys=_TAGS)
        self.running_replicas = metrics.Gauge(
            "kvtide_autoscaler_running_replicas", "Engine replicas running when the autoscaler decided.",
            tag_keys=_TAGS)
        self.starting_replicas = metrics.Gauge(
            "kvtide_autoscaler_starting_replicas", "Engine replicas still starting when the autoscaler decided.",
            tag_keys=_TAGS)
        self.kv_usage_perc = metrics.Gauge(
            "kvtide_autoscaler_kv_usage_perc", "Mean KV-block utilization (0..1) over the look-back window.",
            tag_keys=_TAGS)
        self.num_waiting = metrics.Gauge(
            "kvtide_autoscaler_num_waiting", "Requests waiting in the engines' queues, summed over replicas.",
            tag_keys=_TAGS)
        self.decisions = metrics.Counter(
            "kvtide_autoscaler_decisions", "Autoscaler decisions (one per controller tick) by reason.",
            tag_keys=(*_TAGS, "reason"))
        self.standby_replicas = metrics.Gauge(
            "kvtide_autoscaler_standby_replicas", "Engine replicas kept out of routing as standby (or retiring).",
            tag_keys=_TAGS)

    def on_roles(self, plan: "RolePlan", deployment: str, application: str) -> None:
        self.standby_replicas.set(len(plan.roles.standby) + len(plan.roles.retiring),
                                  tags={"deployment": deployment, "application": application})

    def on_decision(self, decision: Decision, deployment: str, application: str) -> None:
        tags = {"deployment": deployment, "application": application}
        self.desired_replicas.set(decision.desired_replicas, tags=tags)
        self.running_replicas.set(decision.num_running_replicas, tags=tags)
        self.starting_replicas.set(decision.num_starting_replicas, tags=tags)
        if decision.mean_kv_usage_perc is not None:
            self.kv_usage_perc.set(decision.mean_kv_usage_perc, tags=tags)
        self.num_waiting.set(decision.num_waiting, tags=tags)
        self.decisions.inc(1, tags={**tags, "reason": decision.reason})


_process_metrics: AutoscalerMetrics | None = None


def autoscaler_metrics() -> AutoscalerMetrics:
    """This process's metric objects, created on first call."""
    global _process_metrics
    if _process_metrics is None:
        _process_metrics = AutoscalerMetrics()
    return _process_metrics
