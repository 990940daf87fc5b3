"""The router microbenchmark on a tiny fleet: its event-loop model (what it times, the two ways it compares) and
its before/after mode against a git revision."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from kvtide.benchmarks import router_microbench as rmb
from kvtide.benchmarks.cli import register
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


# ---- before/after -------------------------------------------------------------------------

TINY_ARGV = ["--replicas", "4", "--indexed-blocks", "2000", "--blocks-per-request", "16", "--block-size", "16",
             "--decisions", "300", "--pool", "200", "--slice-blocks", "8"]


def git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(rmb.repo_root()), *argv], capture_output=True, text=True,
                          check=True).stdout


def worktree_paths() -> set[Path]:
    return {Path(line.split(" ", 1)[1]).resolve() for line in git("worktree", "list", "--porcelain").splitlines()
            if line.startswith("worktree ")}


def parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtide")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_before_after_runs_each_tree_alternated_and_removes_the_worktree(tmp_path):
    """--baseline-rev HEAD: before/after/before/after, each run importing kvtide from its own tree, four
    headline latencies with both sides, reports written, and the baseline worktree gone afterwards."""
    head = git("rev-parse", "HEAD").strip()
    code = rmb.main([*TINY_ARGV, "--baseline-rev", "HEAD", "--repeats", "2", "--out-dir", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "before_after.json").read_text())

    assert report["order"] == ["before #1", "after #1", "before #2", "after #2"]
    assert [(r["side"], r["repeat"]) for r in report["runs"]] == [("before", 0), ("after", 0), ("before", 1),
                                                                  ("after", 1)]
    before, after = report["sides"]["before"], report["sides"]["after"]
    assert before["commit"] == head and after["commit"].removesuffix("-dirty") == head
    assert Path(after["tree"]) == rmb.repo_root() and Path(before["tree"]) != Path(after["tree"])
    for run_ in report["runs"]:
        tree = Path(report["sides"][run_["side"]]["tree"])
        assert Path(run_["kvtide_file"]).is_relative_to(tree) and Path(run_["policy_file"]).is_relative_to(tree)
        assert run_["result"]["decision_latency_us"]["p50"] > 0
    assert set(report["headline"]) == {"decision_latency_us.p50", "decision_latency_us.p99",
                                       "rank_replicas_us.p50", "rank_replicas_us.p99"}
    for h in report["headline"].values():
        assert h["before"]["n"] == h["after"]["n"] == h["after_over_before"]["n"] == 2
        assert h["verdict"] in {"no difference", "faster", "slower"}
    assert len({r["code_digest"] for r in report["runs"] if r["side"] == "before"}) == 1
    assert isinstance(report["after_code"]["changed_during_runs"], bool)
    assert report["single_run_options"]["decisions"] == 300
    prov = report["provenance"]
    assert prov["kvtide_commit"] == after["commit"] and "--baseline-rev HEAD" in prov["command"]
    assert {"cpu_model", "python_executable", "platform"} <= set(prov) and prov["versions"]["python"]
    markdown = (tmp_path / "before_after.md").read_text()
    assert markdown.count("| decision latency") == 2 and markdown.count("| the decision's own work") == 2

    assert not Path(before["tree"]).exists() and Path(before["tree"]).resolve() not in worktree_paths()


def test_baseline_worktree_is_removed_when_a_run_fails(tmp_path, monkeypatch):
    """A run that fails stops the comparison with its error, and the baseline worktree is still removed."""
    trees = []

    def failing_run(tree: Path, argv: list[str], json_path: Path) -> dict:
        trees.append(tree)
        raise RuntimeError("the single run failed")

    monkeypatch.setattr(rmb, "run_side", failing_run)
    with pytest.raises(RuntimeError, match="the single run failed"):
        rmb.main([*TINY_ARGV, "--baseline-rev", "HEAD", "--out-dir", str(tmp_path)])
    assert len(trees) == 1 and trees[0] != rmb.repo_root()  # the first run is the baseline's
    assert not trees[0].exists() and trees[0].resolve() not in worktree_paths()


def test_forwarded_options_parse_back_to_the_same_load():
    """What both sides' processes get parses, by the single run's own options, to this run's load values."""
    parser = argparse.ArgumentParser()
    rmb.add_arguments(parser)
    args = parser.parse_args([*TINY_ARGV, "--seed", "7", "--protocol", "full", "--rate", "150.5"])
    again = parser.parse_args(rmb.forwarded_argv(args))
    assert {d: getattr(again, d) for d in rmb.FORWARDED_OPTIONS} == {d: getattr(args, d) for d in rmb.FORWARDED_OPTIONS}


def test_bench_router_takes_the_single_run_and_before_after_options(capsys):
    """`kvtide bench router` parses the module's options; --baseline-rev without --out-dir exits 2 before any run."""
    args = parse_cli(["bench", "router", "--decisions", "500", "--baseline-rev", "HEAD~1", "--repeats", "4"])
    assert (args.decisions, args.baseline_rev, args.repeats, args.replicas) == (500, "HEAD~1", 4, 32)
    assert args.func(args) == 2
    assert "--baseline-rev needs --out-dir" in capsys.readouterr().err


def test_single_run_out_and_before_after_out_dir_are_not_mixed():
    """--out (the single run's report) is refused with --baseline-rev, and --out-dir without it."""
    with pytest.raises(SystemExit):
        rmb.main(["--baseline-rev", "HEAD", "--out", "x.md", "--out-dir", "d"])
    with pytest.raises(SystemExit):
        rmb.main(["--out-dir", "d"])


def test_code_digest_follows_the_package_files_content_not_commits(tmp_path):
    """code_digest changes when a package's .py file is edited, and stays put when it is committed as it is."""
    def in_repo(*argv: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *argv],
                       capture_output=True, check=True)

    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"kvtide" = "kvtide"\n'
                                             '"kvtide.deployments" = "deployments"\n')
    (tmp_path / "kvtide").mkdir()
    (tmp_path / "kvtide" / "__init__.py").write_text("")
    (tmp_path / "deployments").mkdir()
    (tmp_path / "deployments" / "policy.py").write_text("A = 1\n")
    (tmp_path / "notes.md").write_text("outside the packages\n")
    in_repo("init", "-q")
    uncommitted = rmb.code_digest(tmp_path)
    in_repo("add", "-A")
    in_repo("commit", "-q", "-m", "c")
    assert rmb.code_digest(tmp_path) == uncommitted
    (tmp_path / "notes.md").write_text("edited\n")
    assert rmb.code_digest(tmp_path) == uncommitted
    (tmp_path / "deployments" / "policy.py").write_text("A = 2\n")
    assert rmb.code_digest(tmp_path) != uncommitted


def test_a_cpu_tier_reaches_the_router_state_through_the_engines_digests():
    """--cpu-tier-blocks: every engine offloads what it stores, and the warmed router's CPU index holds it."""
    import argparse

    from kvtide.benchmarks import router_microbench as mb

    parser = argparse.ArgumentParser()
    mb.add_arguments(parser)
    args = parser.parse_args(["--replicas", "4", "--indexed-blocks", "2000", "--blocks-per-request", "8",
                              "--block-size", "16", "--pool", "400", "--cpu-tier-blocks", "8000"])
    state, engines, *_ = mb.build_state(args)
    assert all(state.cpu_index.num_held_by(rid) == len(engines.cpu_held[rid]) > 0 for rid in engines.held)
    assert all(set(engines.held[rid]) <= set(engines.cpu_held[rid]) for rid in engines.held)
    args.cpu_tier_blocks = 0
    assert mb.build_state(args)[0].cpu_index.num_engine_blocks == 0
