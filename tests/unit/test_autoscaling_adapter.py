"""The Ray Serve adapter, fed a real `AutoscalingContext` built by hand (no Ray cluster)."""

from __future__ import annotations

import logging
import warnings

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve._private.constants import SERVE_AUTOSCALING_DECISION_COUNTERS_KEY
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from kvtide.config import AutoscalingSettings
from kvtide.autoscaling.control_law import LawContext, LawState, ReplicaStats, decide
from kvtide.autoscaling.ray_policy import (
    KV_USAGE_KEY,
    NUM_PREEMPTIONS_TOTAL_KEY,
    NUM_RUNNING_KEY,
    NUM_WAITING_KEY,
    POLICY_STATE_KEY,
    RECENT_EXCLUSIVE_HIT_TOKENS_KEY,
    RECENT_HIT_TOKENS_KEY,
    ROLES_STATE_KEY,
    KvPolicy,
    autoscaling_config,
    law_context,
    worth_line,
)

from kvtide.autoscaling.standby import Roles  # noqa: E402

DEPLOYMENT = DeploymentID(name="Engine", app_name="kvtide")
NOW_S = 1_000_000.0

# kvtide sets Ray's metrics_interval_s (the push period Ray 2.60 really uses); Ray marks the
# field deprecated and says so on every AutoscalingConfig built here. Expected, not news.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The `metrics_interval_s` field in AutoscalingConfig is deprecated:DeprecationWarning")


def replica(i: int) -> ReplicaID:
    return ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT)


def ray_config(**overrides) -> AutoscalingConfig:
    """Ray's own config object, built from what kvtide passes as the deployment option."""
    return AutoscalingConfig(**autoscaling_config(AutoscalingSettings(**overrides), 1, 8))


def _series(points: list[tuple[float, float]] | None, now_s: float) -> list[TimeStampedValue]:
    """(age_s, value) points as Ray's raw series."""
    return [TimeStampedValue(timestamp=now_s - age, value=v) for age, v in (points or [])]


def context(kv: list[float], *, target: int | None = None, waiting: float = 0.0, now_s: float = NOW_S,
            preemption_series: list[tuple[float, float]] | None = None, policy_state: dict | None = None,
            config: AutoscalingConfig | None = None, unreported: int = 0,
            kv_series: list[list[tuple[float, float]]] | None = None,
            waiting_series: list[list[tuple[float, float]]] | None = None) -> AutoscalingContext:
    """A context as the controller builds it: one replica per kv value, plus `unreported` silent ones.

    kv_series / waiting_series: per reporting replica, its raw samples as (age_s, value).
    """
    ids = [replica(i) for i in range(len(kv) + unreported)]
    reported = ids[: len(kv)]
    aggregated = {
        KV_USAGE_KEY: dict(zip(reported, kv)),
        NUM_WAITING_KEY: {r: waiting for r in reported},
        NUM_RUNNING_KEY: {r: 3.0 for r in reported},
        NUM_PREEMPTIONS_TOTAL_KEY: {r: 0.0 for r in reported},
    }
    series = _series(preemption_series, now_s)
    raw = {NUM_PREEMPTIONS_TOTAL_KEY: {r: series for r in reported}}
    if kv_series is not None:
        raw[KV_USAGE_KEY] = {r: _series(points, now_s) for r, points in zip(reported, kv_series)}
    if waiting_series is not None:
        raw[NUM_WAITING_KEY] = {r: _series(points, now_s) for r, points in zip(reported, waiting_series)}
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
        current_num_replicas=len(ids), target_num_replicas=len(ids) if target is None else target,
        running_replicas=ids, total_num_requests=lambda: 3.0 * len(ids), total_queued_requests=0.0,
        aggregated_metrics=lambda: aggregated, raw_metrics=lambda: raw,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state=dict(policy_state or {}), last_scale_up_time=None, last_scale_down_time=None,
        current_time=now_s, config=config or ray_config(),
    )


def policy_from_ray(config: AutoscalingConfig):
    """The policy object exactly as the controller gets it: cloudpickled, then instantiated with policy_kwargs."""
    return _resolve_policy_callable(config.policy)


