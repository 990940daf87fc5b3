"""The overhead benchmark's per-level summary, its summaries over repeats, report and results.json (from hand-built
request results), and its engine-settings helpers."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtide.benchmarks.overhead import (
    level_summary,
    main,
    markdown,
    paths_markdown,
    resolve_engine_configs_here,
    server_levels,
    write_report,
)
from kvtide.benchmarks.protocol import engine_config_differences, schedule
from kvtide.benchmarks.processes import vllm_cli_flags
from kvtide.benchmarks.report import RequestResult


def _result(ttft_s: float, e2e_s: float, tokens: int, gaps: tuple[float, ...] = ()) -> RequestResult:
    return RequestResult(ok=True, start_s=0.0, e2e_s=e2e_s, ttft_s=ttft_s, itl_s=gaps, num_output_tokens=tokens)


def test_itl_mean_is_the_decode_pace_and_throughput_counts_tokens_over_the_level():
    """ITL mean averages (e2e - ttft) / (tokens - 1) per request; tok/s is output tokens over the level's span."""
    results = [_result(0.1, 1.1, 11, (0.1,) * 10), _result(0.2, 2.2, 11, (0.2,) * 10),
               RequestResult(ok=False, start_s=0.0, e2e_s=0.5, error="HTTP 500")]
    summary = level_summary(results, duration_s=4.0)
    assert summary["num_requests"] == 3 and summary["num_errors"] == 1
    assert summary["itl_mean_s"] == pytest.approx((0.1 + 0.2) / 2)
    assert summary["output_tokens_per_s"] == pytest.approx(22 / 4.0)
    assert summary["ttft_s"]["p50"] == pytest.approx(0.15)


def _level(ttft_p50_s: float, itl_mean_s: float, tokens_per_s: float, e2e_p50_s: float) -> dict:
    return {"num_requests": 10, "num_errors": 0, "ttft_s": {"p50": ttft_p50_s, "p99": 0.05},
            "itl_mean_s": itl_mean_s, "itl_p99_s": 0.02, "output_tokens_per_s": tokens_per_s,
            "e2e_s": {"p50": e2e_p50_s}}


def _args(repeats: int = 3) -> argparse.Namespace:
    return argparse.Namespace(input_len=512, output_len=128, num_requests=200, duration=60.0, repeats=repeats,
                              warmup_requests=128, concurrency=[16, 64])


# Three repeats of one level: kvtide's TTFT range sits wholly above bare vLLM's, its ITL ranges overlap,
# its throughput range wholly below, its e2e wholly below.
KVTIDE_RUNS = [{16: _level(0.030, 0.0105, 950.0, 1.2)}, {16: _level(0.031, 0.0101, 940.0, 1.1)},
               {16: _level(0.029, 0.0110, 960.0, 1.3)}]
VLLM_RUNS = [{16: _level(0.028, 0.0100, 1000.0, 1.5)}, {16: _level(0.027, 0.0103, 1010.0, 1.4)},
             {16: _level(0.026, 0.0099, 990.0, 1.6)}]


def test_levels_hold_every_repeat_the_spread_of_each_metric_and_ratios_paired_by_repeat():
    """server_levels keeps each repeat's summary, each metric's median/min/max over repeats, and per-repeat ratios
    to bare vLLM (repeat i / vLLM's repeat i) with a verdict per metric; bare vLLM has no ratios to itself."""
    levels = server_levels({"kvtide": KVTIDE_RUNS, "vllm": VLLM_RUNS})
    entry = levels["kvtide"][16]
    assert entry["repeats"] == [run[16] for run in KVTIDE_RUNS]
    assert entry["metrics"]["ttft_p50_s"] == {"median": 0.030, "min": 0.029, "max": 0.031, "n": 3,
                                              "values": [0.030, 0.031, 0.029]}
    assert {"ttft_p50_s", "ttft_p99_s", "itl_mean_s", "itl_p99_s", "output_tokens_per_s",
            "e2e_p50_s"} == set(entry["metrics"]) == set(entry["vs_vllm"])
    ttft = entry["vs_vllm"]["ttft_p50_s"]
    assert ttft["ratio"]["values"] == pytest.approx([0.030 / 0.028, 0.031 / 0.027, 0.029 / 0.026])
    assert ttft["difference"]["values"] == pytest.approx([0.002, 0.004, 0.003])
    assert {key: v["verdict"] for key, v in entry["vs_vllm"].items()} == {
        "ttft_p50_s": "worse", "ttft_p99_s": "no difference", "itl_mean_s": "no difference",
        "itl_p99_s": "no difference", "output_tokens_per_s": "worse", "e2e_p50_s": "better"}
    assert "vs_vllm" not in levels["vllm"][16]


