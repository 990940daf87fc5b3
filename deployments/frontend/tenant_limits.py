"""Per-tenant request rate (frontend.auth.tenant_requests_per_s): a token bucket per tenant.

Each tenant (tenancy.py) may start `rate_per_s` requests a second on this replica, and `burst`
at once; past that its request is a 429 whose Retry-After says when the next token comes.
The buckets live in the replica that admits the request, so across N serving replicas a
tenant can start up to N times the rate (HAProxy spreads one tenant's requests over them);
no replica waits on another to decide. Memory is one bucket per tenant that has sent a
request (bounded by the keys configured). Pure logic: the clock is an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated_s: float


class TenantRateLimiter:
    """`retry_after_s(tenant, now_s)`: None when the tenant may start a request now (a token is taken), else the
    whole seconds until it may."""

    def __init__(self, rate_per_s: float, burst: int):
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("a tenant rate limit needs rate_per_s > 0 and burst >= 1")
        self.rate_per_s, self.burst = rate_per_s, burst
        self._buckets: dict[str, _Bucket] = {}

    def retry_after_s(self, tenant: str, now_s: float) -> int | None:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(self.burst), now_s)
        bucket.tokens = min(float(self.burst), bucket.tokens + max(0.0, now_s - bucket.updated_s) * self.rate_per_s)
        bucket.updated_s = now_s
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - bucket.tokens) / self.rate_per_s))