def test_controller_builds_kv_policy_with_tunables():
    """Ray resolves the configured import path to a KvPolicy instance carrying kvtide's tunables."""
    config = ray_config(upscale_delay_s=12.0, max_step=3)
    policy = policy_from_ray(config)
    assert type(policy).__name__ == "KvPolicy"
    assert policy.tunables.upscale_delay_s == 12.0 and policy.tunables.max_step == 3


def test_policy_returns_the_laws_decision():
    """The adapter returns exactly what the law decides on the equivalent LawContext."""
    settings = AutoscalingSettings()
    config = ray_config()
    policy = policy_from_ray(config)
    state = {POLICY_STATE_KEY: LawState(pressure_since_s=NOW_S - 40).to_dict()}
    desired, new_state = policy(context([0.95, 0.9], policy_state=state, config=config))
    expected = decide(
        LawContext(replicas=(ReplicaStats(0.95, 0.0, 3.0, 0.0), ReplicaStats(0.9, 0.0, 3.0, 0.0)),
                   num_running_replicas=2, num_starting_replicas=0, min_replicas=1, max_replicas=8, now_s=NOW_S),
        LawState(pressure_since_s=NOW_S - 40), settings)
    assert (desired, new_state[POLICY_STATE_KEY]) == (expected[0], expected[1].to_dict())
    assert desired == 3
    # Cache-aware scale-down is on by default: the two running replicas are the active ones.
    assert new_state[ROLES_STATE_KEY]["active"] == ["r0", "r1"]


def test_policy_state_round_trips_between_ticks():
    """The timer started on one tick comes back through policy_state and fires after the delay."""
    policy = KvPolicy(**AutoscalingSettings().model_dump(mode="json"))
    desired, state = policy(context([0.95, 0.95], now_s=NOW_S))
    assert desired == 2 and state[POLICY_STATE_KEY]["pressure_since_s"] == NOW_S
    desired, state = policy(context([0.95, 0.95], now_s=NOW_S + 10, policy_state=state))
    assert desired == 2 and state[POLICY_STATE_KEY]["pressure_since_s"] == NOW_S
    desired, state = policy(context([0.95, 0.95], now_s=NOW_S + 30, policy_state=state))
    # After the action the timers are cleared; the state keeps the scale-up time for the
    # scale-down cooldown (and the trend samples), so it is no longer all-empty (issue #13).
    law_state = LawState.from_dict(state[POLICY_STATE_KEY])
    assert desired == 3 and (law_state.pressure_since_s, law_state.fast_since_s) == (None, None)
    assert law_state.last_scale_up_s == NOW_S + 30


def test_ray_wrapper_passes_the_decision_through_and_keeps_state():
    """Under Ray's own wrapper (factors, delays set to 0 by kvtide) the law's answer is final and its state kept."""
    config = ray_config(scale_down_chooser="ray")  # Serve's counts, no roles (those: the tests below)
    wrapped = _apply_autoscaling_config(policy_from_ray(config))
    state = {POLICY_STATE_KEY: LawState(pressure_since_s=NOW_S - 30).to_dict()}
    desired, new_state = wrapped(context([0.95, 0.95], policy_state=state, config=config))
    assert desired == 3 and LawState.from_dict(new_state[POLICY_STATE_KEY]).pressure_since_s is None
    assert new_state[POLICY_STATE_KEY]["last_scale_up_s"] == NOW_S
    # Holding: Ray adds its delay keys, the law's timer survives next to them.
    desired, new_state = wrapped(context([0.95, 0.95], now_s=NOW_S + 1, policy_state=new_state, config=config))
    assert desired == 2 and new_state[POLICY_STATE_KEY]["pressure_since_s"] == NOW_S + 1
    assert SERVE_AUTOSCALING_DECISION_COUNTERS_KEY in new_state


def test_context_translation_counts_starting_and_skips_silent_replicas():
    """target > running gives starting replicas; replicas with no report add no stats but count as running."""
    law = law_context(context([0.5, 0.7], target=5, unreported=1), look_back_s=30.0)
    assert (law.num_running_replicas, law.num_starting_replicas) == (3, 2)
    assert [s.kv_usage_perc for s in law.replicas] == [0.5, 0.7]
    assert (law.min_replicas, law.max_replicas, law.now_s) == (1, 8, NOW_S)


