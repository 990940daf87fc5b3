"""The KV-utilization control law: (context, state, tunables) -> (desired, state, decision).

Request counts are a poor load signal for LLM engines: ten long-context requests can
fill a replica's KV cache while a hundred short ones barely touch it. This law scales
engine replicas on the share of KV blocks in use, and treats waiting requests and
preemptions (the engine's own "KV is full" symptoms) as reasons to add capacity.

It is pure: no Ray import, no clock, no I/O. `autoscaling.ray_policy` feeds it from Ray
Serve's `AutoscalingContext`; tests feed it hand-built contexts.

The loop, one call per controller tick:

    observe  load_kv   = mean_kv_usage_perc × num_running     (KV in use, in replicas' worth)
             capacity  = num_running + num_starting           (replicas already decided)
    decide   pressure  = preemption | queueing | kv_high      (want more, held for upscale_delay_s)
             slack     = load_kv / (capacity - 1) < lower     (one fewer still cool, held for downscale_delay_s)
    apply    desired   = capacity ± step, clamped to [min_replicas, max_replicas]

                 kv_low (after downscale_delay_s)      kv_high (after upscale_delay_s)
                ◄──────────────────────┐         ┌──────────────────────►
    0 ──────────────── lower_kv_perc ──┴─ target ─┴── upper_kv_perc ──────────── 1
         projected util with n-1 replicas         projected util with n replicas
                                                  (running + starting)

Hysteresis, three ways:
- a dead band: nothing happens while the projections sit between the thresholds;
- scale-down is judged on the *projected* utilization after removing a replica
  (load_kv / (n-1), i.e. mean × n/(n-1)), so a removal never lands above
  `lower_kv_perc`, well below `upper_kv_perc`; comparing the mean alone would
  remove a replica and then immediately want it back;
- a condition must hold on *every* tick for its whole delay; one tick that breaks it
  restarts the timer, and every scale action restarts both timers. An alternating
  signal therefore never acts.

Replicas still starting are capacity on the way, never counted twice: kv_high compares
the load spread over running + starting replicas, queueing and preemption (symptoms
only running replicas can report) pause while any replica is starting, and scale-down
waits until none is starting. The desired count includes starting replicas.

Signals (per running replica, `ReplicaStats`), all over the look-back window:
- `kv_usage_perc`     mean share of KV blocks in use, 0..1.
- `num_waiting`       mean requests waiting in the engine's queue (not yet scheduled).
- `num_running`       mean requests the engine is running.
- `num_preemptions`   preemptions *within the window* (a delta, not the engine's
                      cumulative counter; the Ray adapter differences the counter).

Tunables (`kvtide.config.AutoscalingSettings`, the config's `autoscaling:` section, declared
once there; its validation keeps lower < target < upper; defaults a GPU operator would accept):
- `target_kv_perc` = 0.7       KV utilization a scale-up sizes for: desired =
                               ceil(load_kv / target_kv_perc). Leaves ~30% of blocks for
                               prefix-cache hits and decode growth.
- `upper_kv_perc` = 0.85       scale up when the KV load spread over running + starting
                               replicas stays above this. vLLM starts preempting near 1.0.
- `lower_kv_perc` = 0.6        scale down when the load spread over one replica fewer
                               stays below this. Must be < target < upper.
- `upscale_delay_s` = 30       how long pressure must persist before adding replicas.
                               Short: a replica takes minutes to load weights anyway.
- `downscale_delay_s` = 300    how long slack must persist before removing a replica.
                               Long: a removed replica takes its prefix cache with it.
- `max_step` = 2               most replicas added or removed by one decision.
- `upscale_waiting_per_replica` = 2.0
                               mean waiting requests per running replica at or above
                               which the deployment counts as queueing.
- `upscale_preemptions_per_replica` = 1.0
                               preemptions per running replica within the window at or
                               above which the deployment counts as preempting.

Scale-down also requires that nothing queues (fewer than one waiting request in the
whole deployment, on average) and that nothing was preempted. Scaling 1 → 0 (only when
`min_replicas` is 0) needs the deployment to be idle: no KV in use, nothing running or
waiting; Ray Serve's cold-start path brings the first replica back on a request.

Every call returns a `Decision` whose reason is one of `REASONS`; `log_line()` renders it
with its inputs on one line.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvtide.config import AutoscalingSettings

Reason = Literal["kv_high", "queueing", "preemption", "kv_low", "bounds", "hold"]
REASONS: tuple[Reason, ...] = ("kv_high", "queueing", "preemption", "kv_low", "bounds", "hold")


@dataclass(frozen=True)
class ReplicaStats:
    """One running replica's engine signals over the look-back window.

    The boundary between what an engine measures and what the law decides on: the Ray
    adapter builds these from `record_autoscaling_stats` reports, tests build them by hand.
    """

    kv_usage_perc: float
    num_waiting: float = 0.0
    num_running: float = 0.0
    num_preemptions: float = 0.0  # within the window (delta), not cumulative


@dataclass(frozen=True)
class LawContext:
    """Everything the law observes at one tick; `now_s` is a parameter, not a clock read."""

    replicas: tuple[ReplicaStats, ...]  # running replicas that reported stats
    num_running_replicas: int
    num_starting_replicas: int
    min_replicas: int
    max_replicas: int
    now_s: float

    @property
    def num_current_replicas(self) -> int:
        """Replicas already decided (running + starting): what a hold returns."""
        return self.num_running_replicas + self.num_starting_replicas


@dataclass(frozen=True)
class LawState:
    """Timers carried between ticks: since when pressure / slack has held without a break."""

    pressure_since_s: float | None = None
    slack_since_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "LawState":
        data = data or {}
        return cls(pressure_since_s=data.get("pressure_since_s"), slack_since_s=data.get("slack_since_s"))


@dataclass(frozen=True)
class Decision:
    """Why the law returned what it returned, with the inputs it saw; one log line each."""

    reason: Reason
    desired_replicas: int
    num_running_replicas: int
    num_starting_replicas: int
    min_replicas: int
    max_replicas: int
    mean_kv_usage_perc: float | None  # None: no replica reported yet
    projected_kv_perc: float | None  # load over running + starting
    projected_kv_one_fewer_perc: float | None  # load over one replica fewer; None when n <= 1
    num_waiting: float
    num_running_requests: float
    num_preemptions: float
    pending: Reason | None = None  # the condition whose timer is running on a hold
    pending_for_s: float = 0.0

    @property
    def num_current_replicas(self) -> int:
        return self.num_running_replicas + self.num_starting_replicas

    def log_line(self) -> str:
        def perc(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        line = (
            f"kvtide autoscaler: reason={self.reason} desired={self.desired_replicas} "
            f"current={self.num_current_replicas} running={self.num_running_replicas} "
            f"starting={self.num_starting_replicas} bounds=[{self.min_replicas},{self.max_replicas}] "
            f"kv_mean={perc(self.mean_kv_usage_perc)} kv_projected={perc(self.projected_kv_perc)} "
            f"kv_one_fewer={perc(self.projected_kv_one_fewer_perc)} waiting={self.num_waiting:.1f} "
            f"running_reqs={self.num_running_requests:.1f} preemptions={self.num_preemptions:.1f}"
        )
        if self.pending is not None:
            line += f" pending={self.pending} for_s={self.pending_for_s:.1f}"
        return line


@dataclass(frozen=True)
class _Observation:
    mean_kv_usage_perc: float | None
    load_kv: float  # replicas' worth of KV in use
    num_waiting: float
    num_running_requests: float
    num_preemptions: float


def _observe(context: LawContext) -> _Observation:
    stats = context.replicas
    if not stats:
        return _Observation(None, 0.0, 0.0, 0.0, 0.0)
    mean_kv = sum(min(max(s.kv_usage_perc, 0.0), 1.0) for s in stats) / len(stats)
    # Running replicas that have not reported yet are assumed to look like those that did.
    return _Observation(
        mean_kv_usage_perc=mean_kv,
        load_kv=mean_kv * context.num_running_replicas,
        num_waiting=sum(s.num_waiting for s in stats),
        num_running_requests=sum(s.num_running for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
    )


def _pressure(context: LawContext, obs: _Observation, tunables: AutoscalingSettings,
              projected_kv: float | None) -> Reason | None:
    """The most severe reason to add replicas now, or None. Severity: preemption > queueing > kv_high."""
    num_running = max(context.num_running_replicas, 1)
    if context.num_starting_replicas == 0 and obs.mean_kv_usage_perc is not None:
        if obs.num_preemptions / num_running >= tunables.upscale_preemptions_per_replica:
            return "preemption"
        if obs.num_waiting / num_running >= tunables.upscale_waiting_per_replica:
            return "queueing"
    if projected_kv is not None and projected_kv > tunables.upper_kv_perc:
        return "kv_high"
    return None


def _slack(context: LawContext, obs: _Observation, tunables: AutoscalingSettings,
           one_fewer_kv: float | None) -> bool:
    """True when the deployment would stay cool with one replica fewer."""
    if context.num_starting_replicas or obs.mean_kv_usage_perc is None:
        return False
    if obs.num_waiting >= 1.0 or obs.num_preemptions > 0:
        return False
    if context.num_running_replicas == 1:  # 1 -> 0 only when idle
        return obs.load_kv == 0.0 and obs.num_running_requests == 0.0
    return one_fewer_kv is not None and one_fewer_kv < tunables.lower_kv_perc


def _up_step(context: LawContext, obs: _Observation, tunables: AutoscalingSettings) -> int:
    sized_for_target = math.ceil(obs.load_kv / tunables.target_kv_perc - 1e-9)
    return min(max(1, sized_for_target - context.num_current_replicas), tunables.max_step)


def _down_step(context: LawContext, obs: _Observation, tunables: AutoscalingSettings) -> int:
    n = context.num_running_replicas
    if n == 1:
        return 1
    step = 1
    # Remove more than one only while the load over what remains still stays below lower.
    while step < tunables.max_step and n - step - 1 >= 1 and obs.load_kv / (n - step - 1) < tunables.lower_kv_perc:
        step += 1
    return step


def decide(context: LawContext, state: LawState, tunables: AutoscalingSettings) -> tuple[int, LawState, Decision]:
    """One tick of the law: desired replica count (running + starting), next state, decision."""
    # observe
    obs = _observe(context)
    n_current = context.num_current_replicas
    projected_kv = obs.load_kv / n_current if n_current and obs.mean_kv_usage_perc is not None else None
    one_fewer_kv = (obs.load_kv / (n_current - 1)
                    if n_current > 1 and obs.mean_kv_usage_perc is not None else None)

    # decide: each timer runs only while its condition holds on every tick
    pressure = _pressure(context, obs, tunables, projected_kv)
    slack = pressure is None and _slack(context, obs, tunables, one_fewer_kv)
    pressure_since = (state.pressure_since_s if state.pressure_since_s is not None else context.now_s) if pressure else None
    slack_since = (state.slack_since_s if state.slack_since_s is not None else context.now_s) if slack else None

    reason: Reason = "hold"
    wanted = n_current
    pending: Reason | None = None
    pending_for_s = 0.0
    if pressure is not None:
        pending, pending_for_s = pressure, context.now_s - pressure_since
        if pending_for_s >= tunables.upscale_delay_s:
            reason, wanted = pressure, n_current + _up_step(context, obs, tunables)
    elif slack:
        pending, pending_for_s = "kv_low", context.now_s - slack_since
        if pending_for_s >= tunables.downscale_delay_s:
            reason, wanted = "kv_low", n_current - _down_step(context, obs, tunables)

    # apply: bounds win over everything, and say so
    desired = min(max(wanted, context.min_replicas), context.max_replicas)
    if desired != wanted:
        reason = "bounds"
    next_state = LawState(pressure_since_s=pressure_since, slack_since_s=slack_since)
    if desired != n_current:
        next_state = LawState()  # every action restarts both timers: the next one waits a full delay
        pending, pending_for_s = None, 0.0
    elif reason != "hold":
        # Wanted to act but the bounds said no: restart the timer so this is logged once per delay.
        next_state = LawState()
        pending = None
    decision = Decision(
        reason=reason,
        desired_replicas=desired,
        num_running_replicas=context.num_running_replicas,
        num_starting_replicas=context.num_starting_replicas,
        min_replicas=context.min_replicas,
        max_replicas=context.max_replicas,
        mean_kv_usage_perc=obs.mean_kv_usage_perc,
        projected_kv_perc=projected_kv,
        projected_kv_one_fewer_perc=one_fewer_kv,
        num_waiting=obs.num_waiting,
        num_running_requests=obs.num_running_requests,
        num_preemptions=obs.num_preemptions,
        pending=pending if reason == "hold" else None,
        pending_for_s=pending_for_s if reason == "hold" else 0.0,
    )
    return desired, next_state, decision


__all__ = ["REASONS", "Decision", "LawContext", "LawState", "Reason", "ReplicaStats", "decide"]
