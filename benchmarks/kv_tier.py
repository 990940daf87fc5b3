"""A CPU KV tier per replica (issue 51): kvtide with the tier, kvtide without it, bare vLLM with it.

    python -m kvtide.benchmarks.kv_tier --config FILE --set ... --tier-set engine.kv_offload.size_gib=16 \\
        --rate 4 --repeats 3 --out-dir DIR

Servers (`--servers`, the first three by default):

    kvtide-tier    kvtide's cluster (routing.policy --policy, prefix_aware by default) with the
                   `--tier-set` overrides: vLLM's native CPU KV tier in every engine replica
    kvtide         the same cluster without them: the baseline the TTFT target is read against
    vllm-offload   bare vLLM servers with the same `--tier-set` overrides behind a round-robin
                   balancer, no kvtide (`kvtide bench compare`'s `bare`, benchmarks/bare_fleet.py)
    kvtide-tier-blind  (only when named) kvtide-tier with routing.cpu_tier_aware=false: the same tiers,
                   routed on GPU blocks alone; what the tier-aware cost adds over prefix affinity

Every server gets the same `--set` overrides, so its engines resolve alike but for the tier
(results.json's `engine.servers.<name>.engine_config` and `engine.differences` say so, resolved
apart from the servers as benchmarks/overhead.py does). `kvtide bench compare`'s machinery runs
them: its servers (cli.Target, `local.running`, `bare_fleet.running`), its configs
(`cli.policy_config`), its measured run (`cli.bench_once`: scrape, run, settle, the run JSON with
TTFT, goodput and the oracle hit rate) and its seeds (one point's seed plus a stride per repeat).

The load is the `prefix-revisit` workload (benchmarks/workloads.py): many long prefixes, each
revisited after a bounded number of others. Its first round (every group once) runs unmeasured
right after the start's warm-up requests: the measured rounds then find a steady cache, and every
prefix they send was sent before, so the infinite-cache bound (`workloads.oracle_hit_rate_after`)
is the share of prompt words a cache of unbounded size would hold. Sized so the working set
exceeds the GPU KV of the fleet but fits one replica's CPU tier, the measured rounds are what the
tier exists for: GPU-only caches have evicted a prefix (LRU) before it comes back, the tier has not.

Hit rate by tier, per run: vLLM's `prompt_tokens_by_source` counter (prompt tokens computed, found
in the engine's own prefix cache on GPU, loaded through its KV connector, i.e. from the CPU tier),
summed over the server's engines, read before and after the measured rounds (after the same
settle `bench_once` waits for). Also recorded: vLLM's prefix-cache and external prefix-cache
hit/query counters, and the offload connector's load/store bytes and seconds (the host→GPU copy
rate the router's `engine.kv_offload.load_gib_per_s` stands in for). The run JSON's own
`oracle_hit_rate` (`bench_once`'s) counts the measured rounds alone, their first visits as misses;
the report's bound is `infinite_cache_hit_rate`, which knows the first round.

Protocol (benchmarks/protocol.py): every run is a fresh start of its server; the servers
alternate in `protocol.schedule`'s order (A B C A B C …); each start sends `--warmup` unmeasured
requests and the unmeasured first round before the measured rounds. The protocol's unmeasured
warm-up start per server runs only with `--warmup-start` (it costs one more start per server).
Cells are median (min–max) over the repeats; ratios to `kvtide` pair repeat i with its repeat i;
a verdict is "better"/"worse" only where the ranges do not overlap. The issue's targets:
TTFT p90 of kvtide-tier ≤ 0.7× kvtide's, and its hit rate ≥ 0.9× the infinite cache's.

Writes DIR/results.json and DIR/report.md after every run (a stopped run keeps the finished ones),
DIR/<server>.r<repeat>.requests.jsonl, and each bare fleet's logs under DIR/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import httpx

WORKLOAD = "prefix-revisit"
SERVERS = ("kvtide-tier", "kvtide", "vllm-offload", "kvtide-tier-blind")
DEFAULT_SERVERS = SERVERS[:3]  # the blind one costs a third more device time: named when wanted
BASELINE = "kvtide"
CANDIDATE = "kvtide-tier"
BARE_SERVERS = ("vllm-offload",)
TIER_SERVERS = ("kvtide-tier", "vllm-offload", "kvtide-tier-blind")
# Overrides of a server's own after the tier's: the blind server routes on GPU blocks alone.
OWN_OVERRIDES = {"kvtide-tier-blind": ("routing.cpu_tier_aware=false",)}
# The targets: kvtide-tier's TTFT p90 over kvtide's at most this, its hit rate over the
# infinite cache's at least this.
TTFT_P90_RATIO_TARGET = 0.7
HIT_VS_INFINITE_TARGET = 0.9
# The engine settings the tier itself changes (engine_config_summary's names): a difference in these
# between a tier server and kvtide is the point of the comparison, in any other field a flaw of it.
TIER_FIELDS = ("kv_offloading_size", "kv_offloading_backend", "kv_connector")

# vLLM's native CPU tier keeps its blocks in one shared-memory file per engine start
# (vllm/v1/kv_offload/cpu/shared_offload_region.py), populated in full at start and unlinked at a
# clean shutdown only: an engine killed in its stop leaves the file, and its memory, behind.
SHM_DIR = Path("/dev/shm")
OFFLOAD_FILE_GLOB = "vllm_offload_*.mmap"
GIB = 1 << 30


# ---- the engines' counters by tier -----------------------------------------------------------

# vLLM counter (without its prefix: `vllm:` from bare vLLM, `ray_vllm_` through Ray's metrics agent)
# → the key it is recorded under.
COUNTERS = {
    "prefix_cache_hits_total": "gpu_prefix_cache_hits",
    "prefix_cache_queries_total": "gpu_prefix_cache_queries",
    "external_prefix_cache_hits_total": "external_prefix_cache_hits",
    "external_prefix_cache_queries_total": "external_prefix_cache_queries",
    "kv_offload_load_bytes_total": "load_bytes",
    "kv_offload_load_time_total": "load_time_s",
    "kv_offload_store_bytes_total": "store_bytes",
    "kv_offload_store_time_total": "store_time_s",
}
# vLLM's prompt tokens by where they came from, one series per `source` label; each prompt token
# counts once, when its request's prefill is done: computed, found in the engine's own prefix cache
# (GPU), or loaded through the KV connector (with the native tier: host memory).
BY_SOURCE = "prompt_tokens_by_source_total"
SOURCES = {"local_compute": "tokens_computed", "local_cache_hit": "tokens_gpu_hit",
           "external_kv_transfer": "tokens_cpu_hit"}
VLLM_PREFIXES = ("ray_vllm_", "vllm:")


def _vllm_name(sample_name: str) -> str | None:
    for prefix in VLLM_PREFIXES:
        if sample_name.startswith(prefix):
            return sample_name[len(prefix):]
    return None


def tier_counters(text: str, server: str | None = None) -> dict[str, dict[str, float]]:
    """{engine: {key: value}} of the tier counters in one Prometheus text: engines named by their replica
    label (kvtide through Ray), else `server` (a bare vLLM server, one engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvtide.benchmarks.report import BARE_SERVER_KEY, _replica_of

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _vllm_name(sample.name)
            if name == BY_SOURCE:
                key = SOURCES.get(sample.labels.get("source", ""))
            else:
                key = COUNTERS.get(name or "")
            if key is None:
                continue
            engine = _replica_of(sample.labels)
            engine = server if server is not None and engine == BARE_SERVER_KEY else engine
            counters = out.setdefault(engine, {})
            counters[key] = counters.get(key, 0.0) + sample.value
    return out


def tier_delta(before: Mapping[str, Mapping[str, float]],
               after: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """after − before per engine and key (an engine or key absent before counts from zero)."""
    return {engine: {key: value - before.get(engine, {}).get(key, 0.0) for key, value in counters.items()}
            for engine, counters in after.items()}


def tier_rates(delta: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """The run's prompt tokens by tier over every engine: counts, hit rates (share of prompt tokens from the
    GPU cache, from the CPU tier, either) and the connector's host→GPU copy rate; None where nothing counted."""
    total: dict[str, float] = {}
    for counters in delta.values():
        for key, value in counters.items():
            total[key] = total.get(key, 0.0) + value
    computed, gpu, cpu = (total.get(k, 0.0) for k in ("tokens_computed", "tokens_gpu_hit", "tokens_cpu_hit"))
    prompt = computed + gpu + cpu
    load_bytes, load_s = total.get("load_bytes", 0.0), total.get("load_time_s", 0.0)
    return {
        "prompt_tokens": prompt, "tokens_computed": computed, "tokens_gpu_hit": gpu, "tokens_cpu_hit": cpu,
        "hit_rate": (gpu + cpu) / prompt if prompt else None,
        "gpu_hit_rate": gpu / prompt if prompt else None,
        "cpu_hit_rate": cpu / prompt if prompt else None,
        "load_gib": load_bytes / GIB,
        "load_gib_per_s": load_bytes / GIB / load_s if load_s > 0 else None,
        "store_gib": total.get("store_bytes", 0.0) / GIB,
        "counters": total,
    }


async def scrape_tiers(client: httpx.AsyncClient, metrics: str | Mapping[str, str] | None
                       ) -> dict[str, dict[str, float]] | None:
    """One scrape of every engine's tier counters: kvtide's one endpoint, or each bare server's own."""
    from kvtide.benchmarks.cli import _metrics_text

    if not metrics:
        return None
    if isinstance(metrics, str):
        return tier_counters(await _metrics_text(client, metrics))
    texts = await asyncio.gather(*(_metrics_text(client, url) for url in metrics.values()))
    merged: dict[str, dict[str, float]] = {}
    for server, text in zip(metrics, texts):
        merged.update(tier_counters(text, server))
    return merged


# ---- sizes ---------------------------------------------------------------------------------------

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def kv_shape(model_config: Mapping[str, Any], dtype: str = "auto") -> dict[str, int]:
    """What one token's KV cache is made of in a decoder (HF config.json): layers, KV heads, head dim and the
    element size (`dtype` "auto": the model's own)."""
    heads = model_config["num_attention_heads"]
    if dtype == "auto":
        dtype = model_config.get("torch_dtype") or model_config.get("dtype") or "float32"
    return {"layers": model_config["num_hidden_layers"], "kv_heads": model_config.get("num_key_value_heads") or heads,
            "head_dim": model_config.get("head_dim") or model_config["hidden_size"] // heads,
            "bytes_per_element": DTYPE_BYTES[str(dtype)]}


def kv_bytes_per_token(model_config: Mapping[str, Any], dtype: str = "auto") -> int:
    """Bytes of KV cache per token: K and V × layers × KV heads × head dim × element size."""
    shape = kv_shape(model_config, dtype)
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * shape["bytes_per_element"]


def revisit_gaps(groups: Sequence[str]) -> list[int]:
    """For each revisit of a group, how many requests came between it and the group's previous visit."""
    last: dict[str, int] = {}
    gaps = []
    for i, group in enumerate(groups):
        if group in last:
            gaps.append(i - last[group] - 1)
        last[group] = i
    return gaps


def sizes(*, model_config: Mapping[str, Any], dtype: str, block_size: int, replicas: int,
          gpu_kv_bytes: int | None, cpu_tier_gib: float | None, prefix_tokens: Sequence[int],
          request_tokens: Sequence[int], groups: Sequence[str]) -> dict[str, Any]:
    """The working set against the GPU KV and the CPU tier, in tokens (prompt text; chat-template tokens left
    out), each per replica and over the fleet, and the revisit distance in requests and tokens."""
    per_token = kv_bytes_per_token(model_config, dtype)
    gpu = gpu_kv_bytes // per_token if gpu_kv_bytes else None
    cpu = int(cpu_tier_gib * GIB) // per_token if cpu_tier_gib else None
    working_set = sum(prefix_tokens)
    gaps = revisit_gaps(groups)
    mean_request = sum(request_tokens) / len(request_tokens) if request_tokens else None

    def over(tokens: int | None) -> float | None:
        return working_set / tokens if tokens else None

    return {
        "kv_bytes_per_token": per_token, "kv_shape": kv_shape(model_config, dtype),
        "block_size": block_size, "replicas": replicas,
        "gpu_kv_bytes_per_replica": gpu_kv_bytes, "gpu_kv_tokens_per_replica": gpu,
        "gpu_kv_tokens_fleet": gpu * replicas if gpu else None,
        "cpu_tier_gib_per_replica": cpu_tier_gib, "cpu_tier_tokens_per_replica": cpu,
        "cpu_tier_tokens_fleet": cpu * replicas if cpu else None,
        "groups": len(prefix_tokens), "prefix_tokens_mean": working_set / len(prefix_tokens) if prefix_tokens else None,
        "request_tokens_mean": mean_request,
        "working_set_tokens": working_set,
        "working_set_over_gpu_kv_replica": over(gpu),
        "working_set_over_gpu_kv_fleet": over(gpu * replicas if gpu else None),
        "working_set_over_cpu_tier_replica": over(cpu),
        "revisit_gap_requests": {"min": min(gaps), "max": max(gaps)} if gaps else None,
        "revisit_gap_tokens_min": min(gaps) * mean_request if gaps and mean_request else None,
    }


def shm_needed_bytes(tier_gib: float | None, replicas: int) -> int:
    """Shared memory the tier's engines of one server populate at start: each its whole tier."""
    return int((tier_gib or 0) * GIB) * replicas


def new_offload_files(before: set[str], shm_dir: Path = SHM_DIR) -> list[Path]:
    """Tier files in `shm_dir` that were not there before a server started (its engines', now stopped)."""
    return sorted(p for p in shm_dir.glob(OFFLOAD_FILE_GLOB) if p.name not in before)


def offload_files(shm_dir: Path = SHM_DIR) -> set[str]:
    return {p.name for p in shm_dir.glob(OFFLOAD_FILE_GLOB)}


# ---- repeats → the report's numbers ----------------------------------------------------------------

# What each run's entry is summarized by over the repeats: (key, getter, higher is better).
SUMMARY_METRICS: tuple[tuple[str, Callable[[Mapping[str, Any]], Any], bool], ...] = (
    ("ttft_p50_s", lambda e: e["run"]["ttft_s"]["p50"], False),
    ("ttft_p90_s", lambda e: e["run"]["ttft_s"]["p90"], False),
    ("ttft_p99_s", lambda e: e["run"]["ttft_s"]["p99"], False),
    ("e2e_p90_s", lambda e: e["run"]["e2e_s"]["p90"], False),
    ("goodput_requests_per_s", lambda e: e["run"]["goodput_requests_per_s"], True),
    ("hit_rate", lambda e: (e.get("tiers") or {}).get("hit_rate"), True),
    ("gpu_hit_rate", lambda e: (e.get("tiers") or {}).get("gpu_hit_rate"), True),
    ("cpu_hit_rate", lambda e: (e.get("tiers") or {}).get("cpu_hit_rate"), True),
    ("hit_rate_vs_infinite_cache", lambda e: e.get("hit_rate_vs_infinite_cache"), True),
    ("load_gib_per_s", lambda e: (e.get("tiers") or {}).get("load_gib_per_s"), True),
)


def summarize_servers(runs: Mapping[str, Sequence[Mapping[str, Any] | None]],
                      baseline: str = BASELINE) -> dict[str, Any]:
    """{server: [entry of repeat i, or None]} → per server each metric's median, min, max over the repeats and,
    for all but `baseline`, the ratio to it paired by repeat with the verdict over the ranges."""
    from kvtide.benchmarks.protocol import ratio_summary, summarize_repeats, verdict

    def values(entries: Sequence[Mapping[str, Any] | None]) -> dict[str, list[Any]]:
        return {key: [None if e is None else get(e) for e in entries] for key, get, _ in SUMMARY_METRICS}

    base = values(runs[baseline]) if baseline in runs else None
    out: dict[str, Any] = {}
    for server, entries in runs.items():
        mine = values(entries)
        summary: dict[str, Any] = {"metrics": {key: summarize_repeats(v) for key, v in mine.items()}}
        if base is not None and server != baseline:
            summary[f"vs_{baseline}"] = {key: {"ratio": ratio_summary(mine[key], base[key]),
                                               "verdict": verdict(mine[key], base[key], higher)}
                                         for key, _, higher in SUMMARY_METRICS}
        out[server] = summary
    return out


def target_state(summary: Mapping[str, Any] | None, bound: float, at_most: bool) -> str:
    """Whether a metric over the repeats meets `bound` (≤ with `at_most`, else ≥): in every repeat, at the
    median only, or not; "not measured" without values."""
    present = [v for v in (summary or {}).get("values", []) if v is not None]
    if not present:
        return "not measured"
    ok = (lambda v: v <= bound) if at_most else (lambda v: v >= bound)
    if all(ok(v) for v in present):
        return "met in every repeat"
    return "met at the median, not in every repeat" if ok(summary["median"]) else "not met"


def targets(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's two targets for kvtide-tier, each with its summary and state."""
    tier = summary.get(CANDIDATE) or {}
    ratio = ((tier.get(f"vs_{BASELINE}") or {}).get("ttft_p90_s") or {}).get("ratio")
    hit = (tier.get("metrics") or {}).get("hit_rate_vs_infinite_cache")
    return [
        {"target": f"TTFT p90 of {CANDIDATE} / {BASELINE} ≤ {TTFT_P90_RATIO_TARGET}", "summary": ratio,
         "state": target_state(ratio, TTFT_P90_RATIO_TARGET, at_most=True)},
        {"target": f"hit rate of {CANDIDATE} / infinite cache's ≥ {HIT_VS_INFINITE_TARGET}", "summary": hit,
         "state": target_state(hit, HIT_VS_INFINITE_TARGET, at_most=False)},
    ]


def engine_differences(configs: Mapping[str, Mapping[str, Any] | None],
                       baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    """Per server, the resolved engine fields that differ from `baseline`'s: {field: [its, baseline's]}, and
    under "unexpected" the fields that differ beyond the tier's own (TIER_FIELDS)."""
    base = configs.get(baseline)
    out: dict[str, dict[str, Any]] = {}
    if base is None:
        return out
    for server, config in configs.items():
        if server == baseline or config is None:
            continue
        fields = {name: [config.get(name), base.get(name)] for name in sorted(set(config) | set(base))
                  if config.get(name) != base.get(name)}
        out[server] = {"fields": fields, "unexpected": [f for f in fields if f not in TIER_FIELDS]}
    return out


# ---- the report ------------------------------------------------------------------------------------

def _spread(summary: Mapping[str, Any] | None, scale: float = 1.0, fmt: str = "{:.3f}", suffix: str = "") -> str:
    from kvtide.benchmarks.protocol import format_spread

    return format_spread(summary, scale=scale, fmt=fmt, suffix=suffix)


def _int(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def sizes_markdown(s: Mapping[str, Any] | None) -> list[str]:
    """The sizes and their arithmetic, one line each."""
    if not s:
        return ["Sizes not computed."]
    shape = s["kv_shape"]
    lines = [f"- KV per token: 2 (K, V) × {shape['layers']} layers × {shape['kv_heads']} KV heads × "
             f"{shape['head_dim']} head dim × {shape['bytes_per_element']} bytes = {_int(s['kv_bytes_per_token'])} B."]
    if s["gpu_kv_tokens_per_replica"]:
        lines.append(f"- GPU KV per replica: {_int(s['gpu_kv_bytes_per_replica'])} B / "
                     f"{_int(s['kv_bytes_per_token'])} B = {_int(s['gpu_kv_tokens_per_replica'])} tokens; "
                     f"{s['replicas']} replicas: {_int(s['gpu_kv_tokens_fleet'])}.")
    else:
        lines.append("- GPU KV per replica: not set (engine.kv_cache_memory_bytes), so not computed.")
    if s["cpu_tier_tokens_per_replica"]:
        lines.append(f"- CPU tier per replica (tier servers): {s['cpu_tier_gib_per_replica']:g} GiB / "
                     f"{_int(s['kv_bytes_per_token'])} B = {_int(s['cpu_tier_tokens_per_replica'])} tokens; "
                     f"{s['replicas']} replicas: {_int(s['cpu_tier_tokens_fleet'])}.")
    else:
        lines.append("- CPU tier: none configured (no `--tier-set engine.kv_offload.size_gib=…`): the tier servers "
                     "ran without one.")
    lines.append(f"- Working set: {s['groups']} prefixes × {_int(s['prefix_tokens_mean'])} tokens (mean) = "
                 f"{_int(s['working_set_tokens'])} tokens = {_x(s['working_set_over_gpu_kv_replica'])} one replica's "
                 f"GPU KV, {_x(s['working_set_over_gpu_kv_fleet'])} the fleet's, "
                 f"{_x(s['working_set_over_cpu_tier_replica'])} one replica's CPU tier.")
    gap = s.get("revisit_gap_requests")
    if gap:
        lines.append(f"- Revisit distance: {gap['min']}–{gap['max']} other requests between two visits of a group, "
                     f"at least {_int(s['revisit_gap_tokens_min'])} prompt tokens (mean request "
                     f"{_int(s['request_tokens_mean'])} tokens).")
    return lines


def report_markdown(results: Mapping[str, Any]) -> str:
    from kvtide.benchmarks.overhead import engine_markdown
    from kvtide.benchmarks.protocol import CLAIM_MIN_REPEATS, order_text, provenance_markdown

    summary = results.get("summary") or {}
    repeats = results["repeats"]
    lines = [f"# KV tier: {' / '.join(results['servers'])}", "",
             f"Hardware: {results.get('hardware') or 'not given'}. Command:", "", f"    {results['command']}", "",
             "## Targets (issue 51)", "", "| target | median (min–max) over repeats | state |", "|---|---:|---|"]
    for t in results.get("targets") or []:
        lines.append(f"| {t['target']} | {_spread(t['summary'], fmt='{:.2f}')} | {t['state']} |")
    if repeats < CLAIM_MIN_REPEATS:
        lines += ["", f"**{repeats} repeat{'s' if repeats != 1 else ''} per server: too few to tell a difference from "
                      f"noise; no claim ({CLAIM_MIN_REPEATS} or more: `--repeats`).**"]
    lines += ["", "## Per server", "",
              "Median (min–max) over the repeats; TTFT in ms; hit rates are shares of the measured rounds' prompt "
              "tokens (vLLM's `prompt_tokens_by_source`): from the GPU prefix cache, from the CPU tier, either; "
              "÷ infinite cache divides the latter by the workload's bound.", "",
              "| server | runs | requests (errors) | TTFT p50 | TTFT p90 | TTFT p99 | goodput (req/s) | hit rate | GPU "
              "| CPU tier | ÷ infinite cache | tier load GiB/s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for server, s in summary.items():
        m = s["metrics"]
        done = [e for e in results["runs"][server] if e is not None]
        lines.append(
            f"| {server} | {len(done)} | {sum(e['run']['num_requests'] for e in done)} "
            f"({sum(e['run']['num_errors'] for e in done)}) | {_spread(m['ttft_p50_s'], 1000, '{:.0f}')} "
            f"| {_spread(m['ttft_p90_s'], 1000, '{:.0f}')} | {_spread(m['ttft_p99_s'], 1000, '{:.0f}')} "
            f"| {_spread(m['goodput_requests_per_s'], fmt='{:.2f}')} | {_spread(m['hit_rate'])} "
            f"| {_spread(m['gpu_hit_rate'])} | {_spread(m['cpu_hit_rate'])} "
            f"| {_spread(m['hit_rate_vs_infinite_cache'])} | {_spread(m['load_gib_per_s'], fmt='{:.1f}')} |")
    against = [(server, s[f"vs_{BASELINE}"]) for server, s in summary.items() if f"vs_{BASELINE}" in s]
    if against:
        lines += ["", f"Against `{BASELINE}` (ratios paired by repeat; the verdict compares the ranges over repeats):",
                  "", "| server | TTFT p50 | TTFT p90 | TTFT p99 | goodput | hit rate |",
                  "|---|---:|---:|---:|---:|---:|"]
        for server, vs in against:
            cells = [f"{_spread(vs[k]['ratio'], fmt='{:.2f}', suffix='×')} {vs[k]['verdict'] or ''}".strip()
                     for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "goodput_requests_per_s", "hit_rate")]
            lines.append(f"| {server} | " + " | ".join(cells) + " |")
    w = results["workload"]
    p = w["params"]
    lines += ["", "## Sizes", "", *sizes_markdown(results.get("sizes")), "",
              "## Workload and protocol", "",
              f"`{WORKLOAD}`: {p['num_groups']} groups, ~{p['system_prompt_len']}-token prefixes (system prompts), "
              f"~{p['question_len']}-token questions, {p['output_len']} output tokens; {p['num_rounds']} rounds, each "
              f"visiting every group once in windows of {p['revisit_window']}. The first round runs unmeasured "
              f"({w['warm_concurrency']} requests in flight) after each start's {w['warmup_requests']} warm-up "
              f"requests; the other {p['num_rounds'] - 1} rounds are measured at {w['load']}. Infinite-cache bound "
              f"of the measured rounds: {_spread(results.get('infinite_cache_hit_rate'))} (every prefix was sent in "
              "the first round; prompt words, chat-template tokens left out).", "",
              f"Every run a fresh start of its server, servers alternated; the order: "
              f"{order_text(results['order_runs']) if results.get('order_runs') else '–'}. "
              + ("One unmeasured warm-up start per server first." if results.get("warmup_start") else
                 "No warm-up start per server (`--warmup-start`): each start's warm-up requests and first round "
                 "are its warm-up.")
              + f" Each repeat draws new prompts, the same for every server.", ""]
    if (results.get("shm") or {}).get("needed_bytes"):
        shm = results["shm"]
        lines.append(f"Shared memory ({shm['path']}): {_int(shm.get('free_bytes'))} B free at the start, "
                     f"{_int(shm['needed_bytes'])} B needed by one tier server's engines; tier files removed after "
                     f"stops: {shm.get('removed', 0)}.")
        lines.append("")
    for note in results.get("notes") or []:
        lines.append(f"- {note}")
    engine = results.get("engine") or {}
    if engine.get("servers"):
        diffs = engine.get("differences") or {}
        unexpected = {s: d["unexpected"] for s, d in diffs.items() if d["unexpected"]}
        equal = None if not diffs else not unexpected
        text = engine_markdown(engine["servers"], equal, [f"{s}: {', '.join(f)}" for s, f in unexpected.items()])
        # engine_markdown's wording is the overhead benchmark's (against bare vLLM); here the baseline is kvtide.
        text = text.replace("Engine settings resolved alike for every server and bare vLLM.",
                            f"Engine settings resolved alike for every server but the tier's own fields "
                            f"({', '.join(TIER_FIELDS)}).")
        text = text.replace("(bare vLLM's or every other server's not resolved)",
                            f"({BASELINE}'s or every other server's not resolved)")
        lines.append(text)
    if results.get("failed"):
        lines += ["", "Failed: " + "; ".join(f"{k}: {v}" for k, v in results["failed"].items())]
    return "\n".join(lines) + "\n\n" + provenance_markdown(results["provenance"])


# ---- running the servers ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerSpec:
    """One server of the comparison: its name, whether it runs without kvtide, its config overrides."""

    name: str
    bare: bool
    overrides: tuple[str, ...]


def server_specs(servers: Sequence[str], overrides: Sequence[str], tier_sets: Sequence[str]) -> list[ServerSpec]:
    """The servers' specs: the tier servers get `tier_sets` after the shared `overrides`, kvtide gets none."""
    unknown = [s for s in servers if s not in SERVERS]
    if unknown or not servers or len(set(servers)) != len(servers):
        raise ValueError(f"servers are a subset of {', '.join(SERVERS)}, each once; got {list(servers)}")
    return [ServerSpec(s, s in BARE_SERVERS, (*overrides, *(tier_sets if s in TIER_SERVERS else ()),
                                              *OWN_OVERRIDES.get(s, ())))
            for s in servers]


def server_config(spec: ServerSpec, config_path: str, policy: str) -> Any:
    """The config a server runs with, validated now (cli.policy_config: bare mirrors the engine replicas)."""
    from kvtide.benchmarks.cli import BARE_POLICY, policy_config

    return policy_config(config_path, list(spec.overrides), BARE_POLICY if spec.bare else policy)


@contextlib.contextmanager
def serving(spec: ServerSpec, config: Any, log_dir: Path, args: argparse.Namespace) -> Iterator[Any]:
    """The server running, as `kvtide bench compare` starts it; every process stopped on exit. kvtide's Ray
    exports metrics every `--metrics-report-interval-ms`, so the counters settle after a run sooner."""
    from kvtide.benchmarks.bare_fleet import fleet_size
    from kvtide.benchmarks.cli import Target

    n = fleet_size(config)
    if spec.bare:
        from kvtide.benchmarks import bare_fleet

        with bare_fleet.running(config, log_dir, request_timeout_s=args.request_timeout,
                                balancer=args.bare_balancer) as fleet:
            yield Target(fleet.base_url, fleet.metrics_urls, fleet.model_name, fleet.note, n)
    else:
        from kvtide.cluster import local

        with local.running(config, metrics_report_interval_ms=args.metrics_report_interval_ms or None) as cluster:
            yield Target(cluster.base_url, cluster.metrics_url, cluster.model_name, num_replicas=n)


async def measure(target: Any, warm: Any, measured: Any, server: str, args: argparse.Namespace,
                  level: Any) -> tuple[dict[str, Any], Any]:
    """Against one fresh server: warm-up requests, the unmeasured first round, the counters settled; then
    `cli.bench_once` on the measured rounds with the tier counters scraped around it."""
    from kvtide.benchmarks.cli import _settled_after, _warmup, bench_once, scrape
    from kvtide.benchmarks.loadgen import run_load
    from kvtide.benchmarks.workloads import oracle_hit_rate_after

    async with httpx.AsyncClient(timeout=10.0) as client:
        initial = await scrape(client, target.metrics)
        warm_ok = await _warmup(target.base_url, target.model_name, args.endpoint, args.warmup)
        first = await run_load(target.base_url, warm.requests, concurrency=args.warm_concurrency,
                               duration_s=args.request_timeout, model=target.model_name, endpoint=args.endpoint,
                               request_timeout_s=args.request_timeout, progress=False)
        first_ok = sum(r.ok for r in first.results)
        # The tier counters before the measured rounds must already include the warm-up and the first round.
        await _settled_after(client, target.metrics, initial, warm_ok + first_ok, args.metrics_settle)
        before = await scrape_tiers(client, target.metrics)
    report, load = await bench_once(target.base_url, target.metrics, measured, server, args, target.model_name,
                                    level, warmup=0, num_replicas=target.num_replicas)
    async with httpx.AsyncClient(timeout=10.0) as client:
        after = await scrape_tiers(client, target.metrics)  # bench_once returned once the counters settled
    sent = measured.requests[: len(load.results)]
    bound = oracle_hit_rate_after(warm.requests, sent)
    delta = tier_delta(before, after) if before is not None and after is not None else None
    tiers = tier_rates(delta) if delta is not None else None
    hit = (tiers or {}).get("hit_rate")
    entry = {"run": report, "first_round": {"requests": len(first.results), "errors": len(first.results) - first_ok,
                                            "duration_s": first.duration_s},
             "infinite_cache_hit_rate": bound, "tiers": tiers, "tier_counters_by_engine": delta,
             "hit_rate_vs_infinite_cache": hit / bound if hit is not None and bound else None}
    return entry, load


def split_rounds(workload: Any) -> tuple[Any, Any]:
    """(the first round, the rest) of a prefix-revisit workload, each a Workload."""
    from kvtide.benchmarks.workloads import Workload

    groups = workload.params.num_groups
    return (Workload(workload.name, workload.params, workload.seed, workload.requests[:groups]),
            Workload(workload.name, workload.params, workload.seed, workload.requests[groups:]))


def token_counter(tokenizer: str | None, tokens_per_word: float) -> Callable[[str], int]:
    """Tokens of a text: the served model's tokenizer when given, else words × tokens per word."""
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        return lambda text: len(tok.encode(text, add_special_tokens=False))
    return lambda text: round(len(text.split()) * tokens_per_word)


def workload_sizes(config: Any, model_path: str, workload: Any, count: Callable[[str], int]) -> dict[str, Any]:
    """`sizes` for this config's engines and this workload."""
    from kvtide.benchmarks.bare_fleet import fleet_size

    warm, _ = split_rounds(workload)
    model_config = json.loads((Path(model_path) / "config.json").read_text())
    tier = getattr(getattr(config.engine, "kv_offload", None), "size_gib", None)
    return sizes(model_config=model_config, dtype=config.engine.dtype, block_size=config.engine.block_size,
                 replicas=fleet_size(config), gpu_kv_bytes=config.engine.kv_cache_memory_bytes, cpu_tier_gib=tier,
                 prefix_tokens=[count(r.messages[0]["content"]) for r in warm.requests],
                 request_tokens=[sum(count(m["content"]) for m in r.messages) for r in workload.requests],
                 groups=[r.group for r in workload.requests])


def _parser() -> argparse.ArgumentParser:
    from kvtide.benchmarks.cli import _add_load_flags
    from kvtide.benchmarks.protocol import CLAIM_MIN_REPEATS

    p = argparse.ArgumentParser(prog="python -m kvtide.benchmarks.kv_tier", description=__doc__.split("\n")[0])
    p.add_argument("--config", "-c", help="kvtide config YAML (default: the embedded CPU demo config)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every server (repeatable)")
    p.add_argument("--tier-set", dest="tier_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the tier servers only, e.g. engine.kv_offload.size_gib=16 (repeatable)")
    p.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                   help=f"comma-separated subset of {', '.join(SERVERS)} (default: {', '.join(DEFAULT_SERVERS)})")
    p.add_argument("--policy", default="prefix_aware", help="routing.policy of the kvtide servers")
    p.add_argument("--repeats", type=int, default=CLAIM_MIN_REPEATS, help="measured fresh starts per server")
    p.add_argument("--warmup-start", action="store_true",
                   help="first one unmeasured start per server (the protocol's warm-up; one more start each)")
    p.add_argument("--warm-concurrency", type=int, default=8, help="requests in flight in the unmeasured first round")
    p.add_argument("--bare-balancer", choices=("auto", "haproxy", "python"), default="auto")
    p.add_argument("--metrics-report-interval-ms", type=int, default=1000,
                   help="kvtide's Ray metric export period (Ray's default: 10 s; 0 keeps it)")
    p.add_argument("--hardware", help="what it ran on, for the report")
    p.add_argument("--out-dir", required=True)
    w = p.add_argument_group(f"workload ({WORKLOAD}; unset: its defaults)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--num-groups", type=int)
    w.add_argument("--num-rounds", type=int, help="rounds, the first unmeasured (at least 2)")
    w.add_argument("--system-prompt-len", type=int, help="prefix tokens per group")
    w.add_argument("--question-len", type=int)
    w.add_argument("--output-len", type=int)
    w.add_argument("--revisit-window", type=int)
    w.add_argument("--tokens-per-word", type=float, default=None)
    w.add_argument("--tokenizer", help="the served model's tokenizer folder: calibrates words and counts tokens")
    _add_load_flags(p)
    p.set_defaults(max_requests=None)
    return p


def main(argv: list[str] | None = None) -> int:
    from kvtide.benchmarks.bare_fleet import fleet_size
    from kvtide.benchmarks.cli import REPEAT_SEED_STRIDE, _one_line, _write_samples, loads_from_args
    from kvtide.benchmarks.cli import point_seed_offset, workload_from_args
    from kvtide.benchmarks.overhead import resolve_engine_configs
    from kvtide.benchmarks.processes import stop_servers_on_sigterm
    from kvtide.benchmarks.protocol import provenance, schedule
    from kvtide.benchmarks.workloads import DEFAULT_TOKENS_PER_WORD, calibrate_tokens_per_word
    from kvtide.config import default_config_path
    from kvtide.deployments.engine.demo_model import resolve_model
    from kvtide.deployments.engine.placement import engine_kwargs

    parser = _parser()
    args = parser.parse_args(argv)
    args.workload = WORKLOAD
    try:
        specs = server_specs([s.strip() for s in args.servers.split(",") if s.strip()], args.overrides,
                             args.tier_sets)
    except ValueError as exc:
        parser.error(str(exc))
    if args.repeats < 1:
        parser.error("--repeats must be 1 or more")
    stop_servers_on_sigterm()
    command_argv = list(sys.orig_argv) if argv is None else [sys.executable, "-m", "kvtide.benchmarks.kv_tier", *argv]
    prov = provenance(command_argv)
    config_path = args.config or default_config_path()
    configs = {s.name: server_config(s, config_path, args.policy) for s in specs}
    if args.tokens_per_word is None:
        args.tokens_per_word = calibrate_tokens_per_word(args.tokenizer) if args.tokenizer else DEFAULT_TOKENS_PER_WORD
    level = loads_from_args(args)[0]
    seed_of = lambda repeat: point_seed_offset(WORKLOAD, level) + REPEAT_SEED_STRIDE * repeat  # noqa: E731
    first_workload = workload_from_args(args, WORKLOAD, seed_offset=seed_of(0))
    if first_workload.params.num_rounds < 2:
        parser.error("--num-rounds must be 2 or more: the first round is unmeasured")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    any_config = next(iter(configs.values()))
    model_path = resolve_model(any_config.model)
    tier_config = next((configs[s.name] for s in specs if s.name in TIER_SERVERS), any_config)
    tier_gib = getattr(tier_config.engine.kv_offload, "size_gib", None)
    notes: list[str] = []
    if not tier_gib:
        notes.append("No CPU tier configured (`--tier-set engine.kv_offload.size_gib=…`): the tier servers ran "
                     "without one. A plumbing run, no claim about the tier.")
    shm: dict[str, Any] = {"path": str(SHM_DIR), "needed_bytes": shm_needed_bytes(tier_gib, fleet_size(tier_config))}
    if tier_gib:
        try:
            shm["free_bytes"] = shutil.disk_usage(SHM_DIR).free
        except OSError as exc:
            shm["free_bytes"] = None
            notes.append(f"{SHM_DIR} not readable ({exc}): the tier's shared memory was not checked.")
        if shm.get("free_bytes") is not None and shm["free_bytes"] < shm["needed_bytes"]:
            print(f"kv_tier: {SHM_DIR} has {shm['free_bytes']} B free, the tier servers' engines populate "
                  f"{shm['needed_bytes']} B there at start: give the machine more shared memory or a smaller "
                  "engine.kv_offload.size_gib", file=sys.stderr)
            return 2
    try:
        sizes_ = workload_sizes(tier_config, model_path, first_workload,
                                token_counter(args.tokenizer, args.tokens_per_word))
    except (OSError, KeyError, ValueError) as exc:
        sizes_ = None
        notes.append(f"Sizes not computed: {type(exc).__name__}: {exc}")

    # Resolved apart from the servers (a child process, as the overhead benchmark does), beside the first start.
    kinds = {s.name: ("vllm" if s.bare else "kvtide", engine_kwargs(configs[s.name], model_path)) for s in specs}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    resolving = pool.submit(resolve_engine_configs, kinds, out / "engine-configs.log")

    names = [s.name for s in specs]
    order = [r for r in schedule(names, args.repeats) if args.warmup_start or not r.warmup]
    runs: dict[str, list[dict[str, Any] | None]] = {s: [None] * args.repeats for s in names}
    failed: dict[str, str] = {}
    skipped: set[str] = set()
    results: dict[str, Any] = {
        "provenance": prov, "command": prov["command"], "hardware": args.hardware, "servers": names,
        "repeats": args.repeats, "warmup_start": args.warmup_start,
        "order": [[r.server, r.repeat] for r in order], "order_runs": order,
        "server_overrides": {s.name: list(s.overrides) for s in specs}, "policy": args.policy,
        "workload": {"name": WORKLOAD, "params": vars(first_workload.params), "load": level.label,
                     "warmup_requests": args.warmup, "warm_concurrency": args.warm_concurrency,
                     "tokens_per_word": args.tokens_per_word},
        "sizes": sizes_, "shm": shm, "notes": notes, "runs": runs, "failed": failed,
        "targets_set": {"ttft_p90_ratio_at_most": TTFT_P90_RATIO_TARGET,
                        "hit_rate_vs_infinite_cache_at_least": HIT_VS_INFINITE_TARGET},
    }
    spec_of = {s.name: s for s in specs}
    for run in order:
        server = run.server
        if server in skipped:
            continue
        stem = f"{server}-warmup" if run.warmup else f"{server}-r{run.repeat + 1}"
        workload = workload_from_args(args, WORKLOAD, seed_offset=-1 if run.warmup else seed_of(run.repeat))
        warm, measured = split_rounds(workload)
        print(f"kv_tier: {run.label}: starting {server} ...", flush=True)
        before = offload_files() if SHM_DIR.is_dir() else set()
        try:
            with serving(spec_of[server], configs[server], out / "logs" / stem, args) as target:
                entry, load = asyncio.run(measure(target, warm, measured, server, args, level))
            if not run.warmup:
                runs[server][run.repeat] = {**entry, "repeat": run.repeat}
                _write_samples(out / f"{server}.r{run.repeat}.requests.jsonl", load)
            tiers = entry["tiers"] or {}
            print(f"kv_tier: {run.label}: {_one_line(entry['run'])}; by tier: GPU {tiers.get('gpu_hit_rate')}, "
                  f"CPU {tiers.get('cpu_hit_rate')}, infinite cache {entry['infinite_cache_hit_rate']}", flush=True)
        except Exception as exc:  # one server failing must not lose the others' runs
            print(f"kv_tier: {run.label} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            failed[run.label] = f"{type(exc).__name__}: {str(exc)[:500]} (its later runs skipped)"
            skipped.add(server)
        finally:
            # Its engines are stopped: a tier file still there was left by one killed in its stop.
            for path in new_offload_files(before) if SHM_DIR.is_dir() else []:
                with contextlib.suppress(OSError):
                    path.unlink()
                    shm["removed"] = shm.get("removed", 0) + 1
        write_results(out, results, resolving)
    write_results(out, results, resolving, wait=True)
    pool.shutdown()
    print((out / "report.md").read_text())
    return 1 if failed else 0


def write_results(out: Path, results: dict[str, Any], resolving: concurrent.futures.Future, wait: bool = False) -> None:
    """results.json and report.md from the runs so far (and the resolved engines once resolved)."""
    if (wait or resolving.done()) and "engine" not in results:
        configs, notes = resolving.result()
        results["engine"] = {"servers": {s: {"engine_config": configs.get(s), "engine_config_note": notes.get(s)}
                                         for s in results["servers"]},
                             "differences": engine_differences(configs)}
    results["summary"] = summarize_servers(results["runs"])
    results["targets"] = targets(results["summary"])
    bounds = [e["infinite_cache_hit_rate"] for entries in results["runs"].values() for e in entries if e is not None]
    from kvtide.benchmarks.protocol import summarize_repeats

    results["infinite_cache_hit_rate"] = summarize_repeats(bounds) if bounds else None
    data = {k: v for k, v in results.items() if k != "order_runs"}
    (out / "results.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out / "report.md").write_text(report_markdown(results))


if __name__ == "__main__":
    sys.exit(main())
