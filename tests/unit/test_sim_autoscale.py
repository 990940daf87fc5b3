"""kvtide's autoscaler on the simulated fleet (simulator/autoscale.py, fleet.py): the Ray policy's own tick deciding."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from kvtide.autoscaling import control_law, ray_policy, standby
from kvtide.config import AutoscalingSettings
from kvtide.simulator import autoscale as sim_autoscale
from kvtide.simulator.autoscale import AutoscaleConfig, Autoscaler
from kvtide.simulator.engine import EngineLimits, StepProfile
from kvtide.simulator.fleet import FleetSim, SimConfig, TraceItem, sim_requests

SIMULATOR = Path(__file__).resolve().parents[2] / "simulator"
PROFILE = StepProfile(base_s=0.005, per_prefill_token_s=2e-5, per_decode_seq_s=1e-4)
LIMITS = EngineLimits(num_blocks=400, block_size=16, max_num_batched_tokens=2048, max_num_seqs=32)


def step_trace(low_rps: float, high_rps: float, high_from_s: float, high_until_s: float, end_s: float,
               num_groups: int = 20, output_tokens: int = 200) -> list[TraceItem]:
    """Poisson arrivals (fixed seed) over `num_groups` shared prefixes of six blocks of 64 tokens each, then one
    block of the request's own; the rate is `high_rps` within [high_from_s, high_until_s), `low_rps` outside."""
    rng = random.Random(3)
    items, t_s, i = [], 0.0, 0
    while True:
        rate = high_rps if high_from_s <= t_s < high_until_s else low_rps
        t_s += rng.expovariate(rate)
        if t_s >= end_s:
            return items
        group = rng.randrange(num_groups)
        ids = tuple(group * 1000 + k for k in range(6)) + (10_000_000 + i,)
        items.append(TraceItem(t_s * 1000.0, len(ids) * 64, output_tokens, ids))
        i += 1


def settings(**overrides) -> AutoscalingSettings:
    return AutoscalingSettings(**{"look_back_s": 4, "upscale_delay_s": 4, "downscale_delay_s": 20, **overrides})


def run(trace: list[TraceItem], autoscale: AutoscaleConfig, policy: str = "prefix_aware"):
    sim = FleetSim(SimConfig(num_replicas=1, profile=PROFILE, limits=LIMITS), policy, Autoscaler(autoscale))
    return sim.run(sim_requests(trace, 64, 16))


