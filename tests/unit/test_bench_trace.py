"""`kvtide bench trace` (benchmarks/trace_replay.py): the pure parts, no server and no aiperf run."""

from __future__ import annotations

import argparse
import json
import pytest

from kvtide.benchmarks.trace_replay import (
    AIPERF_VERSION,
    VLLM_BENCH_RESULT_FILE,
    AiperfOptions,
    VllmBenchOptions,
    baseline_policy,
    compare_markdown,
    summarize_trace_runs,
    vllm_bench_command,
    vllm_bench_env,
    parse_vllm_bench_result,
    ScaleOptions,
    TraceRequest,
    aiperf_command,
    aiperf_env,
    aiperf_venv_commands,
    default_repo_id,
    default_trace_path,
    hub_cache_layout,
    infinite_cache_hit_rate,
    parse_aiperf_records,
    parse_aiperf_summary,
    parse_trace,
    prefix_cache_delta,
    records_report,
    redacted,
    scale_trace,
    scaling_record,
    trace_lines,
    trace_summary,
    write_trace,
)


def req(ts_ms: float, ids: tuple[int, ...], out: int = 10) -> TraceRequest:
    return TraceRequest(ts_ms, len(ids) * 512, out, ids)


# A hand-made trace: arrival 0, 1000, 2000, 3000 ms; request 2 shares request 0's first two blocks,
# request 3 repeats request 1 and goes on.
TRACE = [req(0, (1, 2, 3)), req(1000, (7,), 40), req(2000, (1, 2, 9, 10, 11)), req(3000, (7, 8), 3)]


def test_parse_trace_reads_the_mooncake_fields_and_names_a_bad_line():
    """Each line's timestamp (ms), lengths and hash ids are read; a malformed line is named by number."""
    lines = ['{"timestamp": 40, "input_length": 1000, "output_length": 6, "hash_ids": [4, 5]}', "",
             '{"timestamp": 0, "input_length": 10}']
    assert parse_trace(lines[:2]) == [TraceRequest(40.0, 1000, 6, (4, 5))]
    with pytest.raises(ValueError, match="trace line 3"):
        parse_trace(lines)


def test_block_tokens_set_each_prompt_to_whole_blocks():
    """A prompt becomes len(hash_ids) * block_tokens tokens; output lengths and ids are kept when unscaled."""
    scaled = scale_trace(TRACE, ScaleOptions(block_tokens=16))
    assert [r.input_length for r in scaled.requests] == [48, 16, 80, 32]
    assert [r.output_length for r in scaled.requests] == [10, 40, 10, 3]
    assert [r.hash_ids for r in scaled.requests] == [r.hash_ids for r in TRACE]


def test_time_scale_multiplies_timestamps_after_rebasing_to_the_first_request():
    """--time-scale 2 doubles every gap (half the rate); the first request sent is at 0."""
    scaled = scale_trace(TRACE, ScaleOptions(block_tokens=16, time_scale=2.0, start_s=1.0))
    assert [r.timestamp_ms for r in scaled.requests] == [0.0, 2000.0, 4000.0]
    assert trace_summary(scaled.requests)["span_s"] == 4.0
    assert trace_summary(scaled.requests)["offered_rate_per_s"] == pytest.approx(3 / 4.0)


def test_output_scale_rounds_keeps_one_token_and_caps():
    """--output-scale multiplies and rounds output lengths, never below 1, never above --max-output-tokens."""
    scaled = scale_trace(TRACE, ScaleOptions(block_tokens=16, output_scale=0.1, max_output_tokens=3))
    assert [r.output_length for r in scaled.requests] == [1, 3, 1, 1]


def test_window_keeps_requests_from_start_for_duration():
    """--start-s / --duration-s keep original timestamps in [start, start + duration)."""
    scaled = scale_trace(TRACE, ScaleOptions(block_tokens=16, start_s=1.0, duration_s=2.0))
    assert [r.hash_ids for r in scaled.requests] == [(7,), (1, 2, 9, 10, 11)]
    assert (scaled.num_in_window, scaled.num_source) == (2, 4)


