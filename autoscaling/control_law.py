"""The KV-utilization control law: (context, state, tunables) -> (desired, state, decision).

Request counts are a poor load signal for LLM engines: ten long-context requests can
fill a replica's KV cache while a hundred short ones barely touch it. This law scales
engine replicas on the share of KV blocks in use, and treats waiting requests and
preemptions (the engine's own "KV is full" symptoms) as reasons to add capacity.

It is pure: no Ray import, no clock, no I/O. `autoscaling.ray_policy` feeds it from Ray
Serve's `AutoscalingContext`; tests feed it hand-built contexts and replay traces
(tests/data/autoscaling_traces). Time is an input: `now_s`, and `sampled_at_s` for when
the newest stats sample was taken.

The loop, one call per controller tick:

    observe  load_kv   = mean_kv_usage_perc × num_running     (KV in use, in replicas' worth, window mean)
             load_now  = latest kv sample × num_running       (the same from the newest samples)
             ring     += (sampled_at_s, load_now, waiting_now) once per new sample, last trend_window_s
             capacity  = num_running + num_starting           (replicas already decided)
    decide   fast      = preemption | growing queue | kv trend  (latest samples, held for fast_upscale_delay_s)
             pressure  = preemption | queueing | kv_high      (window means, held for upscale_delay_s)
             slack     = load_kv / (capacity - 1) < lower     (one fewer still cool, held for downscale_delay_s,
                                                               and no scale-up within scale_down_cooldown_s)
    apply    desired   = capacity ± step, clamped to [min_replicas, max_replicas]

                 kv_low (after downscale_delay_s        kv_high (after upscale_delay_s; or, on a
                 and the cooldown)                      rising trend, after fast_upscale_delay_s)
                ◄──────────────────────┐         ┌──────────────────────►
    0 ──────────────── lower_kv_perc ──┴─ target ─┴── upper_kv_perc ──────────── 1
         projected util with n-1 replicas         projected util with n replicas
                                                  (running + starting)

Two ways up:
- the fast path acts within seconds on the latest samples. It fits a least-squares line
  (`fit_trend`) to the ring's load and fires when the line, started from the lower of its
  level and the latest sample and extended trend_horizon_s ahead, passes upper_kv_perc
  over running + starting replicas (kv_high); or when waiting requests per replica are at
  or above upscale_waiting_per_replica and growing (queueing); or when preemptions within
  trend_window_s reach upscale_preemptions_per_replica (preemption). The trigger must hold
  on every tick for fast_upscale_delay_s. It needs MIN_TREND_SAMPLES samples no older than
  trend_window_s: stalled reports decide nothing. The projection is capped at the running
  replicas' whole KV, so a climb that has saturated asks for nothing more once capacity is
  on the way; its step is sized for where the load is heading (the largest of the window
  mean, the latest load, the projection and the queued KV: the latest load scaled by
  (running + waiting) / running requests, since a full cache cannot show how far demand
  is past it; the slow path sizes for the larger of the mean and the queued KV). KV that
  is high but flat is not a trend: the slow path takes it.
- the slow path is the law before the fast one: the look-back-window means above their
  thresholds for upscale_delay_s. It catches what the fast path does not (a plateau above
  upper, a queue that does not grow) and is all there is with `fast_upscale: false`.

Hysteresis, four ways:
- a dead band: nothing happens while the projections sit between the thresholds;
- scale-down is judged on the *projected* utilization after removing a replica
  (load_kv / (n-1), i.e. mean × n/(n-1)), so a removal never lands above
  `lower_kv_perc`, well below `upper_kv_perc`; comparing the mean alone would
  remove a replica and then immediately want it back;
- a condition must hold on *every* tick for its whole delay; one tick that breaks it
  restarts the timer, and every scale action restarts all timers. An alternating
  signal therefore never acts;
- a cooldown: no scale-down within scale_down_cooldown_s of the last scale-up, whatever
  the delays say, so a replica added on a trend gets to take load before the law judges
  slack (the slack timer keeps running; the removal waits for the cooldown to end).

Replicas still starting are capacity on the way, never counted twice: kv_high and the kv
trend compare the load spread over running + starting replicas, queueing and preemption
(symptoms only running replicas can report) pause while any replica is starting, and
scale-down waits until none is starting. The fast path's preemption count covers
trend_window_s, so it is trusted only once the last replica to start has served that
long. The desired count includes starting replicas.

Signals (per running replica, `ReplicaStats`):
- `kv_usage_perc`         mean share of KV blocks in use over the look-back window, 0..1.
- `num_waiting`           mean requests waiting in the engine's queue (not yet scheduled).
- `num_running`           mean requests the engine is running.
- `num_preemptions`       preemptions *within the window* (a delta, not the engine's
                          cumulative counter; the Ray adapter differences the counter).
- `kv_usage_now_perc`, `num_waiting_now`
                          the newest samples (None: the window means stand in).
- `num_preemptions_recent` preemptions within the last trend_window_s.

Tunables (`kvtide.config.AutoscalingSettings`, the config's `autoscaling:` section, declared
once there; its validation keeps lower < target < upper; defaults a GPU operator would accept):
- `target_kv_perc` = 0.7       KV utilization a scale-up sizes for: desired =
                               ceil(load / target_kv_perc), load as above (KV in use,
                               or the queued KV). Leaves ~30% of blocks for
                               prefix-cache hits and decode growth.
- `upper_kv_perc` = 0.85       scale up when the KV load spread over running + starting
                               replicas stays above this. vLLM starts preempting near 1.0.
- `lower_kv_perc` = 0.6        scale down when the load spread over one replica fewer
                               stays below this. Must be < target < upper.
- `upscale_delay_s` = 30       how long window-mean pressure must persist (slow path).
                               Short: a replica takes minutes to load weights anyway.
- `downscale_delay_s` = 300    how long slack must persist before removing a replica.
                               Long: a removed replica takes its prefix cache with it.
- `fast_upscale` = true        the fast path on. Off: the mean-only law (for comparisons).
- `fast_upscale_delay_s` = 2   how long a fast trigger must hold (never longer than
                               upscale_delay_s). One stats push (2 s by default): two
                               samples in a row must agree, so one noisy sample never
                               adds a replica, and a step still decides within ~5 s.
- `trend_window_s` = 10        span of the ring the line is fitted to: five samples at a
                               2 s push. Shorter follows a step sooner but lets a short
                               burst pass for a trend; longer lags real steps (the replayed
                               traces in tests/data/autoscaling_traces pin the choice).
- `trend_horizon_s` = 4        how far ahead the line is extended: the hold (2 s) plus one
                               push (2 s), i.e. "will it be past upper by the time a
                               second sample could confirm it". Further ahead reacts to a
                               step sooner but adds replicas on noisy steady load.
- `scale_down_cooldown_s` = 60 no scale-down within this long of a scale-up. A replica
                               added on a trend or a burst stays at least a minute, so a
                               noisy fleet cannot add and remove within a minute.
- `max_step` = 2               most replicas added or removed by one decision.
- `upscale_waiting_per_replica` = 2.0
                               waiting requests per running replica (window mean; or the
                               latest sample, growing, on the fast path) at or above
                               which the deployment counts as queueing.
- `upscale_preemptions_per_replica` = 1.0
                               preemptions per running replica within the window (or
                               within trend_window_s, on the fast path) at or above which
                               the deployment counts as preempting.

Scale-down also requires that nothing queues (fewer than one waiting request in the
whole deployment, on average) and that nothing was preempted. Scaling 1 → 0 (only when
`min_replicas` is 0) needs the deployment to be idle: no KV in use, nothing running or
waiting; Ray Serve's cold-start path brings the first replica back on a request.

Every call returns a `Decision` whose reason is one of `REASONS` (the fast path reuses
kv_high / queueing / preemption; `Decision.path` says fast or slow); `log_line()` renders
it with its inputs on one line.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, Sequence

from kvtide.config import AutoscalingSettings

Reason = Literal["kv_high", "queueing", "preemption", "kv_low", "bounds", "hold"]
REASONS: tuple[Reason, ...] = ("kv_high", "queueing", "preemption", "kv_low", "bounds", "hold")
UpPath = Literal["fast", "slow"]  # which up-path fired or is pending

# Fewest samples a trend line is fitted to: two points always fit a line exactly, so one
# noisy sample would decide the slope; a third is the first that can disagree.
MIN_TREND_SAMPLES = 3
# Bounds the ring Ray carries in policy_state between ticks (a 10 s window at a 0.2 s push).
MAX_TREND_SAMPLES = 64

# One ring sample: (sampled at, s; fleet KV in use, replicas' worth; fleet waiting requests).
TrendSample = tuple[float, float, float]


@dataclass(frozen=True)
class ReplicaStats:
    """One running replica's engine signals: window means, plus the latest samples for the fast path.

    The boundary between what an engine measures and what the law decides on: the Ray
    adapter builds these from `record_autoscaling_stats` reports, tests build them by hand.
    """

    kv_usage_perc: float  # mean over the look-back window
    num_waiting: float = 0.0  # mean over the look-back window
    num_running: float = 0.0  # mean over the look-back window
    num_preemptions: float = 0.0  # within the look-back window (delta), not cumulative
    kv_usage_now_perc: float | None = None  # the latest sample; None: the window mean stands in
    num_waiting_now: float | None = None  # the latest sample; None: the window mean stands in
    num_preemptions_recent: float = 0.0  # within the last trend_window_s (delta)


@dataclass(frozen=True)
class LawContext:
    """Everything the law observes at one tick; `now_s` is a parameter, not a clock read."""

    replicas: tuple[ReplicaStats, ...]  # running replicas that reported stats
    num_running_replicas: int
    num_starting_replicas: int
    min_replicas: int
    max_replicas: int
    now_s: float
    # When the newest `*_now` sample was taken (Ray ticks ~10x per stats push, so most
    # ticks bring no new sample); None: now_s, i.e. every tick is a fresh sample.
    sampled_at_s: float | None = None

    @property
    def num_current_replicas(self) -> int:
        """Replicas already decided (running + starting): what a hold returns."""
        return self.num_running_replicas + self.num_starting_replicas


@dataclass(frozen=True)
class LawState:
    """What the law carries between ticks: its timers, the last scale-up, the recent samples."""

    pressure_since_s: float | None = None  # slow path: window-mean pressure held since
    slack_since_s: float | None = None
    fast_since_s: float | None = None  # fast path: a trend/symptom trigger held since
    last_scale_up_s: float | None = None  # for scale_down_cooldown_s; survives timer restarts
    last_starting_s: float | None = None  # last tick a replica was starting: newer capacity than older symptoms
    samples: tuple[TrendSample, ...] = ()  # oldest first, within trend_window_s of the newest

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["samples"] = [list(sample) for sample in self.samples]  # plain data for Ray
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "LawState":
        data = data or {}  # keys missing (a state from an older kvtide) read as "nothing yet"
        return cls(
            pressure_since_s=data.get("pressure_since_s"),
            slack_since_s=data.get("slack_since_s"),
            fast_since_s=data.get("fast_since_s"),
            last_scale_up_s=data.get("last_scale_up_s"),
            last_starting_s=data.get("last_starting_s"),
            samples=tuple((float(t), float(kv), float(w)) for t, kv, w in data.get("samples") or ()),
        )


@dataclass(frozen=True)
class Trend:
    """A least-squares line through (t_s, value) points, read at the newest point's time."""

    level: float  # the line's value at the newest point (less noisy than the point itself)
    slope_per_s: float

    def ahead(self, horizon_s: float) -> float:
        """The line's value horizon_s after the newest point."""
        return self.level + self.slope_per_s * horizon_s


