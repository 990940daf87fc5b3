"""`kvtide bench` argument wiring: subcommands, workload flags, early config validation."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtide.benchmarks.cli import Load, loads_from_args, point_seed_offset, register, workload_from_args
from kvtide.config import ConfigError


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtide")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_run_parses_workload_and_open_loop_flags():
    """bench run takes a URL, a workload with scaled params, a rate, a duration and an output file."""
    args = parse(["bench", "run", "--url", "http://127.0.0.1:8000", "--workload", "shared-prefix",
                  "--num-groups", "2", "--prompts-per-group", "3", "--rate", "4", "--duration", "5", "--out", "x.json"])
    w = workload_from_args(args)
    assert (args.rate, args.concurrency, args.duration) == (4.0, None, 5.0)
    assert len(w.requests) == 6 and w.params.system_prompt_len == 2048


def test_rate_and_concurrency_are_exclusive_and_one_is_required():
    """Exactly one of --rate / --concurrency must be given."""
    base = ["bench", "run", "--url", "u", "--workload", "random", "--out", "x"]
    with pytest.raises(SystemExit):
        parse(base)
    with pytest.raises(SystemExit):
        parse(base + ["--rate", "1", "--concurrency", "2"])


def test_max_requests_caps_the_workload():
    """--max-requests keeps only the first N requests of the workload."""
    args = parse(["bench", "run", "--url", "u", "--workload", "random", "--num-requests", "50", "--max-requests", "7",
                  "--concurrency", "1", "--out", "x"])
    assert len(workload_from_args(args).requests) == 7


def test_compare_rejects_unknown_policy_before_starting_anything(tmp_path):
    """An unknown routing policy fails config validation with the field named, before any cluster starts."""
    args = parse(["bench", "compare", "--policies", "pow2,no_such_policy", "--workload", "random",
                  "--concurrency", "1", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="routing.policy"):
        args.func(args)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", [
    ["bench", "run", "--url", "http://127.0.0.1:8000", "--out", "x.json"],
    ["bench", "compare", "--policies", "bare,prefix_aware", "--out", "d"],
])
def test_slo_ttft_flag_on_run_and_compare(command):
    """Both commands take --slo-ttft-s (goodput's TTFT objective), 1 s unless given."""
    load = ["--workload", "random", "--concurrency", "1"]
    assert parse(command + load).slo_ttft_s == 1.0
    assert parse(command + load + ["--slo-ttft-s", "0.25"]).slo_ttft_s == 0.25


def test_bare_balancer_flag_defaults_to_auto():
    """bare's balancer is chosen automatically (HAProxy if found, else the Python proxy) unless forced."""
    args = parse(["bench", "compare", "--policies", "bare", "--workload", "random", "--concurrency", "1", "--out", "d"])
    assert args.bare_balancer == "auto"
    with pytest.raises(SystemExit):
        parse(["bench", "compare", "--bare-balancer", "nginx", "--workload", "random", "--concurrency", "1",
               "--out", "d"])


def test_compare_sweeps_lists_of_workloads_and_rates():
    """compare takes comma lists of workloads and rates; each point's workload gets its own seed."""
    args = parse(["bench", "compare", "--policies", "pow2", "--workload", "shared-prefix,random",
                  "--rate", "2,4.5", "--zipf-s", "1.1", "--num-groups", "3", "--prompts-per-group", "4",
                  "--num-requests", "5", "--out", "d", "--hardware", "2 × H200"])
    assert args.workload == ["shared-prefix", "random"]
    assert [lv.label for lv in loads_from_args(args)] == ["rate 2", "rate 4.5"]
    first, second = workload_from_args(args, "shared-prefix", 0), workload_from_args(args, "shared-prefix", 1)
    assert first.params.zipf_s == 1.1 and len(first.requests) == 12
    assert first.requests != second.requests  # a later point's prompts are new to caches the earlier one filled
    assert args.hardware == "2 × H200"


def test_a_points_seed_depends_on_the_point_not_its_place_in_the_lists():
    """`--rate 8,4` and `--rate 4,8` give rate 8 the same prompts; different points get different ones."""
    assert point_seed_offset("shared-prefix", Load(rate=8)) == point_seed_offset("shared-prefix", Load(rate=8.0))
    offsets = {point_seed_offset(w, lv) for w in ("shared-prefix", "multi-turn", "random")
               for lv in (Load(rate=4), Load(rate=8), Load(rate=16), Load(concurrency=4))}
    assert len(offsets) == 12


@pytest.mark.parametrize("bad", [["--workload", "random,nope", "--rate", "1"],
                                 ["--workload", "random", "--rate", "1,0"],
                                 ["--workload", "random", "--concurrency", "two"],
                                 ["--workload", "random", "--rate", "1", "--repeats", "0"]])
def test_compare_rejects_bad_sweep_lists(bad):
    """An unknown workload, a non-positive / non-numeric load in a list, or fewer than 1 repeat is a usage error."""
    with pytest.raises(SystemExit):
        parse(["bench", "compare", "--out", "d", *bad])


def test_run_keeps_scalar_load_flags():
    """bench run measures one point: --concurrency stays one number."""
    args = parse(["bench", "run", "--url", "u", "--workload", "random", "--concurrency", "3", "--out", "x"])
    assert args.concurrency == 3 and [lv.concurrency for lv in loads_from_args(args)] == [3]


def test_a_policy_that_fails_to_start_does_not_lose_the_others(tmp_path, monkeypatch):
    """compare records a policy whose server fails to start as a note, keeps the others' runs, exits 1."""
    import contextlib

    from kvtide.benchmarks import cli
    from kvtide.benchmarks.loadgen import LoadResult
    from kvtide.benchmarks.report import build_run_report

    @contextlib.contextmanager
    def fake_serving(policy, config, out, args):
        if policy == "pow2":
            raise RuntimeError("the kvtide app kept failing to start")
        yield cli.Target("http://127.0.0.1:1", None, "m")

    async def fake_bench_once(base_url, metrics, workload, policy, args, model=None, load_level=None, warmup=None,
                              num_replicas=None):
        report = build_run_report(workload=workload.name, policy=policy, results=[], duration_s=1.0, metrics=None)
        return report, LoadResult([], 1.0)

    monkeypatch.setattr(cli, "serving", fake_serving)
    monkeypatch.setattr(cli, "bench_once", fake_bench_once)
    args = parse(["bench", "compare", "--policies", "pow2,prefix_aware", "--workload", "random", "--rate", "1,2",
                  "--num-requests", "3", "--out", str(tmp_path)])
    assert args.func(args) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results) == ["random @ rate 1", "random @ rate 2"]
    assert all(list(runs) == ["prefix_aware"] for runs in results.values())
    assert "`pow2` failed: RuntimeError: the kvtide app kept failing to start" in (tmp_path / "report.md").read_text()


