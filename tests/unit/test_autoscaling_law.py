"""The KV control law, driven tick by tick with hand-built contexts and an injected clock."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvtide.autoscaling.control_law import (
    MAX_TREND_SAMPLES,
    REASONS,
    LawContext,
    LawState,
    ReplicaStats,
    decide,
    fit_trend,
)
from kvtide.config import AutoscalingSettings

# target 0.7, upper 0.85, lower 0.6, up 30 s, down 300 s, max_step 2; fast path: hold 2 s,
# trend over 10 s projected 4 s ahead; no scale-down within 60 s of a scale-up.
TUNABLES = AutoscalingSettings()


def ctx(kv: float, *, n: int, starting: int = 0, now_s: float = 0.0, min_r: int = 1, max_r: int = 10,
        waiting: float = 0.0, preemptions: float = 0.0, running: float = 4.0) -> LawContext:
    """n running replicas that all report the same signals."""
    stats = tuple(ReplicaStats(kv_usage_perc=kv, num_waiting=waiting, num_running=running,
                               num_preemptions=preemptions) for _ in range(n))
    return LawContext(replicas=stats, num_running_replicas=n, num_starting_replicas=starting,
                      min_replicas=min_r, max_replicas=max_r, now_s=now_s)


def run(ticks, tunables: AutoscalingSettings = TUNABLES, state: LawState | None = None):
    """Feed contexts in order, carrying the state; return (desired, reason) per tick."""
    state = state or LawState()
    out = []
    for context in ticks:
        desired, state, decision = decide(context, state, tunables)
        out.append((desired, decision.reason))
    return out


def test_hold_at_target():
    """Utilization at the target never moves the replica count."""
    results = run(ctx(0.7, n=3, now_s=t) for t in range(0, 1200, 10))
    assert set(results) == {(3, "hold")}


@pytest.mark.parametrize("now_s, expected", [
    (0.0, (2, "hold")), (10.0, (2, "hold")), (29.9, (2, "hold")), (30.0, (3, "kv_high")),
])
def test_step_load_scales_up_after_delay_not_before(now_s, expected):
    """KV above the upper threshold adds replicas once it has held for upscale_delay_s, not a tick earlier."""
    ticks = [ctx(0.95, n=2, now_s=t) for t in (0.0, 10.0, 20.0, 29.9, 30.0) if t <= now_s]
    assert run(ticks)[-1] == expected


def test_scale_up_sizes_for_target():
    """A scale-up aims at target_kv_perc: load 1.9 replicas' worth / 0.7 → 3 replicas."""
    _, _, decision = decide(ctx(0.95, n=2, now_s=30.0), LawState(pressure_since_s=0.0), TUNABLES)
    assert decision.desired_replicas == 3 and decision.reason == "kv_high"


DRAIN = [  # (now_s, mean kv over 4 replicas, expected desired, expected reason)
    (0, 0.60, 4, "hold"),     # one fewer: 0.80
    (100, 0.50, 4, "hold"),   # mean below lower already, but one fewer would be 0.667: no
    (200, 0.45, 4, "hold"),   # one fewer: 0.600, not below
    (300, 0.44, 4, "hold"),   # one fewer: 0.587 < 0.6: the downscale timer starts here
    (400, 0.42, 4, "hold"),
    (599, 0.40, 4, "hold"),
    (600, 0.40, 3, "kv_low"),  # held for 300 s: remove one (two fewer would be 0.8)
]


def test_slow_drain_scales_down_only_on_projected_util():
    """Scale-down waits until the load over n-1 replicas stays below lower_kv_perc for downscale_delay_s."""
    results = run(ctx(kv, n=4, now_s=t) for t, kv, _, _ in DRAIN)
    assert results == [(d, r) for _, _, d, r in DRAIN]


def test_projection_break_restarts_downscale_timer():
    """One tick whose projection is not below lower restarts the downscale delay."""
    ticks = [ctx(0.3, n=4, now_s=0), ctx(0.3, n=4, now_s=250), ctx(0.5, n=4, now_s=260),
             ctx(0.3, n=4, now_s=300), ctx(0.3, n=4, now_s=559), ctx(0.3, n=4, now_s=600)]
    assert [d for d, _ in run(ticks)] == [4, 4, 4, 4, 4, 3]  # two fewer would be 0.6, not below