def fit_trend(points: Sequence[tuple[float, float]]) -> Trend | None:
    """Ordinary least-squares line through (t_s, value) points; None without two distinct times."""
    if len(points) < 2:
        return None
    n = len(points)
    t_mean = sum(t for t, _ in points) / n
    v_mean = sum(v for _, v in points) / n
    sxx = sum((t - t_mean) ** 2 for t, _ in points)
    if sxx <= 0.0:
        return None
    slope = sum((t - t_mean) * (v - v_mean) for t, v in points) / sxx
    t_newest = max(t for t, _ in points)
    return Trend(level=v_mean + slope * (t_newest - t_mean), slope_per_s=slope)


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
    path: UpPath | None = None  # the up-path that fired (or whose timer is pending)
    kv_now_perc: float | None = None  # latest KV samples' mean
    kv_trend_perc: float | None = None  # fast path: where KV heads trend_horizon_s ahead, over running + starting
    cooldown_left_s: float = 0.0  # > 0: a scale-down would be blocked this much longer

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
            f"kv_one_fewer={perc(self.projected_kv_one_fewer_perc)} kv_now={perc(self.kv_now_perc)} "
            f"kv_trend={perc(self.kv_trend_perc)} waiting={self.num_waiting:.1f} "
            f"running_reqs={self.num_running_requests:.1f} preemptions={self.num_preemptions:.1f}"
        )
        if self.path is not None:
            line += f" path={self.path}"
        if self.pending is not None:
            line += f" pending={self.pending} for_s={self.pending_for_s:.1f}"
        if self.cooldown_left_s > 0:
            line += f" cooldown_left_s={self.cooldown_left_s:.1f}"
        return line


