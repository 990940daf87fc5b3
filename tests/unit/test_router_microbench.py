"""The router microbenchmark's event-loop model, on a tiny fleet: what it times and how it compares the two ways."""

from __future__ import annotations

import argparse

from kvtide.benchmarks.router_microbench import run


def tiny_args(**overrides) -> argparse.Namespace:
    args = dict(replicas=4, indexed_blocks=2000, blocks_per_request=16, block_size=16, decisions=300, pool=200,
                rate=200.0, seed=0, protocol="delta", delta_window=4, full_every=5, slice_blocks=8)
    return argparse.Namespace(**{**args, **overrides})


def test_each_decision_is_timed_from_arrival_and_digests_run_in_slices_only_when_sliced():
    """Latency includes the ranking (p50 ≥ rank p50); the sliced run applies digests in slices, the other in pushes."""
    result = run(tiny_args())
    sliced, at_once = result, result["at_once"]
    for r in (sliced, at_once):
        assert sum(r["outcomes"].values()) == 300
        assert r["decision_latency_us"]["p50"] >= r["rank_replicas_us"]["p50"]
        assert r["pushes"] > 0 and r["digests"] > 0
    assert sliced["slices"] > 0 and at_once["slices"] == 0
