"""The KV tier benchmark's pure parts: counters by tier, sizes, servers' configs, summaries, targets, the report."""

from __future__ import annotations

import pytest

from kvtide.benchmarks import kv_tier
from kvtide.benchmarks.kv_tier import (
    engine_differences,
    kv_bytes_per_token,
    new_offload_files,
    revisit_gaps,
    server_config,
    server_specs,
    shm_needed_bytes,
    sizes,
    split_rounds,
    summarize_servers,
    target_state,
    targets,
    tier_counters,
    tier_delta,
    tier_rates,
)
from kvtide.benchmarks.workloads import PrefixRevisitParams, build_workload
from kvtide.config import default_config_path
from kvtide.deployments.engine.placement import engine_kwargs

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "torch_dtype": "bfloat16"}

BARE_TEXT = """\
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 100.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 300.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 600.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="m",source="local_compute"} 1.7e9
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 600.0
# TYPE vllm:kv_offload_load_bytes counter
vllm:kv_offload_load_bytes_total{engine="0",model_name="m"} 2147483648.0
# TYPE vllm:kv_offload_load_time counter
vllm:kv_offload_load_time_total{engine="0",model_name="m"} 0.1
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
"""

RAY_TEXT = """\
# TYPE ray_vllm_prompt_tokens_by_source_total counter
ray_vllm_prompt_tokens_by_source_total{ReplicaId="a",source="local_compute"} 40.0
ray_vllm_prompt_tokens_by_source_total{ReplicaId="a",source="local_cache_hit"} 60.0
ray_vllm_prompt_tokens_by_source_total{ReplicaId="b",source="local_compute"} 10.0
ray_vllm_prompt_tokens_by_source_total{ReplicaId="b",source="external_kv_transfer"} 90.0
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{ReplicaId="a"} 100.0
# TYPE ray_serve_num_http_requests_total counter
ray_serve_num_http_requests_total{route="/"} 5.0
"""


def test_bare_text_counts_prompt_tokens_by_source_under_the_server_name():
    """Bare vLLM text: by-source tokens and connector counters under the server's name; other series ignored."""
    assert tier_counters(BARE_TEXT, "vllm-0") == {"vllm-0": {
        "tokens_computed": 100.0, "tokens_gpu_hit": 300.0, "tokens_cpu_hit": 600.0,
        "external_prefix_cache_hits": 600.0, "load_bytes": 2147483648.0, "load_time_s": 0.1}}


def test_ray_text_counts_each_replica_apart():
    """Through Ray's metrics agent (ray_vllm_ names) each engine replica is counted under its ReplicaId."""
    counters = tier_counters(RAY_TEXT)
    assert counters == {"a": {"tokens_computed": 40.0, "tokens_gpu_hit": 60.0, "gpu_prefix_cache_queries": 100.0},
                        "b": {"tokens_computed": 10.0, "tokens_cpu_hit": 90.0}}


def test_rates_come_from_the_delta_over_every_engine():
    """Tier hit rates are shares of the run's prompt tokens (after − before, all engines); copy rate is bytes / s."""
    before = {"a": {"tokens_computed": 40.0, "tokens_gpu_hit": 60.0}}
    after = {"a": {"tokens_computed": 50.0, "tokens_gpu_hit": 90.0, "tokens_cpu_hit": 0.0},
             "b": {"tokens_computed": 10.0, "tokens_cpu_hit": 50.0, "load_bytes": 2 * 2**30, "load_time_s": 0.5}}
    delta = tier_delta(before, after)
    assert delta["a"] == {"tokens_computed": 10.0, "tokens_gpu_hit": 30.0, "tokens_cpu_hit": 0.0}
    rates = tier_rates(delta)
    assert rates["prompt_tokens"] == 100.0
    assert (rates["gpu_hit_rate"], rates["cpu_hit_rate"], rates["hit_rate"]) == pytest.approx((0.3, 0.5, 0.8))
    assert rates["load_gib"] == pytest.approx(2.0) and rates["load_gib_per_s"] == pytest.approx(4.0)
    assert tier_rates({})["hit_rate"] is None and tier_rates({})["load_gib_per_s"] is None


def test_kv_bytes_per_token_of_the_8b_shape():
    """Llama-3.1-8B's KV per token: 2 × 32 layers × 8 KV heads × 128 head dim × 2 bytes = 128 KiB."""
    assert kv_bytes_per_token(LLAMA_8B) == 131072
    assert kv_bytes_per_token({**LLAMA_8B, "head_dim": 64}, "float32") == 2 * 32 * 8 * 64 * 4


