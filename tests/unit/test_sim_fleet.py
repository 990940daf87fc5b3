"""The fleet simulator (simulator/fleet.py, profile.py, report.py): kvtide's own router code deciding for simulated engines."""

from __future__ import annotations

import ast
import json
import random
import zlib
from dataclasses import replace
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
    for replica in sim.replicas.values():
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


def test_summary_table_and_figure_from_run_results(tmp_path):
    """simulate summary: a row per load, size and policy read from the results files, and a figure written."""
    from kvtide.simulator.summary import rows, write_summary

    items = shared_prefix_trace(num_groups=2, per_group=3)
    paths = []
    for n in (2, 4):
        result = summarize(FleetSim(config(num_replicas=n), "round_robin").run(sim_requests(items, 64, 16)), 1.0)
        path = tmp_path / f"n{n}.json"
        path.write_text(json.dumps({"command": f"kvtide simulate run --replicas {n} --out-dir x", "utilization": 0.5,
                                    "policies": {"round_robin": result}}))
        paths.append(str(path))
    table = rows([json.loads(Path(p).read_text()) for p in paths])
    assert [(r["replicas"], r["policy"]) for r in table] == [(2, "round_robin"), (4, "round_robin")]
    assert table[0]["goodput_per_replica"] == pytest.approx(
        json.loads(Path(paths[0]).read_text())["policies"]["round_robin"]["goodput_requests_per_s"] / 2)
    md, png = write_summary(paths, str(tmp_path / "out"))
    assert "| 0.5 | 4 | round_robin | 6 |" in md.read_text() and png.stat().st_size > 0


def test_engines_sharing_a_gpu_take_turns():
    """With four engines on one GPU, concurrent steps serialize: the same load finishes later than on four GPUs."""
    items = shared_prefix_trace(num_groups=4, per_group=10, gap_ms=1.0)
    alone = FleetSim(config(), "round_robin").run(sim_requests(items, 64, 16))
    shared = FleetSim(replace(config(), engines_per_gpu=4), "round_robin").run(sim_requests(items, 64, 16))
    last_finish = [max(r.finished_s for r in run.requests) for run in (alone, shared)]
    assert last_finish[1] > 1.5 * last_finish[0]
    assert [r.cached_tokens for r in shared.requests] == [r.cached_tokens for r in alone.requests]


