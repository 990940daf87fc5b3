"""The engine a replica runs, resolved as `vllm serve` resolves it.

vLLM fills the settings a user leaves unset (max_num_batched_tokens, max_num_seqs, …) from
tables keyed by its usage context: `vllm serve` resolves under OPENAI_API_SERVER, while
`AsyncLLM.from_engine_args` defaults to ENGINE_CONTEXT, which falls back to the scheduler's
generic defaults (on a ≥70 GiB GPU, 2048 batched tokens instead of the server's 8192). A
replica is a drop-in for `vllm serve`, so it resolves its engine under the server's context:
the same flags give the same engine (tests/unit/test_engine_parity.py compares the resolved
configs field by field with vLLM's own CLI path).

`engine_config_summary` names the resolved settings a benchmark records per server.
"""

from __future__ import annotations

from typing import Any

# vLLM's UsageContext member `vllm serve` builds its engine under (its api_server entry's default).
SERVE_USAGE_CONTEXT = "OPENAI_API_SERVER"


def resolve_engine(kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(AsyncEngineArgs, VllmConfig) of engine `kwargs`, resolved under `vllm serve`'s usage context."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = AsyncEngineArgs(**kwargs)
    return args, args.create_engine_config(usage_context=UsageContext[SERVE_USAGE_CONTEXT])


def start_engine(kwargs: dict[str, Any], stat_loggers: list[Any]) -> Any:
    """An AsyncLLM for engine `kwargs`, built as `vllm serve` builds its engine client."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    args, vllm_config = resolve_engine(kwargs)
    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config, usage_context=UsageContext[SERVE_USAGE_CONTEXT], stat_loggers=stat_loggers,
        enable_log_requests=args.enable_log_requests, aggregate_engine_logging=args.aggregate_engine_logging,
        disable_log_stats=args.disable_log_stats)


def engine_config_summary(vllm_config: Any) -> dict[str, Any]:
    """The resolved settings that decide an engine's speed, as plain values (a benchmark JSON's
    `servers.<name>.engine_config`)."""
    scheduler, cache, model = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    compilation = vllm_config.compilation_config
    transfer = vllm_config.kv_transfer_config
    return {
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_num_seqs": scheduler.max_num_seqs,
        "enable_chunked_prefill": scheduler.enable_chunked_prefill,
        "block_size": cache.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "num_gpu_blocks": cache.num_gpu_blocks,
        "max_model_len": model.max_model_len,
        "dtype": str(model.dtype),
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "compilation_mode": str(compilation.mode),
        "cudagraph_mode": str(compilation.cudagraph_mode),
        "enforce_eager": model.enforce_eager,
        # The CPU KV tier (size None: none) and the KV connector vLLM resolved (the native tier's is the
        # OffloadingConnector; None: no connector).
        "kv_offloading_size": cache.kv_offloading_size,
        "kv_offloading_backend": cache.kv_offloading_backend,
        "kv_connector": transfer.kv_connector if transfer is not None else None,
    }