def test_sizes_relate_the_working_set_to_gpu_kv_and_the_cpu_tier():
    """24 × 4,096-token prefixes are 3× a 4 GiB GPU KV of the 8B shape, 1.5× two, 0.75× a 16 GiB tier."""
    groups = [f"group-{g % 24}" for g in range(48)]
    s = sizes(model_config=LLAMA_8B, dtype="bfloat16", block_size=16, replicas=2, gpu_kv_bytes=4 * 2**30,
              cpu_tier_gib=16.0, prefix_tokens=[4096] * 24, request_tokens=[4160] * 48, groups=groups)
    assert (s["gpu_kv_tokens_per_replica"], s["gpu_kv_tokens_fleet"]) == (32768, 65536)
    assert (s["cpu_tier_tokens_per_replica"], s["cpu_tier_tokens_fleet"]) == (131072, 262144)
    assert s["working_set_tokens"] == 98304
    assert (s["working_set_over_gpu_kv_replica"], s["working_set_over_gpu_kv_fleet"],
            s["working_set_over_cpu_tier_replica"]) == pytest.approx((3.0, 1.5, 0.75))
    assert s["revisit_gap_requests"] == {"min": 23, "max": 23} and s["revisit_gap_tokens_min"] == 23 * 4160
    assert "3.00× one replica's GPU KV" in "\n".join(kv_tier.sizes_markdown(s))


def test_revisit_gaps_count_the_requests_in_between():
    """The gap of a revisit is the number of requests since the group's previous visit."""
    assert revisit_gaps(["a", "b", "c", "a", "b", "a"]) == [2, 2, 1]


def test_split_rounds_keeps_the_first_round_apart():
    """The unmeasured first round is one visit per group; the measured rest is every later round."""
    w = build_workload("prefix-revisit", PrefixRevisitParams(num_groups=5, num_rounds=3, system_prompt_len=8,
                                                             question_len=2, output_len=1, revisit_window=2))
    first, rest = split_rounds(w)
    assert sorted(r.group for r in first.requests) == [f"group-{g}" for g in range(5)]
    assert first.requests + rest.requests == w.requests and len(rest.requests) == 10


def test_only_the_tier_servers_get_the_tier_overrides():
    """--tier-set reaches the tier servers only, after --set (the blind one also turns tier-aware cost off); unknown or repeated servers are refused."""
    specs = {s.name: s for s in server_specs(list(kv_tier.SERVERS), ["a=1"], ["engine.kv_offload.size_gib=8"])}
    assert specs["kvtide-tier"].overrides == specs["vllm-offload"].overrides == ("a=1", "engine.kv_offload.size_gib=8")
    assert specs["kvtide"].overrides == ("a=1",)
    assert specs["kvtide-tier-blind"].overrides == ("a=1", "engine.kv_offload.size_gib=8", "routing.cpu_tier_aware=false")
    assert specs["vllm-offload"].bare and not specs["kvtide-tier"].bare
    with pytest.raises(ValueError):
        server_specs(["kvtide", "kvtide"], [], [])
    with pytest.raises(ValueError):
        server_specs(["vllm"], [], [])


def test_tier_servers_engines_match_and_differ_from_kvtide_only_in_the_tier():
    """The tier servers' engine kwargs are equal and differ from kvtide's by exactly the offloading arguments."""
    shared = ["model=/models/m", "resources.device=gpu", "replicas.num_replicas=2", "resources.gpus_per_worker=0.5",
              "engine.gpu_memory_utilization=null", "engine.kv_cache_memory_bytes=4294967296"]
    specs = server_specs(list(kv_tier.SERVERS), shared, ["engine.kv_offload.size_gib=16"])
    kwargs = {s.name: engine_kwargs(server_config(s, default_config_path(), "prefix_aware"), "/models/m")
              for s in specs}
    assert kwargs["kvtide-tier"] == kwargs["vllm-offload"]
    assert kwargs["kvtide-tier"]["kv_offloading_size"] == 16.0
    extra = set(kwargs["kvtide-tier"]) - set(kwargs["kvtide"])
    assert extra == {"kv_offloading_size", "kv_offloading_backend", "kv_transfer_config"}
    assert {k: v for k, v in kwargs["kvtide-tier"].items() if k not in extra} == kwargs["kvtide"]


def test_engine_differences_tell_the_tier_fields_from_the_rest():
    """A difference in the tier's own fields is expected; any other field differing is listed as unexpected."""
    base = {"block_size": 16, "kv_offloading_size": None, "kv_connector": None}
    diffs = engine_differences({"kvtide": base, "kvtide-tier": {**base, "kv_offloading_size": 16.0,
                                                                 "kv_connector": "OffloadingConnector"},
                                "vllm-offload": {**base, "kv_offloading_size": 16.0, "block_size": 32},
                                "none": None})
    assert diffs["kvtide-tier"]["unexpected"] == []
    assert diffs["kvtide-tier"]["fields"]["kv_connector"] == ["OffloadingConnector", None]
    assert diffs["vllm-offload"]["unexpected"] == ["block_size"]
    assert "none" not in diffs and engine_differences({"x": base}) == {}