def test_scale_down_in_flight_is_not_undone():
    """With target below running (Ray is stopping replicas) a hold returns the target, not the running count."""
    policy = KvPolicy(scale_down_chooser="ray")
    desired, _ = policy(context([0.5, 0.5, 0.5], target=2))
    assert desired == 2


@pytest.mark.parametrize("series, expected", [
    ([], 0.0),
    ([(5.0, 7.0)], 0.0),                               # one sample: no delta yet
    ([(25.0, 7.0), (15.0, 9.0), (5.0, 12.0)], 5.0),
    ([(60.0, 0.0), (20.0, 7.0), (5.0, 8.0)], 1.0),     # the 60 s old sample is outside the window
])
def test_preemptions_are_counter_deltas_over_the_window(series, expected):
    """The cumulative preemption counter becomes preemptions within the look-back window."""
    law = law_context(context([0.7], preemption_series=series), look_back_s=30.0)
    assert law.replicas[0].num_preemptions == expected


def test_preemption_counter_drives_scale_up_through_ray():
    """A climbing preemption counter at target KV makes the policy add a replica, labelled preemption."""
    policy = KvPolicy()
    state = {POLICY_STATE_KEY: LawState(pressure_since_s=NOW_S - 30).to_dict()}
    desired, _ = policy(context([0.7, 0.7], policy_state=state, preemption_series=[(20.0, 0.0), (1.0, 4.0)]))
    assert desired == 3


def test_policy_logs_one_line_per_change(caplog):
    """Actions and timer changes log at INFO as a single line; a steady hold logs at DEBUG."""
    policy = KvPolicy()
    with caplog.at_level(logging.DEBUG, logger="ray.serve.kvtide.autoscaler"):
        policy(context([0.7, 0.7]))
        policy(context([0.7, 0.7], now_s=NOW_S + 1))
    levels = [r.levelno for r in caplog.records if r.name == "ray.serve.kvtide.autoscaler"]
    assert levels == [logging.INFO, logging.DEBUG]
    assert all("\n" not in r.getMessage() and "reason=hold" in r.getMessage() for r in caplog.records)


def test_with_roles_the_law_sees_active_replicas_only():
    """Standbys are out of the KV average and the counts; the active replicas still missing count as starting."""
    roles = Roles(("r0", "r1"), {"r2": 0.0}, (), 3)
    law = law_context(context([0.8, 0.6, 0.0]), look_back_s=30.0, roles=roles)
    assert [s.kv_usage_perc for s in law.replicas] == [0.8, 0.6]
    assert (law.num_running_replicas, law.num_starting_replicas) == (2, 1)


def test_policy_with_a_standby_wakes_it_for_a_scale_up_and_keeps_the_pool():
    """Pressure on two active replicas wakes the standby (no cold start), and Serve's target adds a new standby."""
    policy = KvPolicy(standby_replicas=1)
    roles = Roles(("r0", "r1"), {"r2": NOW_S - 100}, (), 2)
    state = {POLICY_STATE_KEY: LawState(pressure_since_s=NOW_S - 40).to_dict(), ROLES_STATE_KEY: roles.to_dict()}
    desired, new_state = policy(context([0.95, 0.9, 0.0], policy_state=state))
    after = Roles.from_dict(new_state[ROLES_STATE_KEY])
    assert after.active == ("r0", "r1", "r2") and dict(after.standby) == {} and desired == 4


def test_policy_scale_down_sets_the_least_worth_replica_aside():
    """Slack on three active replicas: the one whose cache served fewest recent hits (none exclusive) goes to standby, not Ray's pick."""
    policy = KvPolicy(standby_timeout_s=60.0)
    roles = Roles(("r0", "r1", "r2"), {}, (), 3)
    state = {POLICY_STATE_KEY: LawState(slack_since_s=NOW_S - 400).to_dict(), ROLES_STATE_KEY: roles.to_dict()}
    ctx = context([0.35, 0.35, 0.35], policy_state=state)
    ctx.raw_metrics[RECENT_HIT_TOKENS_KEY] = {replica(i): _series([(1.0, v)], NOW_S) for i, v in enumerate([900, 5, 300])}
    desired, new_state = policy(ctx)
    after = Roles.from_dict(new_state[ROLES_STATE_KEY])
    assert set(after.active) == {"r0", "r2"} and set(after.standby) == {"r1"}
    assert desired == 3  # r1 stays (asleep) until standby_timeout_s, then retires