@pytest.mark.parametrize("tick_s", [10.0, 1.0])  # 1 s: the fast path's ring fills with the flips too
@pytest.mark.parametrize("high, low", [(0.95, 0.3), (0.95, 0.7), (0.3, 0.7)])
def test_alternating_signal_does_not_flap(high, low, tick_s):
    """A signal flipping every tick never holds a condition for its delay, so the count never moves."""
    ticks = [ctx(high if i % 2 else low, n=3, now_s=tick_s * i) for i in range(200)]
    assert {d for d, _ in run(ticks)} == {3}


def test_scale_down_lands_inside_the_band():
    """After a kv_low removal the new utilization is below lower_kv_perc, so it cannot trigger kv_high."""
    desired, state, decision = decide(ctx(0.44, n=4, now_s=300), LawState(slack_since_s=0.0), TUNABLES)
    assert desired == 3
    after = decide(ctx(0.44 * 4 / 3, n=3, now_s=301), state, TUNABLES)[2]
    assert after.reason == "hold" and after.pending is None


@pytest.mark.parametrize("context, state, expected", [
    (ctx(0.95, n=3, max_r=3, now_s=30), LawState(pressure_since_s=0.0), (3, "bounds")),
    (ctx(0.1, n=2, min_r=2, now_s=300), LawState(slack_since_s=0.0), (2, "bounds")),
    (ctx(0.7, n=1, min_r=2), LawState(), (2, "bounds")),
    (ctx(0.7, n=5, max_r=4), LawState(), (4, "bounds")),
    (ctx(1.0, n=6, max_r=7, now_s=30), LawState(pressure_since_s=0.0), (7, "bounds")),
])
def test_bounds(context, state, expected):
    """The result never leaves [min_replicas, max_replicas], and a clamp is reported as 'bounds'."""
    desired, _, decision = decide(context, state, TUNABLES)
    assert (desired, decision.reason) == expected


def test_starting_replicas_are_capacity_on_the_way():
    """Load spread over running + starting replicas below upper: no second scale-up, desired keeps the starting one."""
    ticks = [ctx(0.95, n=2, starting=1, now_s=t) for t in range(0, 120, 10)]  # 1.9 / 3 = 0.633
    assert set(run(ticks)) == {(3, "hold")}


def test_starting_replicas_pause_queue_signals_and_scale_down():
    """While a replica starts, queueing does not add more and slack does not remove any."""
    queued = [ctx(0.7, n=2, starting=1, waiting=10, now_s=t) for t in range(0, 120, 10)]
    idle = [ctx(0.05, n=4, starting=1, now_s=t) for t in range(0, 900, 100)]
    assert set(run(queued)) == {(3, "hold")}
    assert set(run(idle)) == {(5, "hold")}


def test_kv_high_still_counts_with_starting_replicas():
    """If even running + starting replicas would sit above upper, the law adds more on top of them."""
    # 6 replicas' worth of KV over 6 + 1 = 0.857 > 0.85; sized for 0.7 that is 9 replicas.
    desired, _, decision = decide(ctx(1.0, n=6, starting=1, now_s=30), LawState(pressure_since_s=0.0), TUNABLES)
    assert (desired, decision.reason) == (9, "kv_high")
    # 5 over 5 + 1 = 0.833: the starting replica is enough.
    desired, _, decision = decide(ctx(1.0, n=5, starting=1, now_s=30), LawState(pressure_since_s=0.0), TUNABLES)
    assert (desired, decision.reason) == (6, "hold")


def test_preemptions_force_scale_up():
    """Preemptions at target KV utilization still add a replica after the upscale delay, labelled 'preemption'."""
    ticks = [ctx(0.7, n=3, preemptions=3, now_s=t) for t in (0, 15, 30)]
    assert run(ticks) == [(3, "hold"), (3, "hold"), (4, "preemption")]


def test_persistent_queueing_scales_up():
    """Requests waiting above upscale_waiting_per_replica for the delay add replicas, labelled 'queueing'."""
    ticks = [ctx(0.6, n=2, waiting=5, now_s=t) for t in (0, 30)]
    # Sized for the queue too: 8 running + 10 waiting at KV 1.2 replicas' worth -> 2.7 -> ceil(2.7/0.7) = 4.
    assert run(ticks) == [(2, "hold"), (4, "queueing")]


