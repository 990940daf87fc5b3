"""Several `kvtide simulate run` results side by side: one table and one figure across fleet sizes and loads.

    kvtide simulate summary benchmarks/results/sim-fleet-2026-12-06/n*-u*/results.json \\
        --out benchmarks/results/sim-fleet-2026-12-06

Writes OUT/summary.md (a row per fleet size, load and policy) and OUT/fleet.png (hit rate and TTFT p90
against fleet size, a line per policy and load), both read from the results files alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence


def rows(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """(replicas, utilization, policy, hit rate, TTFT p50/p90, goodput per replica, decision p99), sorted."""
    out = []
    for result in results:
        n = int(result["command"].split("--replicas ")[1].split()[0])
        for policy, s in result["policies"].items():
            out.append({"replicas": n, "utilization": result.get("utilization"), "policy": policy,
                        "requests": s["num_requests"], "hit_rate": s["hit_rate"],
                        "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
                        "goodput_per_replica": (s["goodput_requests_per_s"] or 0.0) / n,
                        "decision_p99_us": s["decision_wall_us"]["p99"]})
    return sorted(out, key=lambda r: (r["utilization"] or 0.0, r["replicas"], r["policy"]))


def summary_markdown(table: Sequence[Mapping[str, Any]], sources: Sequence[str]) -> str:
    lines = ["| load (share of prefill capacity) | replicas | policy | requests | hit rate | TTFT p50 (s) | "
             "TTFT p90 (s) | goodput per replica (req/s) | decision p99 (µs) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['utilization']} | {r['replicas']} | {r['policy']} | {r['requests']} | "
                     f"{r['hit_rate']:.3f} | {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | "
                     f"{r['goodput_per_replica']:.3f} | {r['decision_p99_us']:.0f} |")
    return "\n".join(lines + ["", "From: " + ", ".join(f"`{s}`" for s in sources), ""])


def write_figure(table: Sequence[Mapping[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[tuple[str, Any], list[Mapping[str, Any]]] = {}
    for r in table:
        series.setdefault((r["policy"], r["utilization"]), []).append(r)
    for (policy, load), points in sorted(series.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0.0)):
        points = sorted(points, key=lambda r: r["replicas"])
        label = f"{policy}, load {load}"
        xs = [p["replicas"] for p in points]
        hits.plot(xs, [p["hit_rate"] for p in points], marker="o", label=label)
        ttft.plot(xs, [p["ttft_p90_s"] for p in points], marker="o", label=label)
    for ax, title in ((hits, "prefix-cache hit rate"), (ttft, "TTFT p90 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title)
    ttft.set_yscale("log")
    hits.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(result_paths: Sequence[str], out_dir: str) -> tuple[Path, Path]:
    results = [json.loads(Path(p).read_text()) for p in result_paths]
    table = rows(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "summary.md"
    md.write_text(summary_markdown(table, list(result_paths)))
    return md, write_figure(table, out / "fleet.png")


def write_timeline(results: Mapping[str, Any], path: Path) -> Path:
    """An autoscale run's replicas over time (serving, standby, starting) per variant, its first seed's run; the
    step's window shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = results["variants"]
    fig, axes = plt.subplots(len(variants), 1, figsize=(9, 2.2 * len(variants)), sharex=True, squeeze=False)
    step_at_s, step_end_s = results["windows_s"]["step"]
    for ax, (name, variant) in zip(axes[:, 0], variants.items()):
        counts = variant["runs"][0]["replica_counts"]
        times = [c[0] for c in counts]
        for index, label in ((1, "serving"), (2, "standby"), (3, "starting")):
            ax.step(times, [c[index] for c in counts], where="post", label=label)
        if step_end_s > step_at_s:
            ax.axvspan(step_at_s, step_end_s, color="grey", alpha=0.15)
        ax.set_ylabel("replicas")
        ax.set_title(name, fontsize=9)
    axes[0, 0].legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
