"""The `autoscaling:` config section, the Serve `autoscaling_config` it becomes, and the replica stats dict."""

from __future__ import annotations

import json
import warnings

import pytest
from pydantic import ValidationError
from ray.serve.config import AutoscalingConfig

from kvtide.config import AutoscalingSettings, WarmStartSettings
from kvtide.autoscaling.ray_policy import KV_POLICY_PATH, autoscaling_config
from kvtide.autoscaling.replica_stats import METRIC_KEYS, RecentTokens, replica_autoscaling_stats

# kvtide sets Ray's metrics_interval_s (the push period Ray 2.60 really uses); Ray marks the
# field deprecated and says so on every AutoscalingConfig built here. Expected, not news.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The `metrics_interval_s` field in AutoscalingConfig is deprecated:DeprecationWarning")


def test_defaults_are_the_kv_law_with_warm_start():
    """Defaults are the kv policy, the documented thresholds (0.6 < 0.7 < 0.85) and warm start on."""
    settings = AutoscalingSettings()
    assert settings.policy == "kv"
    assert (settings.lower_kv_perc, settings.target_kv_perc, settings.upper_kv_perc) == (0.6, 0.7, 0.85)
    assert settings.warm_start == WarmStartSettings() and settings.warm_start.enabled


def test_unknown_key_is_rejected():
    """A typo in the section is an error naming the key, not a silent default."""
    with pytest.raises(ValidationError, match="upscale_delay"):
        AutoscalingSettings.model_validate({"upscale_delay": 10})
    with pytest.raises(ValidationError, match="budget"):
        AutoscalingSettings.model_validate({"warm_start": {"budget": 10}})


@pytest.mark.parametrize("data, words", [
    ({"lower_kv_perc": 0.9, "upper_kv_perc": 0.85}, ["autoscaling.lower_kv_perc=0.9", "upper_kv_perc=0.85",
                                                     "lower_kv_perc < target_kv_perc < upper_kv_perc"]),
    ({"target_kv_perc": 0.5}, ["autoscaling.target_kv_perc=0.5", "lower_kv_perc=0.6", "raise target_kv_perc"]),
    ({"target_kv_perc": 0.9}, ["autoscaling.target_kv_perc=0.9", "upper_kv_perc=0.85", "lower target_kv_perc"]),
])
def test_threshold_errors_name_field_value_and_fix(data, words):
    """Thresholds out of order fail with the field, its value and the ordering to restore."""
    with pytest.raises(ValidationError) as info:
        AutoscalingSettings.model_validate(data)
    message = str(info.value)
    for word in words:
        assert word in message


@pytest.mark.parametrize("data, field", [
    ({"max_step": 0}, "max_step"),
    ({"upscale_delay_s": -1}, "upscale_delay_s"),
    ({"policy": "rps"}, "policy"),
    ({"warm_start": {"token_budget": -5}}, "token_budget"),
])
def test_out_of_range_values_name_the_field(data, field):
    """Out-of-range values fail and the error names the field."""
    with pytest.raises(ValidationError, match=field):
        AutoscalingSettings.model_validate(data)


def test_kv_autoscaling_config_is_valid_for_ray():
    """The kv option dict validates as Ray's AutoscalingConfig, points at KvPolicy and hands the delays to the law."""
    settings = AutoscalingSettings(upscale_delay_s=45.0, look_back_s=20.0)
    option = autoscaling_config(settings, 0, 6)
    json.dumps(option)  # serveConfigV2 carries it as plain data
    config = AutoscalingConfig(**option)
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (0, 6, 1)
    assert config.policy.policy_function == KV_POLICY_PATH
    assert config.policy.policy_kwargs["upscale_delay_s"] == 45.0
    assert (config.upscale_delay_s, config.downscale_delay_s, config.look_back_period_s) == (0.0, 0.0, 20.0)
    assert config.metrics_interval_s == settings.metrics_push_interval_s == 2.0