def _entry(ttft_p90: float, hit: float | None, bound: float = 0.9) -> dict:
    run = {"ttft_s": {"p50": ttft_p90 / 2, "p90": ttft_p90, "p99": ttft_p90 * 2}, "e2e_s": {"p90": ttft_p90 + 1},
           "goodput_requests_per_s": 4.0, "num_requests": 10, "num_errors": 0}
    tiers = {"hit_rate": hit, "gpu_hit_rate": None if hit is None else hit / 2,
             "cpu_hit_rate": None if hit is None else hit / 2, "load_gib_per_s": 20.0}
    return {"run": run, "tiers": tiers, "infinite_cache_hit_rate": bound,
            "hit_rate_vs_infinite_cache": None if hit is None else hit / bound}


def test_summaries_pair_each_repeat_with_kvtides():
    """Ratios to kvtide pair repeat i with its repeat i (none for a missing one); verdicts compare the ranges."""
    runs = {"kvtide": [_entry(1.0, 0.1), _entry(2.0, 0.1), _entry(1.5, 0.1)],
            "kvtide-tier": [_entry(0.5, 0.88), None, _entry(0.3, 0.87)]}
    summary = summarize_servers(runs)
    ratio = summary["kvtide-tier"]["vs_kvtide"]["ttft_p90_s"]
    assert ratio["ratio"]["values"] == [0.5, None, pytest.approx(0.2)]
    assert ratio["verdict"] == "better"
    assert summary["kvtide-tier"]["metrics"]["ttft_p90_s"]["n"] == 2
    assert "vs_kvtide" not in summary["kvtide"]
    states = {t["target"].split(" ")[0]: t["state"] for t in targets(summary)}
    assert states == {"TTFT": "met in every repeat", "hit": "met in every repeat"}


@pytest.mark.parametrize("values, at_most, state", [
    ([0.5, 0.6, 0.65], True, "met in every repeat"),
    ([0.5, 0.6, 0.9], True, "met at the median, not in every repeat"),
    ([0.8, 0.75, 0.5], True, "not met"),
    ([0.95, 0.85, 0.92], False, "met at the median, not in every repeat"),
    ([None, None], False, "not measured"),
])
def test_target_state_reads_every_repeat_then_the_median(values, at_most, state):
    """A target is met in every repeat, at the median only, or not (≤ 0.7 for a ratio, ≥ 0.9 for a share)."""
    from kvtide.benchmarks.protocol import summarize_repeats

    assert target_state(summarize_repeats(values), 0.7 if at_most else 0.9, at_most) == state


def test_shm_need_and_the_files_left_behind(tmp_path):
    """A tier server needs its engines' whole tiers in /dev/shm; only tier files new since its start are leftovers."""
    assert shm_needed_bytes(16.0, 2) == 32 * 2**30 and shm_needed_bytes(None, 2) == 0
    (tmp_path / "vllm_offload_old.mmap").write_bytes(b"")
    before = kv_tier.offload_files(tmp_path)
    (tmp_path / "vllm_offload_new.mmap").write_bytes(b"")
    (tmp_path / "other.mmap").write_bytes(b"")
    assert new_offload_files(before, tmp_path) == [tmp_path / "vllm_offload_new.mmap"]


def test_report_states_targets_sizes_and_provenance():
    """The report leads with the targets, shows every server's row and closes with the provenance."""
    from kvtide.benchmarks.protocol import Run, provenance

    runs = {"kvtide-tier": [_entry(0.3, 0.88)], "kvtide": [_entry(1.0, 0.1)]}
    summary = summarize_servers(runs)
    s = sizes(model_config=LLAMA_8B, dtype="bfloat16", block_size=16, replicas=2, gpu_kv_bytes=4 * 2**30,
              cpu_tier_gib=16.0, prefix_tokens=[4096] * 24, request_tokens=[4160] * 48,
              groups=[f"g{i % 24}" for i in range(48)])
    results = {"servers": list(runs), "repeats": 1, "command": "python -m kvtide.benchmarks.kv_tier", "runs": runs,
               "summary": summary, "targets": targets(summary), "sizes": s, "notes": ["a note"],
               "order_runs": [Run("kvtide-tier", 0), Run("kvtide", 0)], "infinite_cache_hit_rate": None,
               "workload": {"params": vars(PrefixRevisitParams()), "load": "rate 4", "warmup_requests": 4,
                            "warm_concurrency": 8},
               "provenance": provenance(["x"], gpu_info=[], run=lambda argv: None)}
    text = kv_tier.report_markdown(results)
    assert text.index("## Targets") < text.index("## Per server") < text.index("## Sizes") < text.index("## Provenance")
    assert "| kvtide-tier | 1 | 10 (0) |" in text and "0.30" in text
    assert "too few to tell a difference" in text and "- a note" in text
    assert "kvtide-tier #1 → kvtide #1" in text
