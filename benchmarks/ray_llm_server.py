"""Ray Serve LLM's LLMServer with each CPU engine bound to its own cores (the `ray_kv` baseline).

Ray Serve LLM replicas share one runtime_env, so vLLM's CPU 'auto' binding would put every
engine on the same first cores. This subclass sets `VLLM_CPU_OMP_THREADS_BIND` from the
replica's rank, the binding kvtide's replica of the same rank gets, before its engine starts.
Imported only inside Ray Serve replicas (`server_cls` is given by name).
"""

from __future__ import annotations

import os

from ray import serve
from ray.serve.llm import LLMServer

from kvtide.deployments.engine.placement import cpu_threads_bind

CORES_ENV = "KVTIDE_BENCH_CORES"  # the cores the benchmark may bind engines to, comma-separated


class BoundLLMServer(LLMServer):
    async def __init__(self, llm_config, **kwargs):
        cores = [int(c) for c in os.environ.get(CORES_ENV, "").split(",") if c.strip()]
        if cores:
            rank = serve.get_replica_context().rank.rank
            tp = int(llm_config.engine_kwargs.get("tensor_parallel_size", 1))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(rank, tp, cores)
        await super().__init__(llm_config, **kwargs)
