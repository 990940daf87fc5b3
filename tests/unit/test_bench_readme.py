"""`kvtide bench readme` (benchmarks.readme_results): README.md's results block written from the result files."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from kvtide.benchmarks import readme_results as rr
from kvtide.benchmarks.cli import register
from kvtide.benchmarks.overhead import server_levels


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvtide")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "readme", *argv])
    return args.func(args)


def copy_current(root: Path) -> Path:
    """The files the current runs are read from (each JSON, the report.md beside it, each linked report)
    and the results index, copied under `root`: a results root a test may change."""
    for source in rr.CURRENT_RUNS.values():
        run = rr.RESULTS_ROOT / source.run_dir
        names = [source.report, *source.files,
                 *(str(Path(f).parent / "report.md") for f in source.files if (run / f).parent.joinpath("report.md").is_file())]
        for name in names:
            (root / source.run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(run / name, root / source.run_dir / name)
    shutil.copyfile(rr.RESULTS_ROOT / rr.INDEX_NAME, root / rr.INDEX_NAME)
    return root


def block_of(text: str) -> str:
    return text.split(rr.BEGIN, 1)[1].split(rr.END, 1)[0]


def test_check_passes_on_the_committed_readme(capsys):
    """README.md and the results index are what the committed result files give: `make test` fails on a number
    edited by hand inside the markers or a result file changed under it."""
    assert run_cli(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_every_current_run_has_its_files_and_report():
    """Each entry of CURRENT_RUNS names a run directory holding its result files and the report the README links."""
    for source in rr.CURRENT_RUNS.values():
        run = rr.RESULTS_ROOT / source.run_dir
        assert (run / source.report).is_file(), source
        assert all((run / f).is_file() for f in source.files), source


def test_a_changed_result_value_changes_the_generated_text(tmp_path, capsys):
    """A value changed in a result JSON (a copy, through the injectable results root) changes the cell, the
    difference to bare vLLM, and makes --check fail with a diff naming both lines."""
    root = copy_current(tmp_path / "results")
    path = root / rr.CURRENT_RUNS["overhead"].run_dir / rr.CURRENT_RUNS["overhead"].files[0]
    data = json.loads(path.read_text())
    before = rr.results_block(root)
    kvtide, vllm = (data["servers"][s]["levels"]["1"]["repeats"] for s in ("kvtide", "vllm"))
    for mine, base in zip(kvtide, vllm):  # every repeat 5.1 ms over bare vLLM's repeat of the same index
        mine["ttft_s"]["p50"] = base["ttft_s"]["p50"] + 0.0051
    path.write_text(json.dumps(data))
    after = rr.results_block(root)
    assert after != before
    kvtide_row = next(line for line in after.splitlines() if line.startswith("|  | **kvtide** |"))
    assert "(+5.1 (+5.1–+5.1))" in kvtide_row

    readme = tmp_path / "README.md"
    shutil.copyfile(rr.README_PATH, readme)
    assert run_cli(["--check", "--readme", str(readme), "--results-root", str(root)]) == 1
    diff = capsys.readouterr().out
    assert "+5.1" not in next(line for line in diff.splitlines() if line.startswith("-|  | **kvtide**"))
    assert "(+5.1 (+5.1–+5.1))" in next(line for line in diff.splitlines() if line.startswith("+|  | **kvtide**"))


def test_a_hand_edit_inside_the_markers_fails_check_and_a_rewrite_restores_it(tmp_path, capsys):
    """A number typed by hand between the markers fails --check (exit 1, a unified diff); without --check the
    block is written back in place, and prose outside the markers is left as edited."""
    readme = tmp_path / "README.md"
    committed = rr.README_PATH.read_text()
    row = next(line for line in block_of(committed).splitlines() if line.startswith("|  | **kvtide** |"))
    cell = "| **kvtide** |" + row.split("|")[3] + "|"  # kvtide's first TTFT cell, as generated
    assert committed.count(cell) == 1
    edited = committed.replace(cell, "| **kvtide** | 30.0 / 48.1 |").replace("## Results\n", "## Results\n\nHand-written.\n", 1)
    readme.write_text(edited)
    assert run_cli(["--check", "--readme", str(readme)]) == 1
    out = capsys.readouterr()
    assert "-|  | **kvtide** | 30.0 / 48.1 |" in out.out and f"+|  {cell}" in out.out
    assert "differ from the result files" in out.err

    assert run_cli(["--readme", str(readme)]) == 0
    rewritten = readme.read_text()
    assert block_of(rewritten) == block_of(committed) and "Hand-written." in rewritten
    assert run_cli(["--check", "--readme", str(readme)]) == 0


def test_the_current_runs_list_of_the_results_index_is_checked_too(tmp_path, capsys):
    """The "Current runs" list in benchmarks/results/README.md is generated from CURRENT_RUNS: editing it fails --check."""
    root = copy_current(tmp_path / "results")
    index = root / rr.INDEX_NAME
    index.write_text(index.read_text().replace(rr.CURRENT_RUNS["overhead"].run_dir + "/", "some-other-run/", 1))
    assert run_cli(["--check", "--results-root", str(root)]) == 1
    assert "some-other-run" in capsys.readouterr().out


def test_missing_markers_are_an_error_not_a_rewrite(tmp_path, capsys):
    """A README without the marker lines is refused (exit 2, nothing written): the block has no place to go."""
    readme = tmp_path / "README.md"
    readme.write_text("# kvtide\n\n## Results\n\nNo markers.\n")
    assert run_cli(["--readme", str(readme)]) == 2
    assert "marker" in capsys.readouterr().err
    assert readme.read_text() == "# kvtide\n\n## Results\n\nNo markers.\n"


def test_spreads_read_median_min_max_and_a_single_run_a_lone_value():
    """Repeats format as `median (min–max)` (ms scaled, thousands separated); one run as its value; signed
    differences with U+2212 minus and the range's en dash; ratios with ×."""
    assert rr.spread_text([0.0313, 0.0301, 0.0335], scale=1000.0) == "31.3 (30.1–33.5)"
    assert rr.spread_text([0.0313], scale=1000.0) == "31.3"
    assert rr.spread_text([1111.64, 1200.0, 1000.0], fmt="{:,.1f}") == "1,111.6 (1,000.0–1,200.0)"
    assert rr.spread_text([]) == "–"
    assert rr.difference_text([0.031], [0.0331], scale=1000.0) == "\u22122.1"
    assert rr.difference_text([0.031, 0.030, 0.034], [0.033, 0.033, 0.033], scale=1000.0) == "\u22122.0 (\u22123.0–+1.0)"
    assert rr.ratio_text([2.0, 3.0, 4.0], [2.0, 2.0, 2.0]) == "1.50× (1.00–2.00)"


