"""The fleet simulator (simulator/fleet.py, profile.py, report.py): kvtide's own router code deciding for simulated engines."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest

from kvtide.config.routing import RoutingConfig
from kvtide.deployments.routing import policy as routing_policy
from kvtide.deployments.routing.fleet import FleetView
from kvtide.deployments.routing.policy import RouterState
from kvtide.simulator.engine import EngineLimits, StepProfile
from kvtide.simulator.fleet import (
    FleetSim,
    SimConfig,
    TraceItem,
    block_name,
    prefill_capacity_tokens_per_s,
    sim_requests,
    tenant_copies,
    time_scale_for,
)
from kvtide.simulator.plan import smallest_fleet
from kvtide.simulator.profile import Level, equations, fit_closed_loop, load_profile, nnls
from kvtide.simulator.report import percentile, summarize

SIMULATOR = Path(__file__).resolve().parents[2] / "simulator"
PROFILE = StepProfile(base_s=0.005, per_prefill_token_s=2e-5, per_decode_seq_s=1e-4, per_kv_token_read_s=0.0)


def config(num_replicas: int = 4, num_blocks: int = 400, seed: int = 0) -> SimConfig:
    return SimConfig(num_replicas=num_replicas, profile=PROFILE, seed=seed,
                     limits=EngineLimits(num_blocks=num_blocks, block_size=16, max_num_batched_tokens=2048,
                                         max_num_seqs=32))


def shared_prefix_trace(num_groups: int = 8, per_group: int = 20, prefix_ids: int = 6, gap_ms: float = 40.0
                        ) -> list[TraceItem]:
    """Requests of randomly drawn groups (fixed seed; no period a round robin could fall in step with), each
    sharing its group's `prefix_ids` blocks of 64 tokens, then one block of its own."""
    rng = random.Random(7)
    items = []
    for i in range(num_groups * per_group):
        group = rng.randrange(num_groups)
        ids = tuple(group * 1000 + k for k in range(prefix_ids)) + (10_000_000 + i,)
        items.append(TraceItem(timestamp_ms=i * gap_ms, input_length=len(ids) * 64, output_length=8, hash_ids=ids))
    return items


def test_trace_blocks_are_named_by_hash_id_and_position():
    """A hash id of 64 tokens is four engine blocks of 16, named (id, position); equal ids give equal names."""
    items = [TraceItem(0.0, 128, 5, (7, 9)), TraceItem(10.0, 100, 0, (7,))]
    first, second = sim_requests(items, block_tokens=64, block_size=16)
    assert first.block_hashes == tuple(block_name(h, j) for h in (7, 9) for j in range(4))
    assert second.block_hashes == first.block_hashes[:4] and second.prompt_tokens == 100
    assert (first.arrival_s, second.arrival_s, second.output_tokens) == (0.0, 0.01, 1)
    with pytest.raises(ValueError, match="multiple of the engine block size"):
        sim_requests(items, block_tokens=24, block_size=16)


def test_prefix_aware_keeps_groups_together_and_beats_round_robin_on_hits():
    """On interleaved shared-prefix groups over caches too small for all of them, kvtide's router hits far more."""
    items = shared_prefix_trace()
    outcomes = {}
    for policy in ("prefix_aware", "round_robin", "pow2"):
        result = FleetSim(config(num_blocks=120), policy).run(sim_requests(items, 64, 16))
        assert all(r.finished_s is not None for r in result.requests)
        outcomes[policy] = result.prefix_hits_tokens / result.prefix_queries_tokens
    assert outcomes["prefix_aware"] > outcomes["round_robin"] + 0.2
    assert outcomes["prefix_aware"] > outcomes["pow2"] + 0.2


def test_a_run_is_deterministic_for_its_seed():
    """Two runs of one trace and seed give the same placement and times; the router's wall time aside."""
    items = shared_prefix_trace(num_groups=4, per_group=10)
    runs = [FleetSim(config(seed=3), "prefix_aware").run(sim_requests(items, 64, 16)) for _ in range(2)]
    assert runs[0].replica_of == runs[1].replica_of
    assert [r.first_token_s for r in runs[0].requests] == [r.first_token_s for r in runs[1].requests]
    pow2 = [FleetSim(config(seed=s), "pow2").run(sim_requests(items, 64, 16)).replica_of for s in (1, 1, 2)]
    assert pow2[0] == pow2[1] != pow2[2]


