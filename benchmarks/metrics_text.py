"""Reading a saved Prometheus text exposition: which families are present, a histogram's summary.

Used by `benchmarks.overhead` to report HAProxy's own timing of the routing consult
(`ray_serve_haproxy_ingress_router_latency_ms`, exported by Ray Serve when
RAY_SERVE_INGRESS_REQUEST_ROUTER_METRICS_ENABLED=1) and whether an engine's gauges were
exported at a given time after ready. Pure: text in, numbers out.
"""

from __future__ import annotations

import math
from typing import Any


def families_present(text: str, names: tuple[str, ...]) -> dict[str, bool]:
    """name → whether the exposition holds at least one sample of it."""
    from prometheus_client.parser import text_string_to_metric_families

    seen = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    return {name: name in seen for name in names}


def histogram_summary(text: str, name: str) -> dict[str, Any] | None:
    """count, mean and bucket-interpolated p50/p99 of histogram `name`, summed over its label sets.

    None when the histogram is absent or empty. Quantiles interpolate linearly inside the
    bucket that holds them (as Prometheus's histogram_quantile does), so they are only as
    fine as the buckets; the mean (sum / count) is exact.
    """
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == f"{name}_sum":
                total += s.value
            elif s.name == f"{name}_count":
                count += s.value
    if not count:
        return None
    bounds = sorted(buckets)
    return {"count": int(count), "mean": total / count,
            "p50": _bucket_quantile(0.5, bounds, [buckets[b] for b in bounds]),
            "p99": _bucket_quantile(0.99, bounds, [buckets[b] for b in bounds])}


def _bucket_quantile(q: float, bounds: list[float], cumulative: list[float]) -> float | None:
    rank = q * cumulative[-1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, cum in zip(bounds, cumulative):
        if cum >= rank:
            if math.isinf(bound):  # in the overflow bucket: the largest finite bound is all we know
                return lower_bound
            inside = cum - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / inside if inside else 1.0)
        lower_bound, lower_count = bound, cum
    return None