def test_scale_up_is_sized_for_the_queue_a_full_kv_cache_cannot_show():
    """One saturated replica (KV 1.0) with 30 waiting behind 6 running asks for max_step more, not one."""
    saturated = ctx(1.0, n=1, waiting=30, running=6, max_r=8)
    one_more = ctx(1.0, n=1, waiting=0, running=6, max_r=8)
    wide = TUNABLES.model_copy(update={"max_step": 4})
    assert run([replace(saturated, now_s=t) for t in (0, 30)], wide) == [(1, "hold"), (5, "queueing")]
    assert run([replace(one_more, now_s=t) for t in (0, 30)], wide) == [(1, "hold"), (2, "kv_high")]


def test_waiting_or_preemptions_block_scale_down():
    """Low KV with requests still queueing or being preempted is not slack."""
    # Both below their scale-up thresholds, so neither is pressure either.
    queued = [ctx(0.1, n=4, waiting=1.5, now_s=t) for t in range(0, 900, 100)]
    preempted = [ctx(0.1, n=4, preemptions=0.5, now_s=t) for t in range(0, 900, 100)]
    assert set(run(queued)) == set(run(preempted)) == {(4, "hold")}


@pytest.mark.parametrize("context, tunables, expected", [
    (ctx(1.0, n=6, now_s=30), TUNABLES, 8),                        # wants 9 (6 / 0.7), step capped at 2
    (ctx(1.0, n=4, now_s=30), AutoscalingSettings(max_step=1), 5),
    (ctx(0.05, n=10, now_s=300), TUNABLES, 8),                     # could drop to 1, step capped at 2
])
def test_max_step_respected(context, tunables, expected):
    """One decision never adds or removes more than max_step replicas."""
    state = LawState(pressure_since_s=0.0, slack_since_s=0.0)
    assert decide(context, state, tunables)[0] == expected


def test_action_restarts_timers():
    """After a scale action the next one waits a full delay again."""
    desired, state, _ = decide(ctx(0.95, n=2, now_s=30), LawState(pressure_since_s=0.0), TUNABLES)
    # The state is no longer all-empty (changed with issue #13): it remembers the scale-up
    # for the scale-down cooldown and keeps the trend samples; every timer is cleared.
    assert desired == 3
    assert (state.pressure_since_s, state.fast_since_s, state.slack_since_s) == (None, None, None)
    assert state.last_scale_up_s == 30
    # The new replica is up, load still high (2.7 / 0.7 → 4): the timer starts over at t=40.
    results = run([ctx(0.9, n=3, now_s=t) for t in (40, 69, 70)], state=state)
    assert results == [(3, "hold"), (3, "hold"), (4, "kv_high")]


def test_idle_single_replica_scales_to_zero_only_when_allowed():
    """1 -> 0 needs min_replicas 0 and a fully idle deployment for the downscale delay."""
    idle = [ctx(0.0, n=1, min_r=0, running=0, now_s=t) for t in (0, 300)]
    busy = [ctx(0.01, n=1, min_r=0, running=1, now_s=t) for t in (0, 300)]
    assert run(idle)[-1] == (0, "kv_low")
    assert run(busy)[-1] == (1, "hold")


def test_no_reports_holds():
    """Running replicas that have not reported yet give no signal: hold."""
    context = LawContext(replicas=(), num_running_replicas=2, num_starting_replicas=0, min_replicas=1,
                         max_replicas=4, now_s=1000.0)
    desired, state, decision = decide(context, LawState(), TUNABLES)
    assert (desired, decision.reason, state) == (2, "hold", LawState())


def test_state_round_trips_through_dict():
    """LawState survives to_dict/from_dict as plain data (Ray keeps it as a dict between ticks), samples included."""
    state = LawState(pressure_since_s=12.5, slack_since_s=None, fast_since_s=3.0, last_scale_up_s=1.0,
                     last_starting_s=2.0, samples=((1.0, 0.5, 0.0), (2.0, 0.6, 1.0)))
    data = state.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert LawState.from_dict(data) == state
    assert LawState.from_dict(None) == LawState()


def test_state_from_an_older_kvtide_reads_as_nothing_yet():
    """A policy_state written before the fast path (timers only) loads with no samples and no cooldown."""
    state = LawState.from_dict({"pressure_since_s": 5.0, "slack_since_s": None})
    assert state == LawState(pressure_since_s=5.0)