def test_the_simulator_drives_kvtides_router_code_unmodified(monkeypatch):
    """prefix_aware is the real RouterState and FleetView, ranked once per request; no routing code is copied."""
    calls = []
    real_rank = RouterState.rank

    def counting_rank(self, *args, **kwargs):
        calls.append(1)
        return real_rank(self, *args, **kwargs)

    monkeypatch.setattr(RouterState, "rank", counting_rank)
    sim = FleetSim(config(), "prefix_aware")
    assert type(sim.policy.state) is RouterState and type(sim.policy.fleet) is FleetView
    items = shared_prefix_trace(num_groups=2, per_group=5)
    sim.run(sim_requests(items, 64, 16))
    assert len(calls) == len(items)
    # No function or class of the policy module is defined again in the simulator.
    routing_names = {n for n, v in vars(routing_policy).items() if callable(v) and getattr(v, "__module__", "")
                     == routing_policy.__name__}
    defined = {node.name for path in SIMULATOR.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert routing_names and not routing_names & defined


def test_reports_carry_the_engines_digests_to_the_router():
    """After a report the router's index holds exactly the blocks the engines cached (engine truth, not history)."""
    items = shared_prefix_trace(num_groups=2, per_group=3)
    sim = FleetSim(config(num_replicas=2), "prefix_aware")
    result = sim.run(sim_requests(items, 64, 16))
    index = sim.policy.state.index
    for replica in sim.replicas:
        assert replica.held
        for name in sorted(replica.held)[:20]:
            assert index.match((name,), result.end_s, engine_only=True).get(replica.replica_id) == 1


def test_summary_reads_ttft_e2e_goodput_and_hit_rate_from_the_run():
    """summarize: TTFT and e2e from simulated times, goodput against the SLO, the engines' hit rate."""
    items = shared_prefix_trace(num_groups=2, per_group=4)
    result = FleetSim(config(num_replicas=2), "round_robin").run(sim_requests(items, 64, 16))
    summary = summarize(result, slo_ttft_s=10.0)
    ttfts = sorted(r.first_token_s - r.arrival_s for r in result.requests)
    assert summary["num_finished"] == len(items) and summary["ttft_s"]["p50"] == pytest.approx(percentile(ttfts, 50))
    assert summary["goodput_requests_per_s"] == pytest.approx(len(items) / summary["duration_s"])
    assert summary["hit_rate"] == pytest.approx(result.prefix_hits_tokens / result.prefix_queries_tokens)
    assert summary["requests_per_replica"]["max"] - summary["requests_per_replica"]["min"] <= 1  # round robin


def test_percentile_interpolates_as_numpy():
    """percentile matches numpy's default (linear) on a small list; no values give None."""
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 90) == 5.0 and percentile([], 50) is None
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_closed_loop_fit_recovers_known_coefficients():
    """Levels generated from known step coefficients fit back to them (non-negative least squares)."""
    truth = [0.006, 2e-5, 5e-5, 0.0]  # closed-loop levels cannot tell KV reads from decodes: the fit leaves it 0
    levels = []
    for c in (1, 8, 32, 128):
        row = equations([Level(c, 1.0, 0.0)], 512, 128)[0][0]
        step_s = sum(t * v for t, v in zip(truth, row))
        ttft_s = truth[0] + 512 * truth[1] + 512 * truth[3]
        levels.append(Level(c, c / step_s, ttft_s))
    fitted = fit_closed_loop(levels, 512, 128)
    assert list(fitted["step"].values()) == pytest.approx(truth, rel=1e-3)
    assert all(e["fitted_s"] == pytest.approx(e["measured_s"], rel=1e-6) for e in fitted["equations"])
    assert nnls([[1.0], [1.0]], [-1.0, -2.0]) == [0.0]  # never negative