def test_over_long_requests_are_dropped_or_truncated_to_whole_blocks():
    """A prompt over --max-input-tokens is dropped, or truncated to its first max // B blocks."""
    options = ScaleOptions(block_tokens=16, max_input_tokens=40)
    dropped = scale_trace(TRACE, options)
    assert [r.hash_ids for r in dropped.requests] == [(7,), (7, 8)]
    assert (dropped.num_dropped_over_long, dropped.num_truncated) == (2, 0)
    cut = scale_trace(TRACE, ScaleOptions(block_tokens=16, max_input_tokens=40, over_long="truncate"))
    assert [r.hash_ids for r in cut.requests] == [(1, 2), (7,), (1, 2), (7, 8)]
    assert [r.input_length for r in cut.requests] == [32, 16, 32, 32]
    assert (cut.num_dropped_over_long, cut.num_truncated) == (0, 2)


def test_limit_counts_requests_sent_and_timestamps_rebase_to_the_first_kept():
    """--limit keeps the first N requests left after dropping; the drops counted are those walked past."""
    scaled = scale_trace(TRACE, ScaleOptions(block_tokens=16, max_input_tokens=40, limit=1))
    assert [(r.timestamp_ms, r.hash_ids) for r in scaled.requests] == [(0.0, (7,))]
    assert (scaled.num_dropped_over_long, scaled.num_cut_by_limit) == (1, 2)
    record = scaling_record(ScaleOptions(block_tokens=16, max_input_tokens=40, limit=1), scaled)
    assert (record["num_sent"], record["num_dropped_over_long"], record["block_tokens"]) == (1, 1, 16)
    assert record["source_block_tokens"] == 512 and len(record["rules"]) == 6


def test_ties_keep_file_order_and_unsorted_input_is_sent_in_time_order():
    """Send order is timestamp order; requests with equal timestamps keep the order the file lists them in."""
    trace = [req(5, (3,)), req(0, (1,)), req(0, (2,))]
    assert [r.hash_ids for r in scale_trace(trace, ScaleOptions(block_tokens=8)).requests] == [(1,), (2,), (3,)]


