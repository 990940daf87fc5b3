"""What a simulated run reports: per policy the request metrics a benchmark run reports, from simulated time.

TTFT = first token − arrival, e2e = finish − arrival, over every request of the trace; goodput counts
the requests whose TTFT met the objective, per second of the run (first arrival to last finish); the
hit rate is the engines' own prefix-cache counters (hit tokens / queried tokens, as vLLM counts them);
the router's decision time is the real policy code's wall time per pick on this machine.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kvtide.simulator.fleet import SimResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The benchmarks' percentile (numpy's linear interpolation), None for no values."""
    from kvtide.benchmarks.report import percentile as measured_percentile

    return measured_percentile(values, q) if values else None


def summarize(result: SimResult, slo_ttft_s: float) -> dict[str, Any]:
    done = [r for r in result.requests if r.finished_s is not None and r.first_token_s is not None]
    ttfts = [r.first_token_s - r.arrival_s for r in done]
    e2es = [r.finished_s - r.arrival_s for r in done]
    start_s = min((r.arrival_s for r in result.requests), default=0.0)
    end_s = max((r.finished_s for r in done), default=start_s)
    span_s = end_s - start_s
    per_replica: dict[str, int] = {}
    for rid in result.replica_of.values():
        per_replica[rid] = per_replica.get(rid, 0) + 1
    counts = sorted(per_replica.values())
    wall_us = [s * 1e6 for s in result.decision_wall_s]
    return {
        "policy": result.policy,
        "num_requests": len(result.requests),
        "num_finished": len(done),
        "duration_s": span_s,
        "ttft_s": {q: percentile(ttfts, p) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))},
        "e2e_s": {q: percentile(e2es, p) for q, p in (("p50", 50), ("p90", 90))},
        "goodput_requests_per_s": sum(1 for t in ttfts if t <= slo_ttft_s) / span_s if span_s > 0 else None,
        # Both tiers' hits (what the engines did not prefill); the CPU tier's share apart.
        "hit_rate": ((result.prefix_hits_tokens + result.cpu_hits_tokens) / result.prefix_queries_tokens
                     if result.prefix_queries_tokens else None),
        "cpu_hit_rate": result.cpu_hits_tokens / result.prefix_queries_tokens if result.prefix_queries_tokens else None,
        "prefix_hits_tokens": result.prefix_hits_tokens,
        "cpu_hits_tokens": result.cpu_hits_tokens,
        "prefix_queries_tokens": result.prefix_queries_tokens,
        "num_preemptions": result.num_preemptions,
        "requests_per_replica": {"min": counts[0] if counts else 0, "max": counts[-1] if counts else 0},
        "decision_wall_us": {"p50": percentile(wall_us, 50), "p99": percentile(wall_us, 99)},
    }


def report_markdown(results: Mapping[str, Any]) -> str:
    def f(value: float | None, fmt: str) -> str:
        return "–" if value is None else fmt.format(value)

    lines = ["# Simulated fleet", "", f"{results['description']}", "",
             f"| policy | requests | TTFT p50 (ms) | TTFT p90 (ms) | e2e p90 (ms) | goodput (req/s, TTFT ≤ "
             f"{results['slo_ttft_s'] * 1000:g} ms) | hit rate (of it CPU tier) | preemptions | decision p50 / p99 (µs) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in results["policies"].values():
        lines.append(f"| {s['policy']} | {s['num_finished']}/{s['num_requests']} | {f(s['ttft_s']['p50'] and s['ttft_s']['p50'] * 1e3, '{:.0f}')} | "
                     f"{f(s['ttft_s']['p90'] and s['ttft_s']['p90'] * 1e3, '{:.0f}')} | "
                     f"{f(s['e2e_s']['p90'] and s['e2e_s']['p90'] * 1e3, '{:.0f}')} | "
                     f"{f(s['goodput_requests_per_s'], '{:.2f}')} | {f(s['hit_rate'], '{:.3f}')}"
                     f"{'' if not s.get('cpu_hits_tokens') else ' (' + f(s['cpu_hit_rate'], '{:.3f}') + ')'} | "
                     f"{s['num_preemptions']} | {f(s['decision_wall_us']['p50'], '{:.0f}')} / "
                     f"{f(s['decision_wall_us']['p99'], '{:.0f}')} |")
    lines += ["", f"Command: `{results['command']}`", ""]
    if "provenance" in results:
        from kvtide.benchmarks.protocol import provenance_markdown

        lines.append(provenance_markdown(results["provenance"]))
    return "\n".join(lines)
