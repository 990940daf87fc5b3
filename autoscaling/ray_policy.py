"""Ray Serve adapter of the KV control law: `AutoscalingContext` → `decide` → (desired, policy_state).

Ray Serve 2.60's custom policy contract, as the installed source has it
(ray/serve/_private/autoscaling_state.py, ray/serve/autoscaling_policy.py):

- `AutoscalingPolicy.policy_function` is an import path; the controller cloudpickles the
  object *by value* for this module only (`autoscaling.control_law` etc. are imported by
  reference, so the `autoscaling` package must be importable in the controller).
- If the object is a class, it is instantiated once per (re)deploy with `policy_kwargs`,
  then called every controller tick (~0.1 s) as `policy(ctx) -> (desired, policy_state)`.
  A plain function never receives `policy_kwargs`, hence `KvPolicy` is a class.
- Ray wraps the policy: on 0 running replicas with requests it skips the policy (cold
  start); afterwards it applies up/downscaling factors and its own up/downscale delays
  against `ctx.target_num_replicas`, then clamps to min/max. The law owns the delays, so
  `autoscaling_config` sets Ray's delays to 0 (and leaves the factors at 1).
- `ctx.policy_state` is what the previous call returned (plus Ray's own delay keys,
  which Ray merges back in); the law's timers live under `POLICY_STATE_KEY`.
- Custom metrics: whatever a replica's `record_autoscaling_stats()` returns (a flat
  `dict[str, int | float]`, sampled every min(look_back_period_s × 0.2, metrics_interval_s)
  and pushed every `metrics_interval_s`; Ray 2.60 reads the config field, not yet the
  RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S that replaces it) appears as
      ctx.aggregated_metrics[key][replica_id] -> float   time-weighted mean over look_back_period_s
      ctx.raw_metrics[key][replica_id]        -> [TimeStampedValue(timestamp, value), ...]
  for running replicas that have reported at least once. The law's slow path reads the
  means; its fast path reads the newest raw sample of each replica and its timestamp.

The metric keys a replica reports are defined in `kvtide.autoscaling.replica_stats`
(the engine imports that pure module, not this adapter).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from kvtide.autoscaling import roles_channel
from kvtide.autoscaling.control_law import Decision, LawContext, LawState, ReplicaStats, decide
from kvtide.autoscaling.metrics import autoscaler_metrics
from kvtide.autoscaling.replica_stats import (KV_USAGE_KEY, NUM_PREEMPTIONS_TOTAL_KEY, NUM_RUNNING_KEY,
                                              NUM_WAITING_KEY, RECENT_EXCLUSIVE_HIT_TOKENS_KEY, RECENT_HIT_TOKENS_KEY)
from kvtide.autoscaling.standby import (RolePlan, Roles, assign, cache_worth as standby_cache_worth, cache_worth_order,
                                       reconcile)
from kvtide.config import AutoscalingSettings

# A child of Ray Serve's logger, so the lines land in the controller's log file.
logger = logging.getLogger("ray.serve.kvtide.autoscaler")

POLICY_STATE_KEY = "kvtide_law"
ROLES_STATE_KEY = "kvtide_roles"
KV_POLICY_PATH = "kvtide.autoscaling.ray_policy:KvPolicy"


def _counter_delta(series: Any, since_s: float) -> float:
    """Increase of a monotone counter over the samples at or after `since_s` (0 with < 2 samples)."""
    points = [p for p in (series or ()) if p.timestamp >= since_s]
    if len(points) < 2:
        return 0.0
    return max(points[-1].value - points[0].value, 0.0)


def _newest(series: Any) -> Any | None:
    """The newest TimeStampedValue of a raw series, or None when there is none."""
    return max(series, key=lambda point: point.timestamp) if series else None


def law_context(ctx: Any, look_back_s: float, recent_s: float | None = None,
                roles: Roles | None = None) -> LawContext:
    """Translate Ray's `AutoscalingContext` into the law's inputs.

    Replicas still starting are `target - running` when the target is above the running
    count. When it is below (Ray is stopping replicas), only the `target` replicas that
    stay count as running, so a hold never undoes a scale-down in flight.

    Window means feed the slow path; the newest raw KV / waiting sample of each replica,
    the newest KV sample's timestamp (`sampled_at_s`: the controller ticks ~10× per push,
    the law records each sample once) and the preemptions within `recent_s` (the law's
    trend_window_s) feed the fast path.

    With `roles` (standby engines, cache-aware scale-down) the law sees the active replicas
    only: standbys are out of the KV average and the counts, and the replicas starting are
    those the fleet still lacks of the active count last asked for.
    """
    now_s = ctx.current_time if ctx.current_time is not None else time.time()
    recent_s = look_back_s if recent_s is None else recent_s
    aggregated = ctx.aggregated_metrics or {}
    raw = ctx.raw_metrics or {}
    kv = aggregated.get(KV_USAGE_KEY, {})
    waiting = aggregated.get(NUM_WAITING_KEY, {})
    running = aggregated.get(NUM_RUNNING_KEY, {})
    preemptions = raw.get(NUM_PREEMPTIONS_TOTAL_KEY, {})
    running_ids = ctx.running_replicas
    if roles is not None:
        active = set(roles.active)
        running_ids = [replica_id for replica_id in running_ids if replica_id.unique_id in active]
    reporting = [replica_id for replica_id in running_ids if replica_id in kv]
    kv_now = {replica_id: _newest(raw.get(KV_USAGE_KEY, {}).get(replica_id)) for replica_id in reporting}
    waiting_now = {replica_id: _newest(raw.get(NUM_WAITING_KEY, {}).get(replica_id)) for replica_id in reporting}
    stats = tuple(
        ReplicaStats(
            kv_usage_perc=float(kv[replica_id]),
            num_waiting=float(waiting.get(replica_id, 0.0)),
            num_running=float(running.get(replica_id, 0.0)),
            num_preemptions=_counter_delta(preemptions.get(replica_id), now_s - look_back_s),
            kv_usage_now_perc=None if kv_now[replica_id] is None else float(kv_now[replica_id].value),
            num_waiting_now=None if waiting_now[replica_id] is None else float(waiting_now[replica_id].value),
            num_preemptions_recent=_counter_delta(preemptions.get(replica_id), now_s - recent_s),
        )
        for replica_id in reporting
    )
    sample_times = [point.timestamp for point in kv_now.values() if point is not None]
    if roles is not None:
        num_running = len(roles.active)
        num_starting = max(roles.desired_active - num_running, 0)
    else:
        num_current, num_target = ctx.current_num_replicas, ctx.target_num_replicas
        num_running, num_starting = min(num_current, num_target), max(num_target - num_current, 0)
    return LawContext(
        replicas=stats,
        num_running_replicas=num_running,
        num_starting_replicas=num_starting,
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        now_s=now_s,
        sampled_at_s=max(sample_times) if sample_times else None,
    )


def worth_line(replica_ids: Iterable[str], worth: Mapping[str, float]) -> str:
    """'id worth, ...' least first, as the scale-down ranks them (no report: 0)."""
    return ", ".join(f"{r} {worth.get(r, 0.0):,.0f}" for r in cache_worth_order(replica_ids, worth))


def cache_worth(ctx: Any) -> dict[str, float]:
    """Each replica's cache worth (standby.cache_worth) from its newest reports of the prefix-cache
    hit tokens it served within cache_value_window_s, all and exclusive."""
    raw = ctx.raw_metrics or {}
    hits, exclusive = _newest_values(raw, RECENT_HIT_TOKENS_KEY), _newest_values(raw, RECENT_EXCLUSIVE_HIT_TOKENS_KEY)
    return {replica_id: standby_cache_worth(tokens, exclusive.get(replica_id, 0.0))
            for replica_id, tokens in hits.items()}


def _newest_values(raw: Mapping[str, Any], key: str) -> dict[str, float]:
    """replica unique id → the newest raw sample's value of one stats key (replicas with none left out)."""
    values = {}
    for replica_id, series in raw.get(key, {}).items():
        newest = _newest(series)
        if newest is not None:
            values[replica_id.unique_id] = float(newest.value)
    return values