def test_a_failed_repeat_is_skipped_and_breaks_only_its_own_pair():
    """A repeat that did not run is null in `repeats`, left out of n, and pairs with nothing."""
    levels = server_levels({"kvtide": [KVTIDE_RUNS[0], None, KVTIDE_RUNS[2]], "vllm": VLLM_RUNS})
    entry = levels["kvtide"][16]
    assert entry["repeats"][1] is None and entry["metrics"]["ttft_p50_s"]["n"] == 2
    assert entry["vs_vllm"]["output_tokens_per_s"]["ratio"]["values"][1] is None
    assert entry["vs_vllm"]["output_tokens_per_s"]["ratio"]["n"] == 2


def test_report_cells_are_median_and_range_with_verdicts_against_bare_vllm():
    """Each cell is median (min–max) over repeats; the vs-vLLM row carries TTFT p50 minus vLLM's, paired ratios and
    "no difference" where the ranges overlap; the report states repeats and the alternated order."""
    order = schedule(["kvtide", "vllm"], 3)
    text = markdown(server_levels({"kvtide": KVTIDE_RUNS, "vllm": VLLM_RUNS}), _args(), "cmd", "NVIDIA H200", order)
    assert "Hardware: NVIDIA H200" in text
    assert ("| kvtide | 16 | 3 | 30 (0) | 30.0 (29.0–31.0) | 50.0 (50.0–50.0) | 10.5 (10.1–11.0) "
            "| 20.0 (20.0–20.0) | 950 (940–960) | 1200.0 (1100.0–1300.0) |") in text
    assert ("| kvtide | 16 | +3.0 (+2.0–+4.0) | 1.12× (1.07–1.15) worse | 1.00× (1.00–1.00) no difference "
            "| 1.05× (0.98–1.11) no difference | 1.00× (1.00–1.00) no difference | 0.95× (0.93–0.97) worse "
            "| 0.80× (0.79–0.81) better |") in text
    assert "3 measured runs per server in alternated order" in text
    assert "kvtide warm-up → vllm warm-up → kvtide #1 → vllm #1 → kvtide #2" in text
    assert "Warning" not in text


def test_fewer_than_three_repeats_warn_that_claims_need_three():
    """A report of one or two repeats says it is too few to tell a difference from noise."""
    text = markdown(server_levels({"kvtide": KVTIDE_RUNS[:1], "vllm": VLLM_RUNS[:1]}), _args(repeats=1), "cmd", "CPU",
                    schedule(["kvtide", "vllm"], 1))
    assert "**Warning: 1 repeat per server" in text and "A claim needs 3 or more" in text


