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


def with_cpu_tier(limits: EngineLimits, kv_bytes_per_token: int, size_gib: float,
                  load_gib_per_s: float | None) -> EngineLimits:
    """`limits` with a CPU tier of `size_gib` per replica loading at `load_gib_per_s` (None: the config's default)."""
    from kvtide.config.model import KvOffloadConfig

    rate = load_gib_per_s if load_gib_per_s is not None else KvOffloadConfig().load_gib_per_s
    if size_gib <= 0 or rate <= 0:
        raise ValueError(f"a CPU tier's size and load rate must be positive, got {size_gib} GiB and {rate} GiB/s")
    blocks = int(size_gib * 2**30) // (kv_bytes_per_token * limits.block_size)
    return replace(limits, cpu_tier_blocks=blocks, cpu_onload_s_per_token=kv_bytes_per_token / (rate * 2**30))


def plan_on_trace(*, kv_bytes_per_replica: int, kv_bytes_per_token: int, max_model_len: int, args: Any,
                  cpu_kv_bytes_per_replica: int = 0) -> dict[str, Any]:
    """`kvtide plan --trace`'s second step (found through the `kvtide.planners` entry points): the KV per replica
    the capacity plan found (GPU, and the CPU tier's host bytes when one is planned), the profile's step time,
    the trace as `kvtide bench trace` scales it; the smallest fleet per policy. Prompts longer than
    max_model_len minus the longest output are cut."""
    from kvtide.benchmarks.trace_replay import ScaleOptions, read_trace, scale_trace
    from kvtide.config.routing import RoutingConfig
    from kvtide.simulator.engine import EngineLimits
    from kvtide.simulator.fleet import POLICIES
    from kvtide.simulator.profile import load_profile

    if kv_bytes_per_replica <= 0:
        raise ValueError("the weights leave no KV cache on a replica: no fleet can serve the trace")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        raise ValueError(f"--policies: choose from {', '.join(POLICIES)}")
    profile = load_profile(args.profile)
    block_size = profile.block_size
    limits = EngineLimits(num_blocks=kv_bytes_per_replica // (kv_bytes_per_token * block_size), block_size=block_size,
                          max_num_batched_tokens=8192, max_num_seqs=256)
    if cpu_kv_bytes_per_replica > 0:
        limits = with_cpu_tier(limits, kv_bytes_per_token, cpu_kv_bytes_per_replica / 2**30,
                               getattr(args, "load_gib_per_s", None))
    max_output = 256
    scaled = scale_trace(read_trace(args.trace), ScaleOptions(
        block_tokens=args.block_tokens, time_scale=args.time_scale, max_input_tokens=max_model_len - max_output,
        over_long="truncate", max_output_tokens=max_output))
    items = [TraceItem(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in scaled.requests]
    config = SimConfig(num_replicas=1, limits=limits, profile=profile.step, routing=RoutingConfig())
    out: dict[str, Any] = {"profile": profile.name, "limits": limits.__dict__, "num_requests": len(items),
                           "slo_ttft_p90_ms": args.slo_ttft_p90_ms, "policies": {}}
    for policy in policies:
        plan = smallest_fleet(config, policy, items, args.block_tokens, args.slo_ttft_p90_ms / 1000.0,
                              max_replicas=args.max_replicas)
        out["policies"][policy] = {"replicas": plan.replicas,
                                   "ttft_p90_s_by_size": {n: s["ttft_s"]["p90"] for n, s in plan.tried.items()}}
    return out