@pytest.mark.parametrize("policy", ["kv", "queue_length"])
@pytest.mark.parametrize("look_back_s, push_s", [(30.0, 2.0), (4.0, 2.0), (2.0, 1.0), (30.0, 10.0)])
def test_short_look_back_raises_no_ray_warning(policy, look_back_s, push_s):
    """Ray warns (later: raises) when look_back_period_s <= metrics_interval_s; kvtide's configs never trigger it.

    (4, 2) is benchmarks/autoscale.py's window, (2, 1) the integration tests'. Before the
    fix the option left metrics_interval_s at Ray's 10 s, so any window <= 10 s warned.
    """
    settings = AutoscalingSettings(policy=policy, look_back_s=look_back_s, metrics_push_interval_s=push_s,
                                   upscale_delay_s=30.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = AutoscalingConfig(**autoscaling_config(settings, 1, 2))
    assert (config.look_back_period_s, config.metrics_interval_s) == (look_back_s, push_s)


@pytest.mark.parametrize("look_back_s, push_s", [(2.0, 2.0), (1.0, 2.0)])
def test_look_back_must_exceed_the_push_interval(look_back_s, push_s):
    """look_back_s <= metrics_push_interval_s is refused, naming both fields and the fix."""
    with pytest.raises(ValidationError) as info:
        AutoscalingSettings(look_back_s=look_back_s, metrics_push_interval_s=push_s)
    for word in (f"autoscaling.look_back_s={look_back_s}", f"metrics_push_interval_s={push_s}", "raise look_back_s"):
        assert word in str(info.value)


@pytest.mark.parametrize("data, field", [
    ({"fast_upscale_delay_s": -1}, "fast_upscale_delay_s"),
    ({"trend_window_s": 0}, "trend_window_s"),
    ({"trend_horizon_s": 500}, "trend_horizon_s"),
    ({"scale_down_cooldown_s": -5}, "scale_down_cooldown_s"),
])
def test_fast_path_tunables_are_bounded(data, field):
    """The fast path's tunables refuse out-of-range values, naming the field."""
    with pytest.raises(ValidationError, match=field):
        AutoscalingSettings.model_validate(data)


def test_fast_path_defaults():
    """Defaults: fast path on, 2 s hold, 10 s trend window projected 4 s ahead, 60 s scale-down cooldown."""
    settings = AutoscalingSettings()
    assert settings.fast_upscale is True
    assert (settings.fast_upscale_delay_s, settings.trend_window_s, settings.trend_horizon_s,
            settings.scale_down_cooldown_s) == (2.0, 10.0, 4.0, 60.0)


def test_queue_length_autoscaling_config_is_rays_default():
    """queue_length uses Ray's request-count policy with target_ongoing_requests and the configured delays."""
    option = autoscaling_config(AutoscalingSettings(policy="queue_length", target_ongoing_requests=24), 2, 4)
    config = AutoscalingConfig(**option)
    assert config.policy.is_default_policy_function()
    assert config.target_ongoing_requests == 24
    assert (config.upscale_delay_s, config.downscale_delay_s) == (30.0, 300.0)
    assert config.initial_replicas == 2


def test_autoscaling_config_rejects_inverted_bounds():
    """min above max is refused with both values in the message."""
    with pytest.raises(ValueError, match="min_replicas=5.*max_replicas=2"):
        autoscaling_config(AutoscalingSettings(), 5, 2)


def test_replica_stats_are_flat_floats_with_documented_keys():
    """record_autoscaling_stats returns the documented keys as floats, KV clamped to 0..1."""
    stats = replica_autoscaling_stats(kv_usage_perc=1.2, num_waiting=3, num_running=7, num_preemptions_total=11,
                                      recent_hit_tokens=640, recent_exclusive_hit_tokens=320)
    assert tuple(stats) == METRIC_KEYS
    assert all(type(v) is float for v in stats.values())
    assert list(stats.values()) == [1.0, 3.0, 7.0, 11.0, 640.0, 320.0]


@pytest.mark.parametrize("samples, now_s, expected", [
    ([], 0.0, 0.0),
    ([(0.0, 100.0), (30.0, 400.0), (59.0, 700.0)], 59.0, 600.0),  # all inside the 60 s window
    ([(0.0, 100.0), (30.0, 400.0), (90.0, 1000.0)], 90.0, 600.0),  # from the sample at the window's start
    ([(0.0, 100.0), (10.0, 900.0), (20.0, 50.0), (30.0, 80.0)], 30.0, 30.0),  # the total fell: a fresh count
])
def test_recent_tokens_is_the_totals_increase_over_the_window(samples, now_s, expected):
    """A replica's recent hit tokens: its running total's increase over the last 60 s (the cache-worth input)."""
    recent = RecentTokens(60.0)
    for at_s, total in samples:
        recent.observe(at_s, total)
    assert recent.within(now_s) == expected