def test_a_caption_labels_one_run_as_no_claim_and_repeats_as_median_min_max():
    """One run's caption says a difference within run-to-run noise is not a claim; repeats give their count."""
    assert rr.repeats_text([1], "server") == "one run per server; a difference within run-to-run noise is not a claim"
    assert rr.repeats_text([3, 3], "policy") == "3 runs per policy; cells are median (min–max) over them"
    assert rr.repeats_text([2, 3]) == "2–3 runs; cells are median (min–max) over them"
    committed = " ".join(block_of(rr.README_PATH.read_text()).split())  # the prose is wrapped
    assert committed.count("3 runs per server; cells are median (min–max) over them") == 1
    assert committed.count(f"one run per policy; {rr.NOT_A_CLAIM}") == 1
    assert committed.count(f"one run per variant; {rr.NOT_A_CLAIM}") == 1


def _level(ttft_p50_s: float, tok_s: float) -> dict:
    return {"num_requests": 200, "num_errors": 0, "ttft_s": {"p50": ttft_p50_s, "p99": 2 * ttft_p50_s},
            "itl_mean_s": 0.005, "itl_p99_s": 0.006, "e2e_s": {"p50": 0.65}, "output_tokens_per_s": tok_s}


def test_the_overhead_table_reads_the_protocols_repeats():
    """A results.json of the repeated protocol (servers.<s>.levels.<c>) gives median (min–max) cells and ratios
    and differences paired by repeat, and its caption counts the repeats."""
    runs = {"vllm": [{1: _level(0.033, 195.0)}, {1: _level(0.034, 190.0)}, {1: _level(0.032, 200.0)}],
            "kvtide": [{1: _level(0.031, 195.0)}, {1: _level(0.033, 209.0)}, {1: _level(0.030, 200.0)}]}
    levels = server_levels(runs)
    data = json.loads(json.dumps({"repeats": 3, "servers": {s: {"levels": levels[s]} for s in runs}}))
    rows = rr.overhead_table(data)
    kvtide = next(line for line in rows if "**kvtide**" in line)
    assert "31.0 (30.0–33.0) / 62.0 (60.0–66.0) (\u22122.0 (\u22122.0–\u22121.0))" in kvtide
    assert "200 (195–209) (1.00× (1.00–1.10))" in kvtide
    assert rr.repeats_text([rr._runs_of(data)], "server").startswith("3 runs per server")


def _compare_run(policy: str, goodput: list[float], p90: list[float]) -> dict:
    return {"workload": "shared-prefix", "policy": policy, "offered_rate_per_s": 8.0, "slo_ttft_s": 1.0,
            "goodput_requests_per_s": sorted(goodput)[1], "ttft_s": {"p50": 0.1, "p90": sorted(p90)[1]},
            "prefix_cache_hit_rate": 0.8, "oracle_hit_rate": 0.82,
            "repeats": {"n": 3, "goodput_requests_per_s": goodput, "ttft_p50_s": [0.1, 0.1, 0.1], "ttft_p90_s": p90,
                        "itl_mean_s": [0.01] * 3, "output_tokens_per_s": [100.0] * 3,
                        "prefix_cache_hit_rate": [0.8, 0.7, 0.9]}}


def test_routing_cells_over_repeats_bold_the_highlighted_policy_where_its_median_is_best():
    """A compare results.json with repeats gives median (min–max) cells; the highlighted policy is bold where its
    median is the best of the row, not where another policy's is."""
    runs = {"pow2": _compare_run("pow2", [3.0, 3.2, 3.1], [3.0, 3.3, 3.2]),
            "prefix_aware": _compare_run("prefix_aware", [7.7, 7.9, 7.8], [0.6, 0.7, 0.65])}
    assert rr._cell(runs, "prefix_aware", "goodput_requests_per_s", "{:.2f}", True) == "**7.80 (7.70–7.90)**"
    assert rr._cell(runs, "pow2", "goodput_requests_per_s", "{:.2f}", True) == "3.10 (3.00–3.20)"
    # Both policies tie on TTFT p50 (a tie is best for both), prefix_aware alone is best on p90.
    assert rr._ttft_cell(runs, "prefix_aware") == "**0.100 (0.100–0.100) / 0.650 (0.600–0.700)**"
    assert rr._vs(runs, "goodput_requests_per_s", "pow2") == "2.52× (2.47–2.57)"  # repeat i over repeat i, then median (min–max)