def _fake_servers(monkeypatch, started: list, on_run) -> None:
    """compare with no servers: each start is recorded in `started`, each run calls on_run(workload, args, level)."""
    import contextlib

    from kvtide.benchmarks import cli
    from kvtide.benchmarks.loadgen import LoadResult
    from kvtide.benchmarks.report import build_run_report

    @contextlib.contextmanager
    def fake_serving(policy, config, out, args):
        started.append(policy)
        yield cli.Target("http://127.0.0.1:1", None, "m")

    async def fake_bench_once(base_url, metrics, workload, policy, args, model=None, load_level=None, warmup=None,
                              num_replicas=None):
        on_run(workload, args, load_level)
        report = build_run_report(workload=workload.name, policy=policy, results=[], duration_s=1.0, metrics=None)
        return report, LoadResult([], 1.0)

    monkeypatch.setattr(cli, "serving", fake_serving)
    monkeypatch.setattr(cli, "bench_once", fake_bench_once)


def test_repeats_rotate_the_policy_order_and_draw_new_prompts(tmp_path, monkeypatch):
    """--repeats 3: each repeat starts with another policy and its own seeds; runs.json keeps every run."""
    started, seeds = [], []
    _fake_servers(monkeypatch, started, lambda workload, args, level: seeds.append(workload.seed))
    args = parse(["bench", "compare", "--policies", "pow2,prefix_aware,bare", "--workload", "random", "--rate", "1",
                  "--num-requests", "3", "--repeats", "3", "--out", str(tmp_path)])
    assert args.func(args) == 0
    assert started == ["pow2", "prefix_aware", "bare", "prefix_aware", "bare", "pow2", "bare", "pow2", "prefix_aware"]
    assert len(set(seeds)) == 3 and seeds[0] == seeds[1] == seeds[2]  # one seed per repeat, the same for all policies
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert [r["repeat"] for r in runs["random @ rate 1"]["pow2"]] == [0, 1, 2]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["prefix_aware"]["repeats"]["n"] == 3
    assert "spread over repeats" in (tmp_path / "report.md").read_text()


