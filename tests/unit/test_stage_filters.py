"""Filter stage: standbys and pins remove candidates; the load guard splits them under/over."""

from __future__ import annotations

import pytest

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.snapshot import ReplicaSnapshot
from kvtide.deployments.routing.stages import filters, scorers

TUNE = RoutingConfig()
STANDBY = {"b"}


def is_standby(rid: str) -> bool:
    return rid in STANDBY


@pytest.mark.parametrize("candidates, kept", [
    (["a", "b", "c"], ["a", "c"]),
    (["b"], ["b"]),  # all standby: all stay, so the request still has somewhere to go
    ([], []),
])
def test_serving_leaves_standbys_out_unless_every_candidate_is_one(candidates, kept):
    """A standby takes no request while another replica can."""
    assert filters.serving(candidates, is_standby) == kept


@pytest.mark.parametrize("pin, chosen", [("c", "c"), ("b", None), ("gone", None), (None, None)])
def test_a_pin_names_the_one_replica_while_it_serves(pin, chosen):
    """A pinned request goes to its replica alone; a standby or vanished pin falls back to the policy (None)."""
    assert filters.pinned(["a", "b", "c"], pin, lambda r: r, is_standby) == chosen


def guard(loads: list[int], pendings: list[int], kv: list[float], gpu_held: list[int], num_blocks: int = 64,
          block_size: int = 32) -> list[bool]:
    snaps = [ReplicaSnapshot(f"r{i}", n, kv_usage_perc=u) for i, (n, u) in enumerate(zip(loads, kv))]
    work = scorers.queue_cost(loads, pendings, TUNE)
    return filters.load_guard(snaps, work, gpu_held, num_blocks, block_size, TUNE)


@pytest.mark.parametrize("loads, pendings, kv, held, over", [
    # limit = 1.25 × mean(work) + 2 × 256 + the prompt's 2,048 tokens
    ([0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [False, False, False]),
    ([20, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [True, False, False]),  # 5,120 > 1.25 × 1,707 + 2,560
    ([0, 0], [9000, 0], [0, 0], [0, 0], [True, False]),  # pending prefill is work too
    # the KV guard bars cold prefills from a full cache, not hits of at least half the prompt
    ([0, 0], [0, 0], [0.96, 0.96], [32, 31], [False, True]),
])
def test_the_load_guard_marks_work_over_the_limit_and_full_caches_for_cold_prompts(loads, pendings, kv, held, over):
    """Guard table: work in tokens against the bounded-load limit; the KV guard reads GPU blocks held."""
    assert guard(loads, pendings, kv, held) == over


def test_the_work_guard_always_leaves_a_replica_under_it():
    """limit ≥ mean(work) ≥ min(work) with factor ≥ 1 and slack ≥ 0: some replica is under the guard."""
    for loads in ([0, 100], [5, 5, 5], [1000, 0, 0, 0], [3, 7, 11]):
        assert not all(guard(loads, [0] * len(loads), [0.0] * len(loads), [0] * len(loads)))