@dataclass(frozen=True)
class Tick:
    """One call's outcome: Serve's target, the state to carry, and what decided it."""

    target: int
    policy_state: dict[str, Any]
    decision: Decision
    plan: RolePlan | None = None  # with standby roles only
    roles_before: Roles | None = None  # the roles reconciled with what Serve runs, before `plan`
    worth: dict[str, float] = field(default_factory=dict)  # each replica's cache worth, with roles only


def policy_tick(ctx: Any, tunables: AutoscalingSettings) -> Tick:
    """observe (context → LawContext, roles reconciled) → decide (control law) → assign (roles), no side
    effect: the Ray policy below and the fleet simulator (kvtide.simulator.autoscale) call this same function."""
    look_back_s = ctx.config.look_back_period_s if ctx.config is not None else 30.0
    roles = None
    if tunables.manages_roles:
        now_s = ctx.current_time if ctx.current_time is not None else time.time()
        roles = reconcile(Roles.from_dict(ctx.policy_state.get(ROLES_STATE_KEY)),
                          [replica_id.unique_id for replica_id in ctx.running_replicas], now_s,
                          tunables.standby_replicas, ctx.target_num_replicas)
    context = law_context(ctx, look_back_s, tunables.trend_window_s, roles)
    state = LawState.from_dict(ctx.policy_state.get(POLICY_STATE_KEY))
    desired, state, decision = decide(context, state, tunables)
    if roles is None:
        return Tick(desired, {POLICY_STATE_KEY: state.to_dict()}, decision)
    worth = cache_worth(ctx)
    plan = assign(roles, desired, worth=worth, now_s=context.now_s, standby_replicas=tunables.standby_replicas,
                  standby_timeout_s=tunables.standby_timeout_s, max_replicas=ctx.capacity_adjusted_max_replicas)
    return Tick(plan.serve_target, {POLICY_STATE_KEY: state.to_dict(), ROLES_STATE_KEY: plan.roles.to_dict()},
                decision, plan, roles, worth)