def test_the_committed_profile_loads_and_sizes_an_engine():
    """The committed 8B profile loads by name; KV bytes become blocks at its bytes per token."""
    profile = load_profile("llama-8b-h100")
    limits = profile.limits(16 * 2**30, 8192, 256)
    assert limits.num_blocks == 16 * 2**30 // (profile.kv_bytes_per_token * profile.block_size)
    assert all(v >= 0 for v in json.loads(json.dumps(profile.raw["step"])).values())
    with pytest.raises(ValueError, match="no profile"):
        load_profile("no-such-profile")


def _curve(p90_by_size: dict[int, float]):
    def run(config, policy, items, block_tokens, slo_ttft_s):
        return {"num_requests": 1, "num_finished": 1, "ttft_s": {"p90": p90_by_size[config.num_replicas]}}
    return run


def test_plan_finds_the_smallest_size_meeting_the_objective_and_keeps_the_curve():
    """Doubling then bisection: the smallest size within the objective; every simulated size is reported."""
    curve = {n: 10.0 / n for n in range(1, 65)}  # p90 falls as 10 s / replicas
    plan = smallest_fleet(config(), "round_robin", [], 64, slo_ttft_p90_s=0.4, run=_curve(curve))
    assert plan.replicas == 25 and set(plan.tried) == {1, 2, 4, 8, 16, 32, 24, 28, 26, 25}
    assert smallest_fleet(config(), "round_robin", [], 64, 0.05, max_replicas=64, run=_curve(curve)).replicas is None
    assert smallest_fleet(config(), "round_robin", [], 64, 20.0, run=_curve(curve)).replicas == 1


def test_plan_on_a_real_simulation_needs_fewer_replicas_for_a_looser_objective():
    """On the simulator itself, a looser TTFT objective never asks for more replicas."""
    items = shared_prefix_trace(num_groups=4, per_group=10, gap_ms=5.0)
    tight = smallest_fleet(config(), "prefix_aware", items, 64, slo_ttft_p90_s=0.05, max_replicas=16)
    loose = smallest_fleet(config(), "prefix_aware", items, 64, slo_ttft_p90_s=1.0, max_replicas=16)
    assert tight.replicas is not None and loose.replicas is not None and loose.replicas <= tight.replicas
    assert all(s["num_finished"] == len(items) for s in tight.tried.values())


def test_a_request_that_outgrows_the_cache_while_decoding_still_finishes():
    """Decode past the cache preempts (recompute) instead of stalling the fleet: every request ends."""
    items = [TraceItem(0.0, 128, 200, (1, 2)), TraceItem(1.0, 128, 200, (3, 4))]
    result = FleetSim(config(num_replicas=1, num_blocks=16), "round_robin").run(sim_requests(items, 64, 16))
    assert all(r.finished_s is not None for r in result.requests) and result.num_preemptions > 0


def test_tenant_copies_replay_the_trace_with_disjoint_blocks():
    """Copies share no hash id, keep the trace's times and each copy's own reuse; merged in time order."""
    items = [TraceItem(0.0, 128, 5, (0, 1)), TraceItem(50.0, 128, 5, (0, 2))]
    copies = tenant_copies(items, 3)
    assert [c.timestamp_ms for c in copies] == [0.0] * 3 + [50.0] * 3
    assert [c.hash_ids for c in copies[:3]] == [(0, 1), (3, 4), (6, 7)] and copies[4].hash_ids == (3, 5)
    with pytest.raises(ValueError, match="at least 1"):
        tenant_copies(items, 0)


def test_time_scale_loads_the_fleet_prefill_capacity_to_the_utilization():
    """Unavoidable prefill (first sight of each block) per second of the scaled trace = utilization x capacity."""
    items = [TraceItem(0.0, 128, 5, (0, 1)), TraceItem(1000.0, 128, 5, (0, 2)), TraceItem(2000.0, 192, 5, (0, 2))]
    limits = config().limits
    scale = time_scale_for(items, 0.5, 4, PROFILE, limits, block_tokens=64)
    capacity = 4 * prefill_capacity_tokens_per_s(PROFILE, limits)
    miss_tokens = 64 * 3 + 64  # blocks 0, 1, 2 first seen, and the third prompt's 64 tokens past its ids
    assert miss_tokens / (2.0 * scale) == pytest.approx(0.5 * capacity)
    assert prefill_capacity_tokens_per_s(PROFILE, limits) == pytest.approx(2048 / (0.005 + 2048 * 2e-5))