def test_a_bench_workload_replays_with_its_prompts_blocks_and_arrivals(tmp_path):
    """The shared-prefix workload becomes requests whose blocks are kvtide's hashes of the rendered prompt, sent at
    the load generator's Poisson times; a group's requests share their system prompt's blocks."""
    from kvtide.benchmarks.loadgen import arrival_times_s
    from kvtide.benchmarks.workloads import make_params
    from kvtide.deployments.routing.block_hash import block_hashes
    from kvtide.simulator.workload import workload_requests

    class Tokenizer:  # a word tokenizer with a chat template's shape: role tags, then the text, word by word
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            words = [w for m in messages for w in (f"<{m['role']}>", *m["content"].split())] + ["<assistant>"]
            return [zlib.crc32(w.encode()) % 50_000 for w in words]

    params = make_params("shared-prefix", num_groups=2, prompts_per_group=4, system_prompt_len=200, question_len=20,
                         output_len=7)
    requests = workload_requests("shared-prefix", params, seed=5, rate=100.0, duration_s=60.0, tokenizer=Tokenizer(),
                                 tokens_per_word=1.0, block_size=16)
    assert [r.arrival_s for r in requests] == arrival_times_s(8, 100.0, 60.0, 5)
    assert all(r.output_tokens == 7 and len(r.block_hashes) == r.prompt_tokens // 16 for r in requests)
    by_first = {}
    for r in requests:
        by_first.setdefault(r.block_hashes[0], []).append(r)
    assert len(by_first) == 2  # two groups, each sharing its system prompt's blocks
    for group in by_first.values():
        assert len({r.block_hashes[:10] for r in group}) == 1
    assert requests[0].block_hashes == tuple(block_hashes(Tokenizer().apply_chat_template(
        list(__import__("kvtide.benchmarks.workloads", fromlist=["x"]).build_workload(
            "shared-prefix", params, seed=5, tokens_per_word=1.0).requests[0].messages), True, True), 16))


def test_replay_compares_each_metric_with_the_measured_run_within_tolerance():
    """Hit rate is compared in absolute terms (±0.03), latencies relatively (±20 %); missing values stay open."""
    from kvtide.simulator.cli import compare_to_measured

    simulated = {"hit_rate": 0.80, "ttft_s": {"p50": 0.10, "p90": 0.50}, "e2e_s": {"p90": 2.0}}
    measured = {"prefix_cache_hit_rate": 0.82, "ttft_s": {"p50": 0.2, "p90": 0.45}, "e2e_s": {}}
    cmp = compare_to_measured(simulated, measured)
    assert cmp["hit_rate"]["within"] and cmp["hit_rate"]["abs_difference"] == pytest.approx(-0.02)
    assert cmp["ttft_p50_s"]["within"] is False and cmp["ttft_p50_s"]["rel_difference"] == pytest.approx(-0.5)
    assert cmp["ttft_p90_s"]["within"] and cmp["e2e_p90_s"]["within"] is None
    assert compare_to_measured(simulated, None) is None


def test_kvtide_plan_with_a_trace_sizes_the_fleet_on_the_capacity_plans_kv(tmp_path, capsys):
    """`kvtide plan --trace`: the KV plan first, then the simulator (found through its entry point) sizes the
    fleet per policy with that KV per replica; without --slo-ttft-p90-ms it refuses."""
    import argparse as _argparse

    from kvtide.autoscaling.cli import register, trace_planner

    assert trace_planner().__name__ == "plan_on_trace"
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 50 * i, "input_length": 512, "output_length": 16,
                                         "hash_ids": [i % 3, 100 + i]}) + "\n" for i in range(40)))
    parser = _argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--params-b", "8", "--gpu-mem-gib", "80",
            "--max-model-len", "8192", "--trace", str(trace), "--block-tokens", "256", "--max-replicas", "8"]
    args = parser.parse_args([*base, "--slo-ttft-p90-ms", "5000", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fleet"]["limits"]["num_blocks"] == out["kv_bytes_per_replica"] // (out["kv_bytes_per_token"] * 16)
    assert {p: e["replicas"] for p, e in out["fleet"]["policies"].items()} == {"prefix_aware": 1, "round_robin": 1}
    refused = parser.parse_args(base)
    assert refused.func(refused) == 2 and "--slo-ttft-p90-ms" in capsys.readouterr().err


def test_runs_of_two_prompt_lengths_let_the_fit_tell_kv_reads_from_decodes():
    """With runs at two context lengths all four coefficients come back; at one, KV reads stay 0 (not identifiable)."""
    from kvtide.simulator.profile import ClosedLoopRun, fit_runs

    truth = [0.006, 2e-5, 5e-5, 1e-7]

    def run(prompt: int) -> ClosedLoopRun:
        levels = []
        for c in (1, 8, 32, 128):
            row = equations([Level(c, 1.0, 0.0)], prompt, 128)[0][0]
            levels.append(Level(c, c / sum(t * v for t, v in zip(truth, row)),
                                truth[0] + prompt * (truth[1] + truth[3])))
        return ClosedLoopRun(tuple(levels), prompt, 128, f"run-{prompt}")

    both = fit_runs([run(512), run(4096)])
    assert both["kv_read_fitted"] and list(both["step"].values()) == pytest.approx(truth, rel=1e-2)
    one = fit_runs([run(512)])
    assert not one["kv_read_fitted"] and one["step"]["per_kv_token_read_s"] == 0.0
    assert {e["source"] for e in both["equations"]} == {"run-512", "run-4096"}


def test_ray_kv_routes_on_token_load_prefix_reuse_against_active_work():
    """Ray's KV-aware cost: the replica caching the prefix wins at equal load; active prefill and decode work there
    outweighs the reuse; the router's load bookkeeping empties as requests finish."""
    from kvtide.simulator.engine import SimRequest
    from kvtide.simulator.fleet import RayKv

    router = RayKv(block_size=16, rng=random.Random(0))
    prefix = tuple(range(10))
    router.on_kv_events("a", prefix, [])

    def request(i: int, prompt_tokens: int = 176) -> SimRequest:
        return SimRequest(str(i), 0.0, prefix, prompt_tokens, 4)

    first = request(1)
    assert router.pick(first, ["a", "b"], 0.0) == "a"  # 16 new tokens there against 176
    assert router.active_prefill == {"a": 16}
    router.on_first_token(first)
    assert router.active_prefill["a"] == 0 and router.active_decode["a"] == 176
    # 176 context tokens decoding on a, plus 16 new: 192 > 176 new on the empty b.
    assert router.pick(request(2), ["a", "b"], 0.0) == "b"
    router.on_first_token(request(2))
    router.on_finished(first)
    router.on_finished(request(2))
    assert router.active_decode == {"a": 0, "b": 0} and router.routed == {}
    router.on_kv_events("a", [], prefix[5:])
    assert router.pick(request(3), ["a", "b"], 0.0) == "a"  # half the prefix still reused there


def test_ray_kv_learns_from_the_engines_events_in_the_fleet():
    """In the fleet, ray_kv's view of each replica is what the engines stored and evicted, and every request finishes."""
    items = shared_prefix_trace(num_groups=2, per_group=5)
    sim = FleetSim(config(), "ray_kv")
    result = sim.run(sim_requests(items, 64, 16))
    assert all(r.finished_s is not None for r in result.requests)
    assert {rid: held for rid, held in sim.policy.held.items() if held} == {
        rid: r.held for rid, r in sim.replicas.items() if r.held}
    assert sim.policy.routed == {} and not any(sim.policy.active_prefill.values())


def test_a_cpu_tier_reaches_the_router_and_raises_the_hit_rate_where_groups_outgrow_the_gpu():
    """With a CPU tier per engine the digests carry it to the router's CPU index, and groups evicted from GPU
    are loaded instead of recomputed: the hit rate (both tiers) rises above the same fleet's without a tier."""
    items = shared_prefix_trace(num_groups=16, per_group=10, prefix_ids=6, gap_ms=60.0)
    small = config(num_replicas=2, num_blocks=80)  # 16 groups × 24 blocks outgrow 2 × 80 GPU blocks
    tiered = replace(small, limits=replace(small.limits, cpu_tier_blocks=1000, cpu_onload_s_per_token=1e-6))
    without = summarize(FleetSim(small, "prefix_aware").run(sim_requests(items, 64, 16)), 1.0)
    sim = FleetSim(tiered, "prefix_aware")
    with_tier = summarize(sim.run(sim_requests(items, 64, 16)), 1.0)
    assert sim.policy.state.cpu_index.num_engine_blocks > 0
    assert with_tier["cpu_hit_rate"] > 0 and without["cpu_hit_rate"] == 0
    assert with_tier["hit_rate"] > without["hit_rate"]


def test_kvtide_plan_with_a_trace_and_a_cpu_tier_simulates_the_tier(tmp_path, capsys):
    """`kvtide plan --trace --kv-offload-gib`: the simulated engines carry the tier (its blocks and load rate)."""
    import argparse as _argparse

    from kvtide.autoscaling.cli import register

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 50 * i, "input_length": 512, "output_length": 16,
                                         "hash_ids": [i % 3, 100 + i]}) + "\n" for i in range(20)))
    parser = _argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--params-b", "8",
                              "--gpu-mem-gib", "80", "--max-model-len", "8192", "--trace", str(trace),
                              "--block-tokens", "256", "--max-replicas", "4", "--kv-offload-gib", "2",
                              "--slo-ttft-p90-ms", "5000", "--json"])
    assert args.func(args) == 0
    fleet = json.loads(capsys.readouterr().out)["fleet"]
    assert fleet["limits"]["cpu_tier_blocks"] == 2 * 2**30 // (131072 * 16)
    assert fleet["limits"]["cpu_onload_s_per_token"] > 0


def test_a_tier_blind_router_gets_no_cpu_digest_while_the_engines_keep_their_tiers():
    """router_sees_cpu_tier=False: the same tiers load hits, but the router's CPU index stays empty."""
    items = shared_prefix_trace(num_groups=16, per_group=10, prefix_ids=6, gap_ms=60.0)
    small = config(num_replicas=2, num_blocks=80)
    blind = replace(small, limits=replace(small.limits, cpu_tier_blocks=1000, cpu_onload_s_per_token=1e-6),
                    router_sees_cpu_tier=False)
    sim = FleetSim(blind, "prefix_aware")
    result = summarize(sim.run(sim_requests(items, 64, 16)), 1.0)
    assert sim.policy.state.cpu_index.num_engine_blocks == 0 and result["cpu_hit_rate"] > 0