def test_the_simulator_ticks_the_ray_policys_own_function():
    """The simulated controller calls ray_policy.policy_tick, which KvPolicy calls too; no law or role code is copied."""
    assert sim_autoscale.policy_tick is ray_policy.policy_tick
    source = ast.parse(Path(ray_policy.__file__).read_text())
    call = next(n for n in ast.walk(source) if isinstance(n, ast.FunctionDef) and n.name == "__call__")
    assert any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "policy_tick" for n in ast.walk(call))
    names = {name for module in (control_law, standby, ray_policy) for name, value in vars(module).items()
             if callable(value) and getattr(value, "__module__", "") == module.__name__}
    defined = {node.name for path in SIMULATOR.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert names and not names & defined


def test_the_context_holds_window_means_and_the_samples_ray_would_give_the_policy():
    """Aggregated metrics are means over look_back_s of the samples; raw ones the samples; an unsampled replica none."""
    scaler = Autoscaler(AutoscaleConfig(settings=settings(), min_replicas=1, max_replicas=3, initial_replicas=2))
    base = {"num_waiting": 0, "num_running": 1, "num_preemptions_total": 0, "hit_tokens_total": 0,
            "exclusive_hit_tokens_total": 0}
    for t_s, kv in ((0.0, 0.9), (3.0, 0.5), (5.0, 0.3)):
        scaler.sample(t_s, {"a": {**base, "kv_usage": kv}})
    ctx = scaler.context(5.0, ["a", "b"])
    kv = ctx.aggregated_metrics["kvtide_kv_usage_perc"]
    (a,) = kv  # b never reported
    assert a.unique_id == "a" and kv[a] == pytest.approx(0.4)  # the sample at 0 s left the 4 s window
    assert [v.value for v in ctx.raw_metrics["kvtide_kv_usage_perc"][a]] == [0.5, 0.3]
    assert [r.unique_id for r in ctx.running_replicas] == ["a", "b"] and ctx.target_num_replicas == 2


def test_a_step_load_grows_the_fleet_and_a_standby_serves_sooner_than_a_cold_start():
    """A 4× step fills the KV: the law scales out; with a standby the first new replica serves wake_s after the
    decision, without one cold_start_s after it; the fleet stays within its bounds and every request finishes."""
    trace = step_trace(4.0, 16.0, 30.0, 90.0, 120.0)
    first_serving = {}
    for pool in (1, 0):
        result = run(trace, AutoscaleConfig(settings=settings(standby_replicas=pool), min_replicas=1, max_replicas=4,
                                            initial_replicas=1, cold_start_s=20.0, wake_s=2.0))
        assert all(r.finished_s is not None for r in result.requests)
        assert all(1 <= active + standbys + starting <= 4 for _, active, standbys, starting in result.replica_counts)
        assert max(active for _, active, _, _ in result.replica_counts) >= 3
        events = [e for e in result.scaling_events if e[0] >= 30.0]
        decided_s = next(t for t, verb, _ in events if verb in ("woken", "started"))
        served_s = next(t for t, verb, _ in events if verb == "serving")
        first_serving[pool] = served_s - decided_s
    assert first_serving[1] == pytest.approx(2.0) and first_serving[0] == pytest.approx(20.0)


def test_a_scale_down_demotes_the_cheapest_cache_with_cache_aware_and_stops_the_newest_with_ray():
    """Load falls below what three replicas need: cache_aware puts the replica whose recent hits are worth least to
    standby (its choice follows the worth the policy saw); ray stops the newest replica."""
    trace = step_trace(2.0, 12.0, 0.0, 40.0, 70.0)
    outcomes = {}
    for chooser in ("cache_aware", "ray"):
        result = run(trace, AutoscaleConfig(settings=settings(scale_down_chooser=chooser), min_replicas=2,
                                            max_replicas=3, initial_replicas=3))
        assert all(r.finished_s is not None for r in result.requests)
        outcomes[chooser] = [(verb, rid) for _, verb, rid in result.scaling_events if verb in ("demoted", "stopped")]
    assert outcomes["cache_aware"][0][0] == "demoted"
    assert outcomes["ray"][0] == ("stopped", "replica-2")  # the newest of three started together: the last made


def test_a_step_compresses_the_traces_arrivals_inside_it_and_keeps_the_rest_in_pace():
    """step_items: arrivals within the step come factor× as fast; before it unchanged; after it shifted back to pace."""
    from kvtide.simulator.autoscale import step_items

    items = [TraceItem(float(t_ms), 64, 1, (t_ms,)) for t_ms in range(0, 10_000, 1000)]
    stepped = step_items(items, at_s=2.0, for_s=2.0, factor=3.0)
    assert [i.timestamp_ms for i in stepped] == pytest.approx(
        [0, 1000, 2000, 2000 + 1000 / 3, 2000 + 2000 / 3, 3000, 3000 + 1000 / 3, 3000 + 2000 / 3, 4000, 5000])
    assert [i.hash_ids for i in stepped] == [i.hash_ids for i in items]
    with pytest.raises(ValueError, match="factor"):
        step_items(items, 1.0, 1.0, 0.0)


def test_simulate_autoscale_writes_each_variants_runs_per_seed_and_a_report(tmp_path, capsys):
    """`kvtide simulate autoscale`: every variant runs once per seed on the stepped trace; results.json holds the runs
    with their provenance, report.md their medians, timeline.png the replicas over time; an unknown setting is
    refused with exit 2."""
    import argparse
    import json

    from kvtide.simulator.cli import register

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 512, "output_length": 16,
                                         "hash_ids": [i % 3, 100 + i]}) + "\n" for i in range(120)))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["simulate", "autoscale", "--trace", str(trace), "--max-replicas", "3", "--kv-gib", "1",
            "--block-tokens", "256", "--step-at-s", "4", "--step-for-s", "4", "--seeds", "0,1",
            "--out-dir", str(tmp_path / "out")]
    args = parser.parse_args([*base, "--variants", "pool:standby_replicas=1,cold:standby_replicas=0"])
    assert args.func(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {name: [r["seed"] for r in v["runs"]] for name, v in results["variants"].items()} == {
        "pool": [0, 1], "cold": [0, 1]}
    assert results["variants"]["pool"]["settings"]["standby_replicas"] == 1 and results["provenance"]["command"]
    assert all(r["num_requests"] == 120 for v in results["variants"].values() for r in v["runs"])
    assert "| pool |" in (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 0
    refused = parser.parse_args([*base, "--variants", "bad:no_such_setting=1"])
    assert refused.func(refused) == 2 and "no_such_setting" in capsys.readouterr().err
