"""The smallest fleet that meets a TTFT objective on a trace, found by simulating candidate sizes.

TTFT p90 does not fall strictly with the replica count (a routing policy can crowd a hot prefix
onto one replica whatever the fleet's size), so the search does not bisect blindly: it doubles
from `min_replicas` until a size meets the objective, bisects between the last failing and the
first meeting size, and reports every size it simulated, so a reader sees the curve it read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from kvtide.simulator.fleet import FleetSim, SimConfig, TraceItem, sim_requests
from kvtide.simulator.report import summarize


@dataclass(frozen=True)
class PlanResult:
    policy: str
    slo_ttft_p90_s: float
    replicas: int | None  # None: no size up to max_replicas met the objective
    tried: dict[int, dict[str, Any]]  # size → its summary


def simulate_size(config: SimConfig, policy: str, items: Sequence[TraceItem], block_tokens: int,
                  slo_ttft_s: float) -> dict[str, Any]:
    requests = sim_requests(items, block_tokens, config.limits.block_size)
    return summarize(FleetSim(config, policy).run(requests), slo_ttft_s)


def smallest_fleet(config: SimConfig, policy: str, items: Sequence[TraceItem], block_tokens: int,
                   slo_ttft_p90_s: float, *, min_replicas: int = 1, max_replicas: int = 512,
                   run: Callable[..., dict[str, Any]] = simulate_size) -> PlanResult:
    """The smallest replica count in [min_replicas, max_replicas] whose simulated TTFT p90 is within the objective
    (every request finished), searched as the module docstring says."""
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= min_replicas ({min_replicas}) <= max_replicas ({max_replicas})")
    tried: dict[int, dict[str, Any]] = {}

    def meets(n: int) -> bool:
        if n not in tried:
            tried[n] = run(replace(config, num_replicas=n), policy, items, block_tokens, slo_ttft_p90_s)
        summary = tried[n]
        p90 = summary["ttft_s"]["p90"]
        return summary["num_finished"] == summary["num_requests"] and p90 is not None and p90 <= slo_ttft_p90_s

    failing, n = min_replicas - 1, min_replicas
    while not meets(n):
        failing = n
        if n == max_replicas:
            return PlanResult(policy, slo_ttft_p90_s, None, dict(sorted(tried.items())))
        n = min(2 * n, max_replicas)
    meeting = n
    while meeting - failing > 1:
        middle = (failing + meeting) // 2
        if meets(middle):
            meeting = middle
        else:
            failing = middle
    return PlanResult(policy, slo_ttft_p90_s, meeting, dict(sorted(tried.items())))
