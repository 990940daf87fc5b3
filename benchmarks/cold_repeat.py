"""Split a shared-prefix run's requests into each group's first request (its prefix cold on
every replica) and the repeats, and time each side: where a router wins or loses TTFT.

    python -m kvtide.benchmarks.cold_repeat DIR [--rates 4,8]

reads DIR/<policy>.shared-prefix.rate<R>.requests.jsonl (what `kvtide bench compare` writes).
TPOT is (e2e - TTFT) / (output tokens - 1) per request: the decode time per token, which
does not depend on how the stream's chunks were grouped.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

POLICY_ORDER = ("pow2", "prefix_aware", "ray_prefix", "ray_kv", "bare", "round_robin")
# A request that never delivered a token counts as missing every latency bound.
NO_TOKEN_S = float("inf")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def split_cold_repeat(requests: list[dict]) -> tuple[list[float], list[float]]:
    """TTFTs of each group's first request (by start time) and of the rest."""
    seen: set[str] = set()
    cold: list[float] = []
    repeat: list[float] = []
    for r in sorted(requests, key=lambda r: r["start_s"]):
        ttft = r["ttft_s"] if r["ttft_s"] is not None else NO_TOKEN_S
        (repeat if r["group"] in seen else cold).append(ttft)
        seen.add(r["group"])
    return cold, repeat


def tpot_s(requests: list[dict]) -> list[float]:
    return [(r["e2e_s"] - r["ttft_s"]) / (r["num_output_tokens"] - 1)
            for r in requests if r["ok"] and r["ttft_s"] is not None and r["num_output_tokens"] > 1]


def report(directory: Path, rates: list[str]) -> str:
    lines = ["| rate | policy | first of group: n, TTFT p50 / p90 s | repeats: n, TTFT p50 / p90 s | TPOT mean ms |",
             "|---:|---|---|---|---:|"]
    for rate in rates:
        for policy in POLICY_ORDER:
            path = directory / f"{policy}.shared-prefix.rate{rate}.requests.jsonl"
            if not path.exists():
                continue
            requests = [json.loads(line) for line in path.read_text().splitlines() if line]
            cold, repeat = split_cold_repeat(requests)
            tpot = tpot_s(requests)
            tpot_ms = f"{1e3 * statistics.mean(tpot):.1f}" if tpot else "–"
            lines.append(f"| {rate} | {policy} | {len(cold)}, {quantile(cold, .5):.2f} / {quantile(cold, .9):.2f} "
                         f"| {len(repeat)}, {quantile(repeat, .5):.2f} / {quantile(repeat, .9):.2f} | {tpot_ms} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--rates", default="4,8")
    args = parser.parse_args()
    print(report(args.directory, args.rates.split(",")))


if __name__ == "__main__":
    main()
