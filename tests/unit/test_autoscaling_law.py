"""The KV control law, driven tick by tick with hand-built contexts and an injected clock."""

from __future__ import annotations

import pytest

from kvtide.autoscaling.control_law import REASONS, LawContext, LawState, ReplicaStats, decide
from kvtide.config import AutoscalingSettings

TUNABLES = AutoscalingSettings()  # target 0.7, upper 0.85, lower 0.6, up 30 s, down 300 s, max_step 2


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


@pytest.mark.parametrize("high, low", [(0.95, 0.3), (0.95, 0.7), (0.3, 0.7)])
def test_alternating_signal_does_not_flap(high, low):
    """A signal flipping every tick never holds a condition for its delay, so the count never moves."""
    ticks = [ctx(high if i % 2 else low, n=3, now_s=10.0 * i) for i in range(200)]
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
    """Requests waiting above upscale_waiting_per_replica for the delay add a replica, labelled 'queueing'."""
    ticks = [ctx(0.6, n=2, waiting=5, now_s=t) for t in (0, 30)]
    assert run(ticks) == [(2, "hold"), (3, "queueing")]


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
    assert desired == 3 and state == LawState()
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
    """LawState survives to_dict/from_dict (Ray keeps it as a plain dict between ticks)."""
    state = LawState(pressure_since_s=12.5, slack_since_s=None)
    assert LawState.from_dict(state.to_dict()) == state
    assert LawState.from_dict(None) == LawState()


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