def test_repeats_below_one_are_refused_before_anything_starts(capsys):
    """--repeats 0 is a usage error (exit 2), raised while parsing: no server, config or model is touched."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--repeats", "0"])
    assert exit_info.value.code == 2 and "expected 1 or more" in capsys.readouterr().err


PROVENANCE = {"kvtide_commit": "abc123", "versions": {"vllm": "0.29.0", "ray": "2.60.0", "torch": None,
                                                      "python": "3.11.7"},
              "gpu": None, "host": {"system": "Linux", "release": "6", "machine": "x86_64", "cpu_count": 2},
              "command": "python3 -m kvtide.benchmarks.overhead --repeats 3", "utc": "2030-01-02T03:04:05+00:00"}


def test_results_json_holds_provenance_repeats_order_engine_configs_and_levels(tmp_path):
    """results.json: top-level provenance, repeats, the order as [server, repeat] (-1 the warm-up), whether the
    engines resolved alike; per server its engine_config and levels (repeats, metrics, vs_vllm); the report
    prints the provenance and the engine settings."""
    args = _args()
    args.out_dir, args.hardware, args.vllm_bench, args.ttft_paths = str(tmp_path), "NVIDIA H200", 0, 0
    config = {"max_num_batched_tokens": 8192, "block_size": 16}
    engine = {"servers": {"kvtide": {"engine_config": config, "engine_config_note": None},
                          "vllm": {"engine_config": {**config, "max_num_batched_tokens": 2048},
                                   "engine_config_note": None}},
              "equal": False, "differences": ["kvtide.max_num_batched_tokens: 8192 vs vllm 2048"]}
    order = schedule(["kvtide", "vllm"], 3)
    write_report({"kvtide": KVTIDE_RUNS, "vllm": VLLM_RUNS}, {}, {}, {}, {}, engine, order, PROVENANCE, args,
                 model="m", kwargs={"model": "m"}, log_dir=tmp_path, final=False)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["provenance"] == PROVENANCE and data["repeats"] == 3
    assert data["order"][:3] == [["kvtide", -1], ["vllm", -1], ["kvtide", 0]]
    assert data["engine_config_equal"] is False and data["engine_config_differences"]
    assert data["servers"]["kvtide"]["engine_config"] == config
    level = data["servers"]["kvtide"]["levels"]["16"]
    assert len(level["repeats"]) == 3 and level["metrics"]["output_tokens_per_s"]["median"] == 950.0
    assert level["vs_vllm"]["output_tokens_per_s"]["verdict"] == "worse"
    report = (tmp_path / "report.md").read_text()
    assert "kvtide commit: abc123" in report and "**Engine settings differ:** kvtide.max_num_batched_tokens" in report
    assert "| max_num_batched_tokens | 8192 | 2048 |" in report


def test_kvtide_and_bare_vllm_resolve_the_same_engine_from_the_benchmarks_kwargs(tmp_path):
    """The driver's engine_config helpers (kvtide's replica path, bare vLLM's CLI path) agree on the default
    config's engine kwargs, as resolve_engine_configs' child runs them."""
    from kvtide.config import default_config_path, load_config
    from kvtide.deployments.engine.demo_model import resolve_model
    from kvtide.deployments.engine.placement import engine_kwargs

    config = load_config(default_config_path(), [])
    kwargs = engine_kwargs(config, resolve_model(config.model))
    specs, out = tmp_path / "specs.json", tmp_path / "configs.json"
    specs.write_text(json.dumps({"kvtide": {"path": "kvtide", "kwargs": kwargs},
                                 "vllm": {"path": "vllm", "kwargs": kwargs}}))
    resolve_engine_configs_here(str(specs), str(out))
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    assert engine_config_differences(data["configs"], "vllm") == (True, [])


def test_engine_kwargs_become_vllm_flags():
    """Booleans become --x / --no-x, None is dropped, names are dashed: bare vLLM runs the identical engine."""
    flags = vllm_cli_flags({"max_model_len": 4096, "enforce_eager": True, "enable_prefix_caching": False,
                            "kv_cache_memory_bytes": None, "disable_log_stats": False})
    assert flags == ["--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching"]


def test_ttft_paths_table_splits_the_path_into_haproxy_plus_consult_and_replica():
    """paths_markdown states full − replica (HAProxy + consult) and replica − bare (replica + engine) from the p50s."""
    def stat(p50: float) -> dict:
        return {"p50": p50, "p90": p50 + 0.002, "p99": p50 + 0.004, "mean": p50 + 0.001, "n": 60}

    text = paths_markdown({"full": stat(0.045), "consult": stat(0.003), "replica": stat(0.040), "bare": stat(0.034)}, 60)
    assert "| full | 45.0 | 47.0 | 46.0 | 60 |" in text
    assert "(full − replica): +5.0 ms" in text and "(replica − bare): +6.0 ms" in text
    assert "full − replica" not in paths_markdown({"bare": stat(0.034)}, 60)  # no split without all three
