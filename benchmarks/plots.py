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


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