def test_workload_set_gives_each_workload_its_own_params_rates_and_duration(tmp_path, monkeypatch):
    """--workload-set overrides one workload's params, rates and duration; the others keep the shared flags; one start per policy."""
    started, ran = [], []
    _fake_servers(monkeypatch, started, lambda workload, args, level: ran.append(
        (workload.name, level.label, args.duration, workload.params.system_prompt_len)))
    args = parse(["bench", "compare", "--policies", "pow2", "--workload", "shared-prefix,multi-turn", "--rate", "8",
                  "--duration", "15", "--system-prompt-len", "600", "--num-groups", "2", "--prompts-per-group", "2",
                  "--num-users", "2", "--num-rounds", "2",
                  "--workload-set", "multi-turn.system_prompt_len=100", "--workload-set", "multi-turn.rate=4,16",
                  "--workload-set", "multi-turn.duration=30", "--out", str(tmp_path)])
    assert args.func(args) == 0
    assert started == ["pow2"]
    assert ran == [("shared-prefix", "rate 8", 15.0, 600), ("multi-turn", "rate 4", 30.0, 100),
                   ("multi-turn", "rate 16", 30.0, 100)]


@pytest.mark.parametrize("entry, message", [
    ("multi-turn.num_users=3", "not one of --workload"),
    ("random.system_prompt_len=3", "has no 'system_prompt_len'"),
    ("random.input_len=many", "is not a whole number"),
    ("random.rate=0", "positive"),
    ("random.input_len=0", "must be positive"),
    ("random=3", "expected WORKLOAD.KEY=VALUE"),
])
def test_workload_set_rejects_what_it_cannot_apply(tmp_path, entry, message, capsys):
    """A --workload-set for a workload not run, an unknown key, a bad value or a malformed entry is a usage error (exit 2) before anything starts."""
    args = parse(["bench", "compare", "--policies", "pow2", "--workload", "random", "--rate", "1",
                  "--workload-set", entry, "--out", str(tmp_path)])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_a_policy_variant_carries_its_own_overrides():
    """`prefix_aware+routing.tie_band_tokens=0` runs prefix_aware with that override; a bad key fails at once."""
    from kvtide.benchmarks.cli import policy_config
    from kvtide.config import default_config_path

    config = policy_config(str(default_config_path()), [], "prefix_aware+routing.tie_band_tokens=0")
    assert (config.routing.policy, config.routing.tie_band_tokens) == ("prefix_aware", 0)
    assert policy_config(str(default_config_path()), [], "prefix_aware").routing.tie_band_tokens == 512
    with pytest.raises(ConfigError):
        policy_config(str(default_config_path()), [], "prefix_aware+routing.tie_band_tokenz=0")