def test_policy_scale_down_weighs_the_hits_only_a_replica_held():
    """r0 served the most hits, all on prefixes others held too; r1 fewer, only it held them: r0 goes to standby."""
    policy = KvPolicy(standby_timeout_s=60.0)
    roles = Roles(("r0", "r1", "r2"), {}, (), 3)
    state = {POLICY_STATE_KEY: LawState(slack_since_s=NOW_S - 400).to_dict(), ROLES_STATE_KEY: roles.to_dict()}
    ctx = context([0.35, 0.35, 0.35], policy_state=state)
    ctx.raw_metrics[RECENT_HIT_TOKENS_KEY] = {replica(i): _series([(1.0, v)], NOW_S)
                                             for i, v in enumerate([5000, 1000, 3000])}
    ctx.raw_metrics[RECENT_EXCLUSIVE_HIT_TOKENS_KEY] = {replica(i): _series([(1.0, v)], NOW_S)
                                                       for i, v in enumerate([0, 1000, 3000])}
    _, new_state = policy(ctx)
    assert set(Roles.from_dict(new_state[ROLES_STATE_KEY]).standby) == {"r0"}


def test_context_translation_reads_the_newest_raw_samples():
    """Fast-path inputs: each replica's newest raw KV / waiting sample, the newest KV time, recent preemptions."""
    ctx = context([0.5, 0.6], kv_series=[[(6.0, 0.4), (2.0, 0.55)], [(5.0, 0.5), (3.0, 0.7)]],
                  waiting_series=[[(2.0, 4.0)], [(3.0, 1.0)]],
                  preemption_series=[(20.0, 1.0), (8.0, 3.0), (1.0, 6.0)])
    law = law_context(ctx, look_back_s=30.0, recent_s=10.0)
    assert [s.kv_usage_now_perc for s in law.replicas] == [0.55, 0.7]
    assert [s.kv_usage_perc for s in law.replicas] == [0.5, 0.6]      # the slow path keeps the window means
    assert [s.num_waiting_now for s in law.replicas] == [4.0, 1.0]
    assert law.sampled_at_s == NOW_S - 2.0
    assert [(s.num_preemptions, s.num_preemptions_recent) for s in law.replicas] == [(5.0, 3.0)] * 2


def test_context_without_raw_samples_leaves_the_window_means_standing_in():
    """No raw KV series: no latest sample and no sample time, so the law falls back to the means and now_s."""
    law = law_context(context([0.5]), look_back_s=30.0, recent_s=10.0)
    assert (law.replicas[0].kv_usage_now_perc, law.replicas[0].num_waiting_now, law.sampled_at_s) == (None, None, None)


def test_kv_climb_scales_up_within_seconds_through_ray():
    """Through Ray's wrapper (0.5 s ticks, 2 s pushes) a KV climb adds a replica <= 5 s after crossing upper."""
    config = ray_config()
    wrapped = _apply_autoscaling_config(policy_from_ray(config))
    step_s = NOW_S + 20.0
    kv_at = lambda t: min(0.3 + 0.17 * max(t - step_s, 0.0), 0.98)  # noqa: E731  0.3 -> 0.98 in 4 s
    crossed_s = step_s + (0.85 - 0.3) / 0.17
    state: dict = {}
    for i in range(80):  # 40 s of ticks
        now_s = NOW_S + 0.5 * i
        pushed = [now_s - (now_s % 2.0) - 2.0 * k for k in range(15)]  # samples every 2 s, newest first
        points = [(now_s - t, kv_at(t)) for t in reversed(pushed)]
        desired, state = wrapped(context([0.3, 0.3], now_s=now_s, policy_state=state, config=config,
                                         kv_series=[points, points]))
        if desired > 2:
            break
    # The worst phase: a push lands just as the climb starts, so 6 s after it, 2.8 s after the crossing.
    assert desired == 3 and 0.0 <= now_s - crossed_s <= 5.0, now_s - crossed_s


def test_the_worth_line_lists_the_active_replicas_least_valuable_first():
    """The scale-down's log names each active replica's worth in the order it ranks them (no report: 0)."""
    assert worth_line(["r0", "r1", "r2"], {"r0": 5300.0, "r2": 120.5}) == "r1 0, r2 120, r0 5,300"