class KvPolicy:
    """Ray Serve custom autoscaling policy: one instance per deployment, called every tick.

    observe (context → LawContext) → decide (control law) → apply (log, metrics, return).
    """

    def __init__(self, **settings: Any) -> None:
        # Ray hands over plain data (policy_kwargs); validate it back into the one model.
        self.tunables = AutoscalingSettings.model_validate(settings)
        self._last_logged: tuple | None = None
        self._published: bytes | None = None  # the role document last written to the GCS

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        tick = policy_tick(ctx, self.tunables)
        self._log(tick.decision)
        autoscaler_metrics().on_decision(tick.decision, ctx.deployment_name, ctx.app_name or "")
        if tick.plan is not None:
            if tick.plan.demoted:  # the choice's inputs, so an operator can tell why this replica left routing
                logger.info("roles: cache worth of the active replicas before: %s",
                            worth_line(tick.roles_before.active, tick.worth))
            self._publish(ctx, tick.plan)
        return tick.target, tick.policy_state

    def _publish(self, ctx: Any, plan: RolePlan) -> None:
        for verb, ids in (("woke", plan.woken), ("put to standby", plan.demoted), ("retiring", plan.retired)):
            if ids:
                logger.info("roles: %s %s (active %d, standby %d, Serve target %d)", verb, ", ".join(ids),
                            len(plan.roles.active), len(plan.roles.standby), plan.serve_target)
        autoscaler_metrics().on_roles(plan, ctx.deployment_name, ctx.app_name or "")
        document = roles_channel.encode(plan.roles)
        if document != self._published:
            try:
                if roles_channel.publish(ctx.app_name or "", ctx.deployment_name, document):
                    self._published = document
            except Exception as exc:  # the GCS is briefly unreachable: the next tick writes it again
                logger.warning("could not publish roles: %s", exc)

    def _log(self, decision: Decision) -> None:
        # Ticks come ten times a second: INFO for actions and for timers starting or
        # stopping, DEBUG for the steady state in between.
        key = (decision.reason, decision.pending, decision.desired_replicas, decision.num_current_replicas)
        level = logging.INFO if decision.reason != "hold" or key != self._last_logged else logging.DEBUG
        self._last_logged = key
        logger.log(level, decision.log_line())


def autoscaling_config(settings: AutoscalingSettings, min_replicas: int, max_replicas: int,
                       initial_replicas: int | None = None) -> dict[str, Any]:
    """The engine deployment's `autoscaling_config` option for the chosen policy.

    `metrics_interval_s` is `metrics_push_interval_s`. Ray 2.60 marks the field deprecated
    in favour of RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S (kvtide sets that
    too, for the release that reads it), but its replicas and handles still push every
    `metrics_interval_s` (default 10 s, which alone would keep the fast path ~10 s behind)
    and its validator warns, later raises, unless look_back_period_s exceeds it:
    AutoscalingSettings refuses look_back_s <= metrics_push_interval_s, so that holds.
    Setting the field costs one DeprecationWarning where Ray validates the config (hidden
    outside tests by Python's default filters); leaving it out cost the warning above on
    short windows and a 10 s push.
    """
    if not 0 <= min_replicas <= max_replicas or max_replicas < 1:
        raise ValueError(
            f"replicas.min_replicas={min_replicas}, replicas.max_replicas={max_replicas}: "
            "need 0 <= min_replicas <= max_replicas and max_replicas >= 1"
        )
    config: dict[str, Any] = {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        # The standby pool starts with the fleet (kv policy), within max_replicas.
        "initial_replicas": min((max(1, min_replicas) if initial_replicas is None else initial_replicas)
                                + (settings.standby_replicas if settings.policy == "kv" else 0), max_replicas),
        "look_back_period_s": settings.look_back_s,
        "metrics_interval_s": settings.metrics_push_interval_s,
    }
    if settings.policy == "queue_length":
        config.update(
            target_ongoing_requests=settings.target_ongoing_requests,
            upscale_delay_s=settings.upscale_delay_s,
            downscale_delay_s=settings.downscale_delay_s,
        )
        return config
    config.update(
        # The law owns the delays; Ray's delay logic runs after the policy and must not add its own.
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
        policy={"policy_function": KV_POLICY_PATH, "policy_kwargs": settings.model_dump(mode="json")},
    )
    return config
