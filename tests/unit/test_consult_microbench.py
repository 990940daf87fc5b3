"""The consult microbenchmark: every part of a consult is timed, for every batch, and the parts fit in the whole."""

from __future__ import annotations

from fakes import FakeTokenizer

from kvtide.benchmarks.consult_microbench import PARTS, run
from kvtide.config import parse_config
from kvtide.deployments.frontend.prompts import PromptBuilder


def test_each_batch_times_every_part_and_the_parts_fit_in_the_consult():
    """Three batches of fresh 20-word prompts: one row each, every part timed, each part's median ≤ the consult's."""
    config = parse_config({"model": "/m", "served_model_name": "kvtide-demo"})
    rows = run(batches=3, per_batch=12, words=20, config=config, prompts=PromptBuilder(config, FakeTokenizer()))
    assert len(rows) == 3
    for row in rows:
        assert set(row) == set(PARTS) and all(ms > 0 for ms in row.values())
        assert max(row[p] for p in PARTS if p != "consult") <= row["consult"]