def test_equal_hash_ids_stay_equal_under_scaling(tmp_path):
    """Every id keeps one size (B tokens) wherever it appears, so aiperf maps it to one block of tokens."""
    scaled = scale_trace(TRACE, ScaleOptions(block_tokens=16, max_input_tokens=48, over_long="truncate",
                                             time_scale=0.5, output_scale=2.0))
    for r in scaled.requests:
        assert r.input_length == 16 * len(r.hash_ids)
    assert scaled.requests[0].hash_ids[:2] == scaled.requests[2].hash_ids[:2] == (1, 2)
    path = tmp_path / "t.jsonl"
    write_trace(scaled.requests, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["hash_ids"][:2] == rows[2]["hash_ids"][:2] == [1, 2]
    assert set(rows[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}


def test_written_trace_round_trips_and_its_hash_follows_its_content(tmp_path):
    """The scaled file reads back as written; a different time scale gives another file hash (aiperf's token seed)."""
    a = scale_trace(TRACE, ScaleOptions(block_tokens=16))
    b = scale_trace(TRACE, ScaleOptions(block_tokens=16, time_scale=2.0))
    sha_a = write_trace(a.requests, tmp_path / "a.jsonl")
    assert parse_trace((tmp_path / "a.jsonl").read_text().splitlines()) == a.requests
    assert sha_a != write_trace(b.requests, tmp_path / "b.jsonl")
    assert trace_lines(a.requests)[1].startswith('{"timestamp": 1000, ')


def test_infinite_cache_hit_rate_on_a_hand_made_trace():
    """Blocks whose id was seen earlier / all blocks: 2 (ids 1, 2) + 1 (id 7) of 11 blocks."""
    assert infinite_cache_hit_rate(TRACE) == pytest.approx(3 / 11)
    assert infinite_cache_hit_rate([req(0, (1, 1))]) == pytest.approx(1 / 2)
    assert infinite_cache_hit_rate([]) is None


def test_scale_options_refuse_settings_that_send_nothing_sensible():
    """Zero block size, a cap below one block, a non-positive scale or an unknown mode fail at once."""
    for bad in ({"block_tokens": 0}, {"block_tokens": 16, "max_input_tokens": 8}, {"block_tokens": 16, "time_scale": 0},
                {"block_tokens": 16, "over_long": "wrap"}, {"block_tokens": 16, "limit": 0}):
        with pytest.raises(ValueError):
            ScaleOptions(**bad)


def test_tokenizer_is_laid_out_as_a_hub_cache_entry(tmp_path):
    """snapshots/REV holds the tokenizer files (no weights), refs/main names REV; same files, same REV."""
    model = tmp_path / "my model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "model.safetensors.index.json").write_text("{}")
    repo_id = default_repo_id(model)
    assert repo_id == "kvtide-local/my-model"
    snapshot = hub_cache_layout(model, tmp_path / "hf", repo_id)
    repo_dir = tmp_path / "hf" / "hub" / "models--kvtide-local--my-model"
    assert snapshot.parent == repo_dir / "snapshots"
    assert (repo_dir / "refs" / "main").read_text() == snapshot.name and len(snapshot.name) == 40
    assert sorted(p.name for p in snapshot.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert hub_cache_layout(model, tmp_path / "hf", repo_id) == snapshot
    assert default_repo_id(model, "meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"


def test_a_folder_without_tokenizer_files_is_refused(tmp_path):
    """A folder holding no tokenizer file fails with its path named, before aiperf starts."""
    with pytest.raises(ValueError, match="no tokenizer files"):
        hub_cache_layout(tmp_path, tmp_path / "hf", "a/b")


def test_aiperf_command_from_the_options(tmp_path):
    """The aiperf argv: mooncake trace at block size B, fixed schedule, streaming, goodput SLO, records export."""
    options = AiperfOptions(aiperf_bin="/v/bin/aiperf", base_url="http://127.0.0.1:8000", model="demo",
                            tokenizer_repo_id="kvtide-local/demo", trace_path=tmp_path / "trace.jsonl",
                            artifact_dir=tmp_path / "aiperf", block_tokens=32, slo_ttft_ms=500.0,
                            cache_salt="s1", api_key="secret")
    command = aiperf_command(options)
    flags = {command[i]: command[i + 1] for i in range(2, len(command) - 1) if command[i].startswith("--")}
    assert command[:2] == ["/v/bin/aiperf", "profile"]
    assert flags["--custom-dataset-type"] == "mooncake_trace" and flags["--isl-block-size"] == "32"
    assert flags["--input-file"] == str(tmp_path / "trace.jsonl")
    assert flags["--artifact-dir"] == str(tmp_path / "aiperf") and flags["--export-level"] == "records"
    assert flags["--tokenizer"] == "kvtide-local/demo" and flags["--url"] == "http://127.0.0.1:8000"
    assert flags["--goodput"] == "time_to_first_token:500"
    assert json.loads(flags["--extra-inputs"]) == {"ignore_eos": True, "cache_salt": "s1"}
    assert {"--fixed-schedule", "--streaming", "--no-server-metrics", "--use-server-token-count"} <= set(command)
    assert "secret" not in redacted(command) and "--api-key REDACTED" in redacted(command)
    no_salt = aiperf_command(AiperfOptions(**{**options.__dict__, "cache_salt": None, "api_key": None}))
    assert "cache_salt" not in no_salt[no_salt.index("--extra-inputs") + 1] and "--api-key" not in no_salt


def test_aiperf_runs_offline_against_the_laid_out_hub_cache(tmp_path):
    """aiperf's environment points HF_HOME at the layout and forces offline mode; its venv pins the version."""
    env = aiperf_env(tmp_path, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    venv, install = aiperf_venv_commands(tmp_path / "venv", python="python3")
    assert venv == ["python3", "-m", "venv", str(tmp_path / "venv")]
    assert install[-1] == f"aiperf=={AIPERF_VERSION}" and install[0] == str(tmp_path / "venv" / "bin" / "python")


# aiperf 0.13's per-request export as a real run wrote it (benchmarks/results/trace-cpu-demo), cut to the
# fields read and a few beside them, values rounded: a success carries no `error` key. The failed request
# (an `error` of aiperf's ErrorDetails shape: code, type, message) and the warm-up record are written by hand.
def _record(num: int, start_ns: int, end_ns: int, ttft_ms: float | None, phase: str = "profiling") -> dict:
    metrics = {} if ttft_ms is None else {
        "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
        "request_latency": {"value": (end_ns - start_ns) / 1e6, "unit": "ms"},
        "output_sequence_length": {"value": 12, "unit": "tokens"},
        "inter_chunk_latency": {"value": [6.56, 6.83], "unit": "ms"}}
    return {"metadata": {"session_num": num, "x_correlation_id": f"fixed-schedule-session_{num:06d}",
                         "conversation_id": f"session_{num:06d}", "turn_index": 0,
                         "credit_issued_ns": start_ns - 1_000, "request_start_ns": start_ns,
                         "request_ack_ns": start_ns + 1_000, "request_end_ns": end_ns, "worker_id": "worker_9f938260",
                         "benchmark_phase": phase, "phase_name": phase, "was_cancelled": False}, "metrics": metrics}


RECORDS_JSONL = "\n".join(json.dumps(row, separators=(",", ":")) for row in [
    _record(0, 1_000_000_000, 1_400_000_000, 60.0),
    _record(1, 1_500_000_000, 2_300_000_000, 150.0),
    _record(2, 2_000_000_000, 2_900_000_000, 90.0),
    {**_record(3, 2_500_000_000, 3_000_000_000, None),
     "error": {"code": 400, "type": "Bad Request", "message": "prompt too long"}},
    _record(4, 0, 500_000_000, 5000.0, phase="warmup"),
]) + "\n"
SUMMARY_JSON = json.dumps({  # profile_export_aiperf.json: one entry per metric tag, cut to a few
    "schema_version": "1.4", "aiperf_version": AIPERF_VERSION, "benchmark_id": "b1",
    "time_to_first_token": {"unit": "ms", "avg": 100.0, "p1": 60.6, "p50": 90.0, "p90": 138.0, "p99": 148.8,
                            "min": 60.0, "max": 150.0, "std": 37.4, "count": 3, "sum": 300.0},
    "request_latency": {"unit": "ms", "avg": 700.0, "p50": 800.0, "p90": 880.0, "count": 3},
    "goodput": {"unit": "requests/sec", "avg": 1.0},
    "request_count": {"unit": "requests", "avg": 3.0},
})


def test_parse_a_captured_aiperf_export():
    """aiperf's records give TTFT/e2e percentiles, errors and goodput (warm-up left out); its summary is kept."""
    records = parse_aiperf_records(RECORDS_JSONL)
    assert len(records) == 4 and sum(not r.ok for r in records) == 1
    report = records_report(records, slo_ttft_ms=100.0)
    assert report["num_requests"] == 4 and report["num_errors"] == 1
    ok_ttfts = sorted(r.ttft_ms for r in records if r.ok)
    assert report["ttft_ms"]["p50"] == pytest.approx(ok_ttfts[1])
    assert report["duration_s"] == pytest.approx((max(r.end_ns for r in records) - min(r.start_ns for r in records)) / 1e9)
    within = sum(1 for t in ok_ttfts if t <= 100.0)
    assert report["goodput_requests_per_s"] == pytest.approx(within / report["duration_s"])
    assert report["ttft_ms"] == {"p50": 90.0, "p90": pytest.approx(138.0)}
    assert report["e2e_ms"]["p90"] == pytest.approx(880.0)
    summary = parse_aiperf_summary(SUMMARY_JSON)
    assert summary["aiperf_version"] == AIPERF_VERSION
    assert summary["time_to_first_token"] == {"unit": "ms", "avg": 100.0, "p50": 90.0, "p90": 138.0, "p99": 148.8}
    assert "error_request_count" not in summary


def test_records_report_with_no_records_has_no_rates():
    """An aiperf run that exported nothing reports zero requests and null statistics, not a crash."""
    report = records_report([], slo_ttft_ms=100.0)
    assert (report["num_requests"], report["requests_per_s"], report["ttft_ms"]["p50"]) == (0, None, None)


RAY_BEFORE = """\
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{ReplicaId="a",model_name="demo"} 1000.0
ray_vllm_prefix_cache_queries_total{ReplicaId="b",model_name="demo"} 500.0
# TYPE ray_vllm_prefix_cache_hits_total counter
ray_vllm_prefix_cache_hits_total{ReplicaId="a",model_name="demo"} 100.0
ray_vllm_prefix_cache_hits_total{ReplicaId="b",model_name="demo"} 0.0
"""
RAY_AFTER = RAY_BEFORE.replace("} 1000.0", "} 3000.0").replace("} 500.0", "} 1500.0").replace(
    'a",model_name="demo"} 100.0', 'a",model_name="demo"} 700.0').replace('b",model_name="demo"} 0.0',
                                                                         'b",model_name="demo"} 400.0')


def test_prefix_cache_delta_from_two_metrics_texts():
    """Hits and queries are summed over replicas and differenced: (600 + 400) / (2000 + 1000)."""
    delta = prefix_cache_delta(RAY_BEFORE, RAY_AFTER)
    assert (delta["hits_tokens"], delta["queries_tokens"]) == (1000.0, 3000.0)
    assert delta["hit_rate"] == pytest.approx(1 / 3)


def test_prefix_cache_delta_reads_bare_vllm_names_and_no_queries_as_no_rate():
    """Bare vLLM's `vllm:` counters count too; an idle interval has no hit rate rather than zero."""
    bare = ("# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{engine=\"0\"} {q}\n"
            "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine=\"0\"} {h}\n")
    before, after = bare.replace("{q}", "10").replace("{h}", "0"), bare.replace("{q}", "50").replace("{h}", "30")
    assert prefix_cache_delta(before, after)["hit_rate"] == pytest.approx(30 / 40)
    assert prefix_cache_delta(before, before)["hit_rate"] is None


def test_bench_trace_is_registered_with_scaling_flags():
    """`kvtide bench trace` parses the server, tokenizer and scaling flags; --time-scale takes a list."""
    from kvtide.benchmarks.cli import register

    parser = argparse.ArgumentParser(prog="kvtide")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "trace", "--base-url", "http://127.0.0.1:8000", "--metrics-url",
                              "http://127.0.0.1:8080/metrics", "--model", "demo", "--tokenizer", "tok",
                              "--out-dir", "o", "--block-tokens", "16", "--max-input-tokens", "1000",
                              "--time-scale", "2,1", "--limit", "40", "--over-long", "truncate"])
    assert (args.block_tokens, args.max_input_tokens, args.time_scale, args.limit) == (16, 1000, [2.0, 1.0], 40)
    assert args.over_long == "truncate" and args.cache_salt == "auto" and args.func.func.__name__ == "cmd_trace"
    assert args.client == "aiperf" and args.policies is None
    compare = parser.parse_args(["bench", "trace", "--policies", "prefix_aware,bare", "--repeats", "3", "--client",
                                 "vllm-bench", "--tokenizer", "tok", "--out-dir", "o", "--block-tokens", "16",
                                 "--set", "replicas.num_replicas=2"])
    assert (compare.policies, compare.repeats, compare.client, compare.overrides) == (
        "prefix_aware,bare", 3, "vllm-bench", ["replicas.num_replicas=2"])


def test_default_trace_is_the_shared_one_next_to_the_checkout(tmp_path):
    """Without --trace the shared synthetic trace is found from the repository root, or the error says where."""
    with pytest.raises(ValueError, match="pass --trace"):
        default_trace_path(tmp_path)
    (tmp_path / "shared" / "traces").mkdir(parents=True)
    (tmp_path / "shared" / "traces" / "mooncake-synthetic.jsonl").write_text("")
    assert default_trace_path(tmp_path) == tmp_path / "shared" / "traces" / "mooncake-synthetic.jsonl"


def test_vllm_bench_command_replays_the_scaled_trace_at_its_timestamps(tmp_path):
    """vllm bench serve's argv: timed_trace at block size B in ms, every request, no test request, detail saved."""
    options = VllmBenchOptions(base_url="http://127.0.0.1:8000", model="demo", tokenizer_dir="/m/tok",
                               trace_path=tmp_path / "trace.jsonl", artifact_dir=tmp_path / "vb", block_tokens=32,
                               num_requests=40, slo_ttft_ms=500.0, cache_salt="s1", random_seed=7, api_key="secret",
                               python="py")
    command = vllm_bench_command(options)
    flags = {command[i]: command[i + 1] for i in range(len(command) - 1) if command[i].startswith("--")}
    assert command[:2] == ["py", "-c"] and "BenchmarkServingSubcommand" in command[2]
    assert (flags["--dataset-name"], flags["--dataset-path"]) == ("timed_trace", str(tmp_path / "trace.jsonl"))
    assert (flags["--timed-trace-chunk-hash-size"], flags["--timed-trace-sec-multiplier"]) == ("32", "0.001")
    assert (flags["--num-prompts"], flags["--ready-check-timeout-sec"], flags["--num-warmups"]) == ("40", "0", "0")
    assert (flags["--backend"], flags["--endpoint"], flags["--goodput"]) == ("openai", "/v1/completions", "ttft:500")
    assert (flags["--result-dir"], flags["--result-filename"]) == (str(tmp_path / "vb"), VLLM_BENCH_RESULT_FILE)
    assert json.loads(flags["--extra-body"]) == {"cache_salt": "s1"} and "--save-detailed" in command
    assert "secret" not in " ".join(command)
    env = vllm_bench_env(options, {"PATH": "/bin", "OPENAI_API_KEY": "other"})
    assert (env["PYTHONHASHSEED"], env["OPENAI_API_KEY"], env["HF_HUB_OFFLINE"]) == ("7", "secret", "1")
    keyless = VllmBenchOptions(**{**options.__dict__, "api_key": None, "cache_salt": None})
    assert "OPENAI_API_KEY" not in vllm_bench_env(keyless, {"OPENAI_API_KEY": "other"})
    assert "--extra-body" not in vllm_bench_command(keyless)


# `vllm bench serve --save-detailed` result, cut to the fields read and a few beside them (vLLM 0.26's keys):
# three requests, the third failed (error text, no tokens).
VLLM_BENCH_JSON = json.dumps({
    "date": "20261206-120000", "backend": "openai", "duration": 2.5, "completed": 2, "failed": 1,
    "request_throughput": 0.8, "request_goodput": 0.4, "p50_ttft_ms": 150.0, "p90_ttft_ms": 190.0,
    "p99_ttft_ms": 199.0, "p90_e2el_ms": 560.0, "mean_ttft_ms": 150.0,
    "start_times": [100.0, 100.5, 101.0], "ttfts": [0.1, 0.2, 0.0], "itls": [[0.05, 0.05], [0.1, 0.2], []],
    "errors": ["", "", "Bad Request: prompt too long"], "output_lens": [3, 3, 0],
})


def test_parse_a_vllm_bench_detailed_result():
    """Per-request start/TTFT/gaps become records (end = start + TTFT + gaps); errors fail; its aggregate is kept."""
    records, summary = parse_vllm_bench_result(VLLM_BENCH_JSON)
    assert [r.ok for r in records] == [True, True, False]
    assert [r.ttft_ms for r in records] == [pytest.approx(100.0), pytest.approx(200.0), None]
    assert [r.e2e_ms for r in records][:2] == [pytest.approx(200.0), pytest.approx(500.0)] and records[2].e2e_ms is None
    assert records[1].end_ns - records[1].start_ns == pytest.approx(0.5e9, abs=10)
    report = records_report(records, slo_ttft_ms=150.0)
    assert (report["num_requests"], report["num_errors"]) == (3, 1)
    assert report["duration_s"] == pytest.approx(101.0 - 100.0)  # first start to the last end (request 2's)
    assert report["goodput_requests_per_s"] == pytest.approx(1 / report["duration_s"])
    assert summary == {"completed": 2, "failed": 1, "duration": 2.5, "request_throughput": 0.8,
                       "request_goodput": 0.4, "p50_ttft_ms": 150.0, "p90_ttft_ms": 190.0, "p99_ttft_ms": 199.0,
                       "p90_e2el_ms": 560.0}
    with pytest.raises(ValueError, match="differ in length"):
        parse_vllm_bench_result(json.dumps({"start_times": [1.0], "ttfts": [], "itls": [], "errors": []}))


def _trace_result(hit_rates: dict[float, float], ttft_p90_ms: float) -> dict:
    runs = [{"time_scale": scale, "ttft_ms": {"p50": ttft_p90_ms / 2, "p90": ttft_p90_ms},
             "e2e_ms": {"p50": 1.0, "p90": 2 * ttft_p90_ms}, "goodput_requests_per_s": 1.0,
             "prefix_cache": {"hit_rate": rate}, "infinite_cache_hit_rate": 0.5} for scale, rate in hit_rates.items()]
    return {"runs": runs}


def test_trace_runs_summarized_per_scale_against_the_baseline_paired_by_repeat():
    """Medians (min–max) per policy and scale; ratios to bare paired by repeat; disjoint ranges give a verdict."""
    runs = {"bare": [_trace_result({2.0: 0.10, 1.0: 0.1}, 1000.0), _trace_result({2.0: 0.12, 1.0: 0.1}, 1200.0),
                     _trace_result({2.0: 0.11, 1.0: 0.1}, 800.0)],
            "prefix_aware": [_trace_result({2.0: 0.40, 1.0: 0.1}, 500.0), _trace_result({2.0: 0.45, 1.0: 0.1}, 300.0),
                             _trace_result({2.0: 0.44, 1.0: 0.1}, 900.0)]}
    summary = summarize_trace_runs(runs, "bare")
    pa = summary["prefix_aware"]["2"]
    assert pa["repeats"] == 3 and pa["metrics"]["hit_rate"]["median"] == pytest.approx(0.44)
    assert pa["metrics"]["hit_rate_vs_infinite_cache"]["median"] == pytest.approx(0.88)
    assert pa["vs_bare"]["hit_rate"]["ratio"]["median"] == pytest.approx(0.44 / 0.11)
    assert pa["vs_bare"]["hit_rate"]["verdict"] == "better"
    assert pa["vs_bare"]["ttft_p90_ms"]["verdict"] == "no difference"  # 300–900 overlaps 800–1200
    assert "vs_bare" not in summary["bare"]["2"] and set(summary["bare"]) == {"2", "1"}
    assert baseline_policy(["prefix_aware", "pow2"]) == "pow2" and baseline_policy(["a", "bare"]) == "bare"
    assert baseline_policy(["prefix_aware"]) == "prefix_aware"


def test_compare_report_shows_each_policy_scale_and_the_order():
    """The compare report has a row per policy and scale, the ratio table, the order and the few-repeats warning."""
    from kvtide.benchmarks.protocol import provenance

    runs = {"bare": [_trace_result({2.0: 0.1}, 1000.0)], "prefix_aware": [_trace_result({2.0: 0.4}, 500.0)]}
    for policy, results in runs.items():
        for r in results:
            r.update(repeat=0, trace={"path": "t.jsonl", "sha256": "ab" * 32})
            r["runs"][0].update(scaling={k: None for k in ("block_tokens", "max_input_tokens", "over_long",
                                                           "output_scale", "max_output_tokens", "limit", "start_s",
                                                           "duration_s")} | {"num_sent": 40},
                                client_exit_code=0, num_errors=0, num_requests=40)
    results = {"kind": "trace_compare", "provenance": provenance(["kvtide", "bench", "trace"], gpu_info=[]),
               "client": {"name": "vllm-bench", "version": "0.26.0"}, "hardware": "1 × H100", "notes": [],
               "slo_ttft_ms": 1000.0, "repeats": 1, "baseline": "bare", "order": [["bare", 0], ["prefix_aware", 0]],
               "policies": runs, "failed": {}, "summary": summarize_trace_runs(runs, "bare")}
    text = compare_markdown(results)
    assert "| prefix_aware | 2 | 1 | 250 | 500 | 1000 | 1.00 | 0.400 | 0.80 |" in text
    assert "| prefix_aware | 2 | 0.50× better | 0.50× better | 1.00× no difference | 4.00× better |" in text
    assert "Against `bare`" in text and "Order: bare #1, prefix_aware #1" in text
    assert "too few to tell a difference from noise" in text