@dataclass(frozen=True)
class _Observation:
    mean_kv_usage_perc: float | None
    load_kv: float  # replicas' worth of KV in use, window mean
    num_waiting: float
    num_running_requests: float
    num_preemptions: float
    kv_now_perc: float | None = None  # latest samples
    load_kv_now: float = 0.0
    num_waiting_now: float = 0.0
    num_preemptions_recent: float = 0.0


def _clamp_perc(value: float) -> float:
    return min(max(value, 0.0), 1.0)


def _observe(context: LawContext) -> _Observation:
    stats = context.replicas
    if not stats:
        return _Observation(None, 0.0, 0.0, 0.0, 0.0)
    mean_kv = sum(_clamp_perc(s.kv_usage_perc) for s in stats) / len(stats)
    kv_now = sum(_clamp_perc(s.kv_usage_perc if s.kv_usage_now_perc is None else s.kv_usage_now_perc)
                 for s in stats) / len(stats)
    # Running replicas that have not reported yet are assumed to look like those that did.
    return _Observation(
        mean_kv_usage_perc=mean_kv,
        load_kv=mean_kv * context.num_running_replicas,
        num_waiting=sum(s.num_waiting for s in stats),
        num_running_requests=sum(s.num_running for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        kv_now_perc=kv_now,
        load_kv_now=kv_now * context.num_running_replicas,
        num_waiting_now=sum(s.num_waiting if s.num_waiting_now is None else s.num_waiting_now for s in stats),
        num_preemptions_recent=sum(s.num_preemptions_recent for s in stats),
    )


def _record(samples: tuple[TrendSample, ...], context: LawContext, obs: _Observation,
            tunables: AutoscalingSettings) -> tuple[TrendSample, ...]:
    """The ring after this tick: the newest sample appended once, samples older than the window dropped."""
    if obs.mean_kv_usage_perc is None:
        return samples
    sampled_at_s = context.now_s if context.sampled_at_s is None else context.sampled_at_s
    if samples and sampled_at_s <= samples[-1][0]:
        if sampled_at_s >= samples[-1][0] - tunables.trend_window_s:
            return samples  # no newer sample since the last tick
        samples = ()  # time went back by more than a window (a clock step): start over
    kept = [s for s in samples if s[0] > sampled_at_s - tunables.trend_window_s]
    kept.append((sampled_at_s, obs.load_kv_now, obs.num_waiting_now))
    return tuple(kept[-MAX_TREND_SAMPLES:])


def _fresh(samples: tuple[TrendSample, ...], context: LawContext, tunables: AutoscalingSettings
           ) -> tuple[TrendSample, ...]:
    """The ring if it is recent enough to fit a trend to, else nothing (stalled reports decide nothing)."""
    if len(samples) < MIN_TREND_SAMPLES or samples[-1][0] < context.now_s - tunables.trend_window_s:
        return ()
    return samples


def _kv_trend_perc(context: LawContext, samples: tuple[TrendSample, ...],
                   tunables: AutoscalingSettings) -> float | None:
    """Where the KV load is heading trend_horizon_s ahead, over running + starting replicas; None without a rise.

    The slope is the least-squares line's through the ring; the start is the lower of the
    line's level and the latest sample. The result is capped at the running replicas'
    whole KV (per-replica usage cannot pass 1.0; demand beyond it shows up as waiting and
    preemptions instead), so a steep climb that has already saturated does not keep
    asking for more once a replica is starting.
    """
    trend = fit_trend([(t, load) for t, load, _ in samples])
    if trend is None or trend.slope_per_s <= 0.0 or context.num_current_replicas == 0:
        return None
    # Extend the lower of the fitted level and the latest sample: a spike that has already
    # passed leaves the line's level high for a while, but not the latest sample.
    start = min(trend.level, samples[-1][1])
    ahead = min(start + trend.slope_per_s * tunables.trend_horizon_s, float(context.num_running_replicas))
    return ahead / context.num_current_replicas


def _fast_pressure(context: LawContext, obs: _Observation, samples: tuple[TrendSample, ...],
                   tunables: AutoscalingSettings, kv_trend_perc: float | None,
                   last_starting_s: float | None) -> Reason | None:
    """The most severe fast trigger on the latest samples, or None. Severity: preemption > queueing > kv_high."""
    if not tunables.fast_upscale or obs.mean_kv_usage_perc is None:
        return None
    num_running = max(context.num_running_replicas, 1)
    # Symptoms only running replicas report pause while capacity is on the way (as on the slow path).
    if context.num_starting_replicas == 0:
        # The recent preemption count covers trend_window_s: it speaks for the fleet as it
        # is only once the last replica to start has been serving for that long.
        settled = last_starting_s is None or context.now_s - last_starting_s >= tunables.trend_window_s
        if settled and obs.num_preemptions_recent / num_running >= tunables.upscale_preemptions_per_replica:
            return "preemption"
        waiting = fit_trend([(t, w) for t, _, w in samples])
        if (obs.num_waiting_now / num_running >= tunables.upscale_waiting_per_replica
                and waiting is not None and waiting.slope_per_s > 0.0):
            return "queueing"  # a queue that is growing, not one that is draining
    if kv_trend_perc is not None and kv_trend_perc > tunables.upper_kv_perc:
        return "kv_high"
    return None


def _pressure(context: LawContext, obs: _Observation, tunables: AutoscalingSettings,
              projected_kv: float | None) -> Reason | None:
    """Slow path: the most severe window-mean reason to add replicas, or None (preemption > queueing > kv_high)."""
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


def _queued_kv(obs: _Observation) -> float:
    """The KV the fleet would hold if its waiting requests ran like its running ones, in replicas' worth.

    A saturated replica's KV stops at 1.0, so KV alone cannot say how far demand is past
    capacity; the queue can. Waiting requests are assumed to need as much KV each as the
    running ones hold on average. 0 without running requests (nothing to scale from).
    """
    if obs.num_running_requests <= 0.0:
        return 0.0
    return obs.load_kv_now * (obs.num_running_requests + obs.num_waiting_now) / obs.num_running_requests


def _up_step(context: LawContext, load_kv: float, tunables: AutoscalingSettings) -> int:
    sized_for_target = math.ceil(load_kv / tunables.target_kv_perc - 1e-9)
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


def _held_since(condition: object, since_s: float | None, now_s: float) -> float | None:
    """A timer that runs only while its condition holds on every tick; a break restarts it."""
    if not condition:
        return None
    return now_s if since_s is None else since_s


def _cooldown_left_s(state: LawState, context: LawContext, tunables: AutoscalingSettings) -> float:
    if state.last_scale_up_s is None:
        return 0.0
    return max(state.last_scale_up_s + tunables.scale_down_cooldown_s - context.now_s, 0.0)


@dataclass(frozen=True)
class _Choice:
    """What one path wants this tick: an action (reason != hold) or a timer still running (pending)."""

    wanted: int
    reason: Reason = "hold"
    pending: Reason | None = None
    pending_for_s: float = 0.0
    path: UpPath | None = None


def _fast_up(context: LawContext, obs: _Observation, tunables: AutoscalingSettings, fast: Reason | None,
             fast_since_s: float | None, kv_trend_perc: float | None) -> _Choice | None:
    if fast is None or fast_since_s is None:
        return None
    n_current = context.num_current_replicas
    held_s = context.now_s - fast_since_s
    if held_s < min(tunables.fast_upscale_delay_s, tunables.upscale_delay_s):
        return _Choice(wanted=n_current, pending=fast, pending_for_s=held_s, path="fast")
    # Size for where the load is heading, not for the window mean that lags behind it.
    # ... and for what waits: the queue is demand a saturated replica's KV cannot show.
    heading_kv = max(obs.load_kv, obs.load_kv_now, (kv_trend_perc or 0.0) * n_current, _queued_kv(obs))
    return _Choice(wanted=n_current + _up_step(context, heading_kv, tunables), reason=fast, path="fast")


def _slow_up(context: LawContext, obs: _Observation, tunables: AutoscalingSettings, pressure: Reason | None,
             pressure_since_s: float | None) -> _Choice | None:
    if pressure is None or pressure_since_s is None:
        return None
    n_current = context.num_current_replicas
    held_s = context.now_s - pressure_since_s
    if held_s < tunables.upscale_delay_s:
        return _Choice(wanted=n_current, pending=pressure, pending_for_s=held_s, path="slow")
    return _Choice(wanted=n_current + _up_step(context, max(obs.load_kv, _queued_kv(obs)), tunables),
                   reason=pressure, path="slow")


def _down(context: LawContext, obs: _Observation, tunables: AutoscalingSettings, slack_since_s: float | None,
          cooldown_left_s: float) -> _Choice | None:
    if slack_since_s is None:
        return None
    n_current = context.num_current_replicas
    held_s = context.now_s - slack_since_s
    # The cooldown holds a scale-down back without restarting its timer: slack that
    # outlasts both acts the moment the cooldown ends.
    if held_s < tunables.downscale_delay_s or cooldown_left_s > 0.0:
        return _Choice(wanted=n_current, pending="kv_low", pending_for_s=held_s)
    return _Choice(wanted=n_current - _down_step(context, obs, tunables), reason="kv_low")


def decide(context: LawContext, state: LawState, tunables: AutoscalingSettings) -> tuple[int, LawState, Decision]:
    """One tick of the law: desired replica count (running + starting), next state, decision."""
    # observe
    obs = _observe(context)
    samples = _record(state.samples, context, obs, tunables)
    n_current = context.num_current_replicas
    projected_kv = obs.load_kv / n_current if n_current and obs.mean_kv_usage_perc is not None else None
    one_fewer_kv = (obs.load_kv / (n_current - 1)
                    if n_current > 1 and obs.mean_kv_usage_perc is not None else None)
    fresh = _fresh(samples, context, tunables)
    kv_trend_perc = _kv_trend_perc(context, fresh, tunables) if fresh else None

    # decide: each timer runs only while its condition holds on every tick
    last_starting_s = context.now_s if context.num_starting_replicas else state.last_starting_s
    fast = _fast_pressure(context, obs, fresh, tunables, kv_trend_perc, last_starting_s) if fresh else None
    pressure = _pressure(context, obs, tunables, projected_kv)
    slack = pressure is None and fast is None and _slack(context, obs, tunables, one_fewer_kv)
    fast_since = _held_since(fast, state.fast_since_s, context.now_s)
    pressure_since = _held_since(pressure, state.pressure_since_s, context.now_s)
    slack_since = _held_since(slack, state.slack_since_s, context.now_s)
    cooldown_left_s = _cooldown_left_s(state, context, tunables)

    ups = [_fast_up(context, obs, tunables, fast, fast_since, kv_trend_perc),
           _slow_up(context, obs, tunables, pressure, pressure_since)]
    choice = (next((c for c in ups if c is not None and c.reason != "hold"), None)
              or next((c for c in ups if c is not None), None)
              or _down(context, obs, tunables, slack_since, cooldown_left_s)
              or _Choice(wanted=n_current))
    reason, wanted, pending, pending_for_s, path = (choice.reason, choice.wanted, choice.pending,
                                                    choice.pending_for_s, choice.path)

    # apply: bounds win over everything, and say so
    desired = min(max(wanted, context.min_replicas), context.max_replicas)
    if desired != wanted:
        reason = "bounds"
    memory = LawState(last_scale_up_s=state.last_scale_up_s, last_starting_s=last_starting_s, samples=samples)
    next_state = replace(memory, pressure_since_s=pressure_since, slack_since_s=slack_since, fast_since_s=fast_since)
    if desired != n_current:
        # Every action restarts all timers (the next one waits a full delay); a scale-up
        # also starts the scale-down cooldown. The samples stay: load is load.
        next_state = replace(memory, last_scale_up_s=context.now_s) if desired > n_current else memory
        pending, pending_for_s = None, 0.0
    elif reason != "hold":
        # Wanted to act but the bounds said no: restart the timers so this is logged once per delay.
        next_state = memory
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
        path=path if reason != "bounds" else None,
        kv_now_perc=obs.kv_now_perc,
        kv_trend_perc=kv_trend_perc,
        cooldown_left_s=cooldown_left_s if slack else 0.0,
    )
    return desired, next_state, decision


__all__ = [
    "MAX_TREND_SAMPLES", "MIN_TREND_SAMPLES", "REASONS", "Decision", "LawContext", "LawState", "Reason",
    "ReplicaStats", "Trend", "TrendSample", "UpPath", "decide", "fit_trend",
]
