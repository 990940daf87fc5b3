"""Polling and metric-reading helpers shared by the integration tests."""

from __future__ import annotations

import time
from typing import Callable

import httpx


def wait_for(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last value: {last!r}")


def metric_values(metrics_url: str, name: str, **labels: str) -> list[float]:
    """Values of every sample of `name` (exact sample name) matching `labels` in one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=30).text
    values = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                values.append(sample.value)
    return values


def metric_sum(metrics_url: str, name: str, **labels: str) -> float:
    return sum(metric_values(metrics_url, name, **labels))
