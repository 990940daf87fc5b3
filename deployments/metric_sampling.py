"""Rate-capped sampling of per-token histogram observations (pure: no Ray, time injected).

Why: inter-token latency is observed once per output token, by vLLM's stat logger (every
running request, every engine step) and by kvtide's frontend (every streamed chunk). Through
`ray.util.metrics` each observation costs microseconds of the replica's event loop, and every
one is also work for Ray's metrics agent: under many concurrent streams that is a sizeable
share of the replica process (benchmarks/results/h200-fastpath), a tax on every token the
user waits for.

Inter-token latency is read only as quantiles (`histogram_quantile` over `_bucket` rates;
no panel or alert uses its `_count`), and an evenly spaced subset of a stream has the same
quantiles. So each per-token histogram keeps at most `max_per_s` observations a second:

    window     1 s of observations; at its end, rate = observations seen in it
    stride     ceil(rate of the last window / max_per_s), at least 1
    keep       each observation with probability 1/stride (random, not every stride-th:
               vLLM visits the running requests in the same order every step, so a fixed
               stride would keep the same requests' tokens step after step)

Below the cap every observation is kept (stride 1), so light load and tests see them all;
above it the kept share follows the load within one window. `_count` then counts kept
observations, not tokens: docs/metrics.md says so.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Protocol

# 200 kept observations a second per histogram and replica: a 15 s scrape interval still
# sees 3,000 samples, plenty for p99, at ~1 ms of CPU a second.
MAX_OBSERVATIONS_PER_S = 200.0
WINDOW_S = 1.0


class RateCappedSampler:
    """Decides, per observation, whether to keep it so that at most ~max_per_s are kept."""

    def __init__(self, max_per_s: float = MAX_OBSERVATIONS_PER_S, window_s: float = WINDOW_S,
                 rng: random.Random | None = None):
        if max_per_s <= 0 or window_s <= 0:
            raise ValueError("max_per_s and window_s must be positive")
        self.rng = rng or random.Random()
        self.max_per_window = max_per_s * window_s
        self.window_s = window_s
        self.window_start_s: float | None = None
        self.seen_in_window = 0
        self.stride = 1

    def keep(self, now_s: float) -> bool:
        """True if the observation made at `now_s` should be recorded."""
        if self.window_start_s is None or now_s - self.window_start_s >= self.window_s:
            # An idle gap of several windows means the last rate was ~0: start at stride 1.
            idle = self.window_start_s is None or now_s - self.window_start_s >= 2 * self.window_s
            rate = 0 if idle else self.seen_in_window
            self.stride = max(1, math.ceil(rate / self.max_per_window))
            self.window_start_s, self.seen_in_window = now_s, 0
        self.seen_in_window += 1
        return self.stride == 1 or self.rng.random() * self.stride < 1.0


class _Observer(Protocol):
    def observe(self, value: float) -> None: ...


class SampledObserver:
    """An `observe(value)` target that forwards only what its sampler keeps."""

    def __init__(self, target: _Observer, clock_s: Callable[[], float],
                 sampler: RateCappedSampler | None = None):
        self.target = target
        self.clock_s = clock_s
        self.sampler = sampler or RateCappedSampler()

    def observe(self, value: float) -> None:
        if self.sampler.keep(self.clock_s()):
            self.target.observe(value)
