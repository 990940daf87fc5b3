"""Rate-capped sampling of per-token histogram observations."""

from __future__ import annotations

import random

import pytest

from kvtide.deployments.metric_sampling import RateCappedSampler, SampledObserver


def _kept(sampler: RateCappedSampler, per_s: int, seconds: int) -> list[int]:
    """Observations kept in each second of a steady stream of `per_s` a second."""
    counts = []
    for second in range(seconds):
        counts.append(sum(sampler.keep(second + i / per_s) for i in range(per_s)))
    return counts


def test_below_the_cap_every_observation_is_kept():
    """At or under max_per_s nothing is dropped: light load and tests see every token."""
    assert _kept(RateCappedSampler(max_per_s=100, rng=random.Random(0)), 100, 5) == [100] * 5


@pytest.mark.parametrize("per_s", [1_000, 6_400])
def test_above_the_cap_about_max_per_s_are_kept_after_one_window(per_s):
    """A stream above the cap is thinned to ~max_per_s from the second window on."""
    counts = _kept(RateCappedSampler(max_per_s=100, rng=random.Random(1)), per_s, 6)
    assert counts[0] == per_s  # the first window has no rate yet
    for kept in counts[1:]:
        assert 60 <= kept <= 140, counts


def test_after_an_idle_gap_sampling_starts_over_at_keep_all():
    """A burst, then silence for more than a window: the next observations are all kept."""
    sampler = RateCappedSampler(max_per_s=10, rng=random.Random(2))
    _kept(sampler, 1_000, 2)
    assert all(sampler.keep(10.0 + i / 10) for i in range(10))


def test_kept_values_have_the_streams_quantiles():
    """Sampling is random, not every k-th: a stream that cycles through 64 values keeps all of them."""
    sampler = RateCappedSampler(max_per_s=100, rng=random.Random(3))
    kept = []
    for step in range(6_400):
        value = step % 64  # vLLM visits 64 running requests in the same order each step
        if sampler.keep(step / 6_400 * 4):
            kept.append(value)
    assert set(kept) == set(range(64))


def test_sampled_observer_forwards_only_kept_values():
    """SampledObserver passes through what the sampler keeps, with the injected clock."""
    seen = []

    class Target:
        def observe(self, value):
            seen.append(value)

    observer = SampledObserver(Target(), clock_s=lambda: 0.0, sampler=RateCappedSampler(max_per_s=1_000))
    for value in range(5):
        observer.observe(value)
    assert seen == [0, 1, 2, 3, 4]


def test_bad_rates_are_refused():
    """A cap or window of zero is a programming error, refused at construction."""
    with pytest.raises(ValueError):
        RateCappedSampler(max_per_s=0)
