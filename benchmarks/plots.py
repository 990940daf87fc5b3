"""PNG plots of a policy comparison: TTFT CDF, prefix-cache hit rate, throughput.

matplotlib with the Agg backend (no display); one figure per file so each can be
embedded on its own in a README or an issue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from kvtide.benchmarks.report import RequestResult


def write_plots(results: Mapping[str, Mapping[str, Any]], samples: Mapping[str, Sequence[RequestResult]],
                out_dir: str | Path) -> list[Path]:
    """Write ttft_cdf.png, hit_rate.png, throughput.png into `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(results)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        ttfts = sorted(r.ttft_s for r in samples.get(name, ()) if r.ok and r.ttft_s is not None)
        if ttfts:
            ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=name)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [results[n]["prefix_cache_hit_rate"] or 0.0 for n in names]
    ax.bar(names, rates, color="tab:green")
    ax.set_ylim(0, 1)
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_title("Engine prefix-cache hit rate")
    for i, v in enumerate(rates):
        ax.text(i, v + 0.02, f"{v:.2f}", ha="center")
    paths.append(_save(fig, out / "hit_rate.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [results[n]["output_tokens_per_s"] for n in names]
    ax.bar(names, tokens, color="tab:blue")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput")
    for i, v in enumerate(tokens):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    paths.append(_save(fig, out / "throughput.png"))
    return paths


def write_sweep_plots(points: Mapping[str, Mapping[str, Mapping[str, Any]]], out_dir: str | Path) -> list[Path]:
    """Per workload of an open-loop sweep, <workload>_sweep.png: goodput and TTFT p90 against offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, dict[str, list[tuple[float, Mapping[str, Any]]]]] = {}
    for runs in points.values():
        for policy, r in runs.items():
            if r.get("offered_rate_per_s") is not None:
                curves.setdefault(r["workload"], {}).setdefault(policy, []).append((r["offered_rate_per_s"], r))
    paths = []
    for workload, by_policy in curves.items():
        fig, (good, p90) = plt.subplots(1, 2, figsize=(10, 4))
        for policy, pts in by_policy.items():
            pts.sort(key=lambda pt: pt[0])
            rates = [rate for rate, _ in pts]
            good.plot(rates, [r["goodput_requests_per_s"] for _, r in pts], marker="o", label=policy)
            p90.plot(rates, [r["ttft_s"]["p90"] or float("nan") for _, r in pts], marker="o", label=policy)
        slo = next(iter(by_policy.values()))[0][1].get("slo_ttft_s")
        good.set(xlabel="offered load (req/s)", ylabel="goodput (req/s)", title=f"{workload}: goodput (TTFT ≤ {slo:g} s)")
        p90.set(xlabel="offered load (req/s)", ylabel="TTFT p90 (s)", title=f"{workload}: TTFT p90", yscale="log")
        for ax in (good, p90):
            ax.grid(alpha=0.3)
            ax.legend()
        paths.append(_save(fig, Path(out_dir) / f"{workload}_sweep.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