def test_log_line_is_one_line_with_inputs():
    """The decision renders on one line with its reason, counts and signals."""
    _, _, decision = decide(ctx(0.95, n=2, starting=0, waiting=0.5, now_s=10), LawState(pressure_since_s=0.0),
                            TUNABLES)
    line = decision.log_line()
    assert "\n" not in line
    for part in ("reason=hold", "desired=2", "running=2", "starting=0", "kv_mean=0.950", "waiting=1.0",
                 "pending=kv_high", "for_s=10.0", "bounds=[1,10]"):
        assert part in line
    assert decision.reason in REASONS


def test_tunables_reject_inverted_thresholds():
    """Thresholds out of order are refused when the tunables are built."""
    with pytest.raises(ValueError, match="lower_kv_perc"):
        AutoscalingSettings(lower_kv_perc=0.9)


# --- the fast path: trend estimator, sample ring, triggers, cooldown (issue #13) -------------

MEAN_ONLY = AutoscalingSettings(fast_upscale=False, scale_down_cooldown_s=0.0)  # the law before issue #13


def fast_ctx(kv_now: float, *, n: int = 2, now_s: float, kv_mean: float = 0.5, starting: int = 0,
             waiting_now: float = 0.0, preemptions_recent: float = 0.0, sampled_at_s: float | None = None,
             max_r: int = 10) -> LawContext:
    """n replicas whose latest samples say kv_now (the window mean lags at kv_mean)."""
    stats = tuple(ReplicaStats(kv_usage_perc=kv_mean, num_running=4.0, kv_usage_now_perc=kv_now,
                               num_waiting_now=waiting_now, num_preemptions_recent=preemptions_recent)
                  for _ in range(n))
    return LawContext(replicas=stats, num_running_replicas=n, num_starting_replicas=starting, min_replicas=1,
                      max_replicas=max_r, now_s=now_s, sampled_at_s=sampled_at_s)


def run_decisions(ticks, tunables: AutoscalingSettings = TUNABLES, state: LawState | None = None):
    """Like run(), but returns the decisions and the last state."""
    state = state or LawState()
    decisions = []
    for context in ticks:
        _, state, decision = decide(context, state, tunables)
        decisions.append(decision)
    return decisions, state


@pytest.mark.parametrize("points, level, slope_per_s", [
    ([(0, 0.5), (1, 0.5), (2, 0.5)], 0.5, 0.0),                  # flat
    ([(0, 0.1), (2, 0.3), (4, 0.5)], 0.5, 0.1),                  # a line: read at the newest point
    ([(4, 0.5), (0, 0.1), (2, 0.3)], 0.5, 0.1),                  # order does not matter
    ([(0, 0.9), (1, 0.8), (2, 0.7)], 0.7, -0.1),                 # falling
    ([(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)], 0.8, 0.2),        # zig-zag: a mild rise, level between the extremes
    ([(t, 0.3) for t in range(9)] + [(9, 0.98)], 0.5349, 0.0371),  # a step at the end: the line lags it
])
def test_fit_trend_is_least_squares(points, level, slope_per_s):
    """fit_trend is the ordinary least-squares line, its level read at the newest point's time."""
    trend = fit_trend(points)
    assert trend.level == pytest.approx(level, abs=1e-4)
    assert trend.slope_per_s == pytest.approx(slope_per_s, abs=1e-4)
    assert trend.ahead(2.0) == pytest.approx(trend.level + 2.0 * trend.slope_per_s)


@pytest.mark.parametrize("points", [[], [(1.0, 0.5)], [(2.0, 0.1), (2.0, 0.9)]])
def test_fit_trend_needs_two_distinct_times(points):
    """No line through fewer than two distinct sample times."""
    assert fit_trend(points) is None


def test_ring_records_each_sample_once():
    """Ray ticks ~10x per stats push: a sample is recorded once, keyed on sampled_at_s, not per tick."""
    ticks = [fast_ctx(0.5, now_s=0.1 * i, sampled_at_s=2.0 * (i // 20)) for i in range(60)]  # 6 s, 3 samples
    _, state = run_decisions(ticks)
    assert [t for t, _, _ in state.samples] == [0.0, 2.0, 4.0]
    assert state.samples[-1] == (4.0, 1.0, 0.0)  # (t, load in replicas' worth: 0.5 x 2, waiting)


def test_ring_keeps_only_the_trend_window_and_a_bounded_count():
    """Samples older than trend_window_s are dropped, and the ring never passes MAX_TREND_SAMPLES."""
    _, state = run_decisions([fast_ctx(0.5, now_s=float(t)) for t in range(30)])
    assert [t for t, _, _ in state.samples] == [float(t) for t in range(20, 30)]
    _, state = run_decisions([fast_ctx(0.5, now_s=0.01 * i) for i in range(1000)])
    assert len(state.samples) == MAX_TREND_SAMPLES


def test_no_reports_record_no_sample():
    """A tick with no replica stats adds nothing to the ring."""
    context = LawContext(replicas=(), num_running_replicas=2, num_starting_replicas=0, min_replicas=1,
                         max_replicas=4, now_s=5.0)
    assert decide(context, LawState(), TUNABLES)[1].samples == ()


KV_CLIMB = [0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.84, 0.84, 0.84]  # per second; the window mean still says 0.5


def test_kv_climb_scales_up_after_the_fast_delay():
    """A KV climb projected across upper_kv_perc adds replicas fast_upscale_delay_s after the projection crosses."""
    decisions, _ = run_decisions(fast_ctx(kv, now_s=float(t)) for t, kv in enumerate(KV_CLIMB))
    crossed_s = next(t for t, d in enumerate(decisions) if d.pending == "kv_high")
    acted = [(t, d) for t, d in enumerate(decisions) if d.reason != "hold"]
    assert crossed_s == 4  # at 0.7, rising 0.1/s: 4 s ahead is past 0.85
    assert [(t, d.reason, d.path, d.desired_replicas) for t, d in acted] == [(6, "kv_high", "fast", 3)]


def test_fast_path_off_is_the_mean_only_law():
    """With fast_upscale false the same climb waits for the slow path (the window mean never crosses here)."""
    decisions, _ = run_decisions((fast_ctx(kv, now_s=float(t)) for t, kv in enumerate(KV_CLIMB)), MEAN_ONLY)
    assert {d.reason for d in decisions} == {"hold"}


def test_flat_high_kv_is_left_to_the_slow_path():
    """KV above upper but not rising has no trend: the slow path adds the replica after upscale_delay_s."""
    decisions, _ = run_decisions(fast_ctx(0.9, kv_mean=0.9, now_s=float(t)) for t in range(31))
    acted = [(t, d.reason, d.path) for t, d in enumerate(decisions) if d.reason != "hold"]
    assert acted == [(30, "kv_high", "slow")]


@pytest.mark.parametrize("waiting_now, expected", [
    ([1, 2, 3, 4, 5, 6], [(4, "queueing", "fast")]),  # third sample at t=2: 3 waiting and growing; held 2 s
    ([9, 8, 7, 6, 5, 4], []),                         # as long as it drains, the queue is not a fast trigger
])
def test_only_a_growing_queue_is_a_fast_trigger(waiting_now, expected):
    """Waiting requests at or above upscale_waiting_per_replica trigger the fast path only while the queue grows."""
    ticks = [fast_ctx(0.6, n=1, waiting_now=w, now_s=float(t)) for t, w in enumerate(waiting_now)]
    decisions, _ = run_decisions(ticks)
    assert [(t, d.reason, d.path) for t, d in enumerate(decisions) if d.reason != "hold"][:1] == expected


def test_recent_preemptions_scale_up_fast():
    """Preemptions within trend_window_s (>= 1 per replica) add a replica after the fast delay, labelled preemption."""
    decisions, _ = run_decisions(fast_ctx(0.7, preemptions_recent=1, now_s=float(t)) for t in range(5))
    assert [(t, d.reason, d.path) for t, d in enumerate(decisions) if d.reason != "hold"] == [
        (4, "preemption", "fast")]  # the ring has its third sample at t=2; held 2 s


def test_preemptions_from_before_new_capacity_do_not_count():
    """Recent preemptions count only once the last replica to start has served for trend_window_s."""
    starting = [fast_ctx(0.7, n=2, starting=1, preemptions_recent=2, now_s=float(t)) for t in range(5)]
    serving = [fast_ctx(0.7, n=3, preemptions_recent=3, now_s=float(t)) for t in range(5, 20)]
    decisions, _ = run_decisions(starting + serving)
    acted = [(t, d.reason) for t, d in enumerate(decisions) if d.reason != "hold"]
    assert acted[0] == (16, "preemption")  # last starting tick t=4; counts from t=14; held 2 s


def test_stalled_samples_decide_nothing():
    """With no new sample for trend_window_s the ring is stale: the fast timer stops instead of firing on old news."""
    patient = AutoscalingSettings(fast_upscale_delay_s=15.0)  # so the timer would still be running at t=12
    rising = [fast_ctx(kv, now_s=float(t), sampled_at_s=float(t)) for t, kv in enumerate([0.5, 0.6, 0.7])]
    stalled = [fast_ctx(0.7, now_s=float(t), sampled_at_s=2.0) for t in range(3, 20)]
    decisions, _ = run_decisions(rising + stalled, patient)
    assert [d.pending for d in decisions[2:13]] == ["kv_high"] * 11  # fresh while the newest sample is <= 10 s old
    assert {(d.reason, d.pending, d.kv_trend_perc) for d in decisions[13:]} == {("hold", None, None)}


def test_saturated_climb_with_a_replica_starting_asks_for_no_more():
    """The trend is capped at the running replicas' whole KV: a saturated climb with capacity on the way holds."""
    climb = [fast_ctx(kv, n=1, now_s=float(t)) for t, kv in enumerate([0.3, 0.5, 0.7, 0.9, 1.0])]
    decisions, state = run_decisions(climb)
    assert decisions[-1].reason == "kv_high" and decisions[-1].desired_replicas == 2
    after, _ = run_decisions([fast_ctx(1.0, n=1, starting=1, now_s=float(t)) for t in range(5, 15)], state=state)
    assert {(d.reason, d.desired_replicas) for d in after} == {("hold", 2)}
    assert max(d.kv_trend_perc or 0.0 for d in after) <= 0.5


def test_fast_delay_never_exceeds_upscale_delay():
    """With upscale_delay_s below fast_upscale_delay_s the fast path waits only upscale_delay_s."""
    tunables = AutoscalingSettings(upscale_delay_s=1.0, fast_upscale_delay_s=2.0)
    decisions, _ = run_decisions((fast_ctx(kv, now_s=float(t)) for t, kv in enumerate(KV_CLIMB)), tunables)
    assert [t for t, d in enumerate(decisions) if d.reason != "hold"][0] == 5  # crossed at t=4, held 1 s


SHORT_DELAYS = AutoscalingSettings(look_back_s=4, upscale_delay_s=4, downscale_delay_s=20)  # benchmarks/autoscale.py


def test_no_scale_down_within_the_cooldown():
    """Slack held past downscale_delay_s still waits until scale_down_cooldown_s after the last scale-up, then acts."""
    state = LawState(slack_since_s=0.0, last_scale_up_s=0.0)
    decisions, _ = run_decisions([ctx(0.3, n=4, now_s=t) for t in (30.0, 59.0, 60.0)], SHORT_DELAYS, state)
    assert [(d.reason, d.desired_replicas) for d in decisions] == [("hold", 4), ("hold", 4), ("kv_low", 3)]
    assert (decisions[0].pending, decisions[0].cooldown_left_s) == ("kv_low", 30.0)
    assert "cooldown_left_s=30.0" in decisions[0].log_line()


def test_cooldown_never_blocks_a_scale_up():
    """A scale-up right after another is not held back by the scale-down cooldown."""
    state = LawState(pressure_since_s=0.0, last_scale_up_s=29.0)
    desired, state, decision = decide(ctx(0.95, n=2, now_s=30), state, TUNABLES)
    assert (desired, decision.reason, state.last_scale_up_s) == (3, "kv_high", 30)


# --- recorded-shape traces, replayed tick by tick in closed loop ------------------------------

TRACES = Path(__file__).resolve().parents[1] / "data" / "autoscaling_traces"
FULL_PER_REPLICA = 0.95  # a replica this full shows the trace's waiting and preemptions


@dataclass(frozen=True)
class Action:
    t_s: float
    from_replicas: int
    to_replicas: int
    reason: str
    path: str | None


@dataclass(frozen=True)
class Replay:
    actions: list[Action]
    replica_seconds: float  # running + starting, summed over ticks

    def ups(self) -> list[Action]:
        return [a for a in self.actions if a.to_replicas > a.from_replicas]

    def downs(self) -> list[Action]:
        return [a for a in self.actions if a.to_replicas < a.from_replicas]


def load_trace(name: str) -> tuple[dict, list[dict]]:
    data = json.loads((TRACES / f"{name}.json").read_text())
    return data["meta"], [dict(zip(data["columns"], row)) for row in data["rows"]]


def _fleet_tick(row: dict, n_running: int) -> tuple[float, float, float]:
    """The trace's load on the replay's fleet: (KV per replica, waiting per replica, preemptions per replica)."""
    load_kv = row["kv_usage_perc"] * row["num_running_replicas"]
    full = load_kv / n_running >= FULL_PER_REPLICA
    carried = full or n_running <= row["num_running_replicas"]
    return (min(load_kv / n_running, 1.0),
            row["num_waiting"] / n_running if carried else 0.0,
            row["num_preemptions"] / n_running if carried else 0.0)


def replay(rows: list[dict], tunables: AutoscalingSettings, *, sample_every_s: float = 1.0,
           sample_offset_s: float = 0.0, startup_s: float = 30.0, max_replicas: int = 8) -> Replay:
    """Feed a trace to the law tick by tick, in closed loop: the replicas it adds change what it sees next.

    The trace is the load: KV in use = kv_usage_perc x the trace's fleet, in replicas' worth,
    spread over the replay's running replicas (at most 1.0 each). Added replicas start for
    startup_s, then run; removed ones go at once. Waiting and preemptions carry over only
    while the replay's fleet is no larger than the trace's or as full. Like the Ray adapter:
    look-back means for the slow path; for the fast path the sample taken every
    sample_every_s (the stats push; sample_offset_s shifts its phase) with its time, and
    preemptions over trend_window_s.
    """
    n_running, ready_at_s = rows[0]["num_running_replicas"], []
    state, history, actions, replica_seconds = LawState(), [], [], 0.0
    for row in rows:
        t_s = row["t_s"]
        n_running += sum(1 for r in ready_at_s if r <= t_s)
        ready_at_s = [r for r in ready_at_s if r > t_s]
        history.append((t_s, *_fleet_tick(row, n_running)))
        window = [h for h in history if h[0] > t_s - tunables.look_back_s]
        sampled_at_s = max(math.floor((t_s - sample_offset_s) / sample_every_s) * sample_every_s + sample_offset_s,
                           rows[0]["t_s"])
        latest = next(h for h in reversed(history) if h[0] <= sampled_at_s)
        stats = ReplicaStats(
            kv_usage_perc=sum(h[1] for h in window) / len(window),
            num_waiting=sum(h[2] for h in window) / len(window),
            num_running=4.0,
            num_preemptions=sum(h[3] for h in window),
            kv_usage_now_perc=latest[1],
            num_waiting_now=latest[2],
            num_preemptions_recent=sum(h[3] for h in history if h[0] > t_s - tunables.trend_window_s),
        )
        context = LawContext(replicas=(stats,) * n_running, num_running_replicas=n_running,
                             num_starting_replicas=len(ready_at_s), min_replicas=1, max_replicas=max_replicas,
                             now_s=t_s, sampled_at_s=sampled_at_s)
        desired, state, decision = decide(context, state, tunables)
        current = context.num_current_replicas
        if desired != current:
            actions.append(Action(t_s, current, desired, decision.reason, decision.path))
        if desired > current:
            ready_at_s += [t_s + startup_s] * (desired - current)
        n_running -= max(current - desired, 0)
        replica_seconds += (n_running + len(ready_at_s)) * (rows[1]["t_s"] - rows[0]["t_s"])
    return Replay(actions, replica_seconds)


def look_back_mean_crosses_s(rows: list[dict], look_back_s: float, level: float) -> float:
    """When the trace's own look-back mean of KV first passes level (what the slow path compares)."""
    for i, row in enumerate(rows):
        window = [r["kv_usage_perc"] for r in rows[: i + 1] if r["t_s"] > row["t_s"] - look_back_s]
        if sum(window) / len(window) > level:
            return row["t_s"]
    raise AssertionError(f"the look-back mean never passes {level}")


@pytest.mark.parametrize("sample_every_s, sample_offset_s", [(1.0, 0.0), (2.0, 0.0), (2.0, 1.0)])
def test_step_trace_scales_up_within_5_s(sample_every_s, sample_offset_s):
    """Step trace: one scale-up, on the fast path, at most 5 s after the step, with 1 s and 2 s stats pushes."""
    meta, rows = load_trace("step")
    ups = replay(rows, TUNABLES, sample_every_s=sample_every_s, sample_offset_s=sample_offset_s).ups()
    # 2 -> 4 (max_step) where the decision sees the first waiting requests; 2 -> 3 where it comes before them.
    assert [(u.path, u.from_replicas) for u in ups] == [("fast", 2)] and ups[0].to_replicas in (3, 4)
    assert ups[0].t_s - meta["saturation_start_s"] <= 5.0


def test_step_trace_costs_only_the_head_start():
    """Step trace: the mean-only law's scale actions; extra replica-seconds = head start x replicas added, no more."""
    _, rows = load_trace("step")
    fast, mean_only = replay(rows, TUNABLES), replay(rows, MEAN_ONLY)
    assert [(a.from_replicas, a.to_replicas) for a in fast.actions] == [
        (a.from_replicas, a.to_replicas) for a in mean_only.actions]
    assert [d.t_s for d in fast.downs()] == [d.t_s for d in mean_only.downs()]
    head_start_s = mean_only.ups()[0].t_s - fast.ups()[0].t_s
    added = fast.ups()[0].to_replicas - fast.ups()[0].from_replicas
    assert head_start_s >= 20.0
    assert fast.replica_seconds - mean_only.replica_seconds <= head_start_s * added


def test_noisy_steady_trace_does_not_flap():
    """Noisy steady trace (KV 0.55..0.8, no trend): at most one action, never a scale-down within 60 s of a scale-up."""
    _, rows = load_trace("noisy_steady")
    run = replay(rows, TUNABLES)
    assert len(run.actions) <= 1
    assert not [(u, d) for u in run.ups() for d in run.downs() if 0 <= d.t_s - u.t_s < 60.0]


def test_slow_ramp_trace_scales_up_before_the_mean_reaches_095():
    """Slow ramp (+1 %/s): the scale-up comes before the look-back mean of KV passes 0.95, unlike the mean-only law."""
    _, rows = load_trace("slow_ramp")
    crosses_s = look_back_mean_crosses_s(rows, TUNABLES.look_back_s, 0.95)
    assert replay(rows, TUNABLES).ups()[0].t_s < crosses_s
    assert replay(rows, MEAN_ONLY).ups()[0].t_s >= crosses_s  # what the fast path fixes


@pytest.mark.parametrize("tunables", [TUNABLES, SHORT_DELAYS], ids=["defaults", "short_delays"])
def test_burst_trace_scales_up_at_most_once_and_never_down_in_cooldown(tunables):
    """Burst trace (3 s to KV 0.95): at most one scale-up, and no scale-down within scale_down_cooldown_s of it."""
    _, rows = load_trace("burst")
    run = replay(rows, tunables)
    assert len(run.ups()) <= 1
    assert not [(u, d) for u in run.ups() for d in run.downs() if d.t_s - u.t_s < tunables.scale_down_cooldown_s]


def test_burst_trace_on_a_hair_trigger_waits_out_the_cooldown():
    """A burst that does add a replica (no fast delay, short delays): its removal waits for the cooldown, not less."""
    _, rows = load_trace("burst")
    hair_trigger = SHORT_DELAYS.model_copy(update={"fast_upscale_delay_s": 0.0})
    with_cooldown = replay(rows, hair_trigger)
    without = replay(rows, hair_trigger.model_copy(update={"scale_down_cooldown_s": 0.0}))
    assert len(with_cooldown.ups()) == 1 and len(without.ups()) == 1
    assert with_cooldown.downs()[0].t_s - with_cooldown.ups()[0].t_s >= 60.0
    assert without.downs()[0].t_s - without.ups()[0].t_s < 60.0  # so the cooldown is what held it


def test_committed_traces_match_their_generator():
    """The committed traces are exactly what make_traces.py generates (seeded), so they can be regenerated."""
    spec = importlib.util.spec_from_file_location("make_traces", TRACES / "make_traces.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0
