"""`kvtide plan`: KV capacity of a replica and a suggested TP size (see `autoscaling.capacity`).

    kvtide plan --model /models/llama-70b --gpu-mem-gib 80 --max-model-len 32768
    kvtide plan --layers 80 --kv-heads 8 --head-dim 128 --params-b 70.6 --gpu-mem-gib 139 --tp 4 --max-model-len 131072
    kvtide plan --config my.yaml --gpu-mem-gib 139     (model, TP, context, dtypes, CPU KV tier from the config)
    kvtide plan --model /models/llama-8b --gpu-mem-gib 80 --max-model-len 8192 --kv-offload-gib 64 --working-set-tokens 20000000

`cluster.cli` calls `register(subparsers)`; the command is thin: flags → ModelShape →
plan_capacity → format_plan.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvtide.autoscaling.capacity import (
    DEFAULT_ACTIVATION_RESERVE_GIB,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MIN_FULL_CONTEXT_REQUESTS,
    ModelShape,
    PlanError,
    bytes_per_elem,
    format_plan,
    plan_as_dict,
    plan_capacity,
    read_model_config,
    shape_from_config,
)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to kvtide's CLI."""
    parser = subparsers.add_parser(
        "plan", help="KV bytes per token, KV capacity per replica and a suggested TP size",
        description="Capacity planning from a model's shape: give --model (a local HF directory with "
                    "config.json) or --layers/--kv-heads/--head-dim.")
    parser.add_argument("--config", "-c", help="a kvtide config: its model, engine.tensor_parallel_size, "
                                               "max_model_len, dtype, gpu_memory_utilization, block_size, "
                                               "kv_offload.size_gib and extra_args.kv_cache_dtype fill the flags "
                                               "not given")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="local HF-format model directory (reads its config.json)")
    source.add_argument("--layers", type=int, help="number of decoder layers")
    parser.add_argument("--kv-heads", type=int, help="KV heads per layer (with --layers)")
    parser.add_argument("--head-dim", type=int, help="dimension of one attention head (with --layers)")
    parser.add_argument("--attention-heads", type=int, help="query heads (optional; TP must divide it)")
    parser.add_argument("--dtype", help="weights and KV dtype, e.g. bf16, fp16, fp8 (default: config.json's, else bf16)")
    parser.add_argument("--kv-cache-dtype", help="KV cache dtype when it differs from --dtype (e.g. fp8)")
    parser.add_argument("--params-b", type=float, help="parameters in billions (default: estimated from config.json)")
    parser.add_argument("--gpu-mem-gib", type=float, required=True, help="memory of one GPU, in GiB")
    parser.add_argument("--tp", type=int, help="tensor parallel size of one replica (default 1)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + completion, in tokens")
    parser.add_argument("--gpu-util", type=float,
                        help=f"share of GPU memory vLLM uses (default {DEFAULT_GPU_MEMORY_UTILIZATION})")
    parser.add_argument("--reserve-gib", type=float, default=DEFAULT_ACTIVATION_RESERVE_GIB,
                        help=f"activation/graph reserve per GPU in GiB (default {DEFAULT_ACTIVATION_RESERVE_GIB})")
    parser.add_argument("--min-full-context", type=int, default=DEFAULT_MIN_FULL_CONTEXT_REQUESTS,
                        help="full-context requests the suggested TP size must hold "
                             f"(default {DEFAULT_MIN_FULL_CONTEXT_REQUESTS})")
    parser.add_argument("--block-size", type=int, help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})")
    parser.add_argument("--kv-offload-gib", type=float,
                        help="host memory of each replica's CPU KV tier, in GiB (engine.kv_offload.size_gib)")
    parser.add_argument("--working-set-tokens", type=int,
                        help="prompt tokens whose KV the fleet should keep cached: the replicas that hold them")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    trace = parser.add_argument_group(
        "fleet size on a trace (second step: the simulator, `kvtide simulate`, with the KV per replica above)")
    trace.add_argument("--trace", help="Mooncake-format JSON lines: find the smallest fleet that meets --slo-ttft-p90-ms")
    trace.add_argument("--slo-ttft-p90-ms", type=float, help="TTFT p90 objective, milliseconds (with --trace)")
    trace.add_argument("--profile", default="llama-8b-h100", help="the simulator's engine step profile")
    trace.add_argument("--block-tokens", type=int, default=64, help="tokens per hash id of the trace")
    trace.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's timestamps")
    trace.add_argument("--policies", default="prefix_aware,round_robin", help="routing policies to plan for")
    trace.add_argument("--max-replicas", type=int, default=256)
    parser.set_defaults(func=cmd_plan)
    return parser


def _fill_from_config(args: argparse.Namespace) -> None:
    """Flags left out take the kvtide config's values (`--config`), then the defaults; the shape source is required."""
    if args.config:
        from kvtide.config import ConfigError, load_config

        try:
            config = load_config(args.config)
        except ConfigError as exc:
            raise PlanError(str(exc)) from None
        engine = config.engine
        if args.model is None and args.layers is None:
            args.model = config.model
        args.tp = args.tp or engine.tensor_parallel_size
        args.max_model_len = args.max_model_len or engine.max_model_len
        args.dtype = args.dtype or (None if engine.dtype == "auto" else engine.dtype)
        args.gpu_util = args.gpu_util or engine.gpu_memory_utilization
        if args.block_size is None:
            args.block_size = engine.block_size
        if args.kv_offload_gib is None:
            args.kv_offload_gib = engine.kv_offload.size_gib
        kv_cache_dtype = engine.extra_args.get("kv_cache_dtype")
        if not args.kv_cache_dtype and kv_cache_dtype not in (None, "auto"):
            args.kv_cache_dtype = kv_cache_dtype
    if args.model is None and args.layers is None:
        raise PlanError("give --model DIR, the shape (--layers, --kv-heads, --head-dim) or --config")
    if args.max_model_len is None:
        raise PlanError("give --max-model-len (or --config)")
    args.tp = args.tp or 1
    args.gpu_util = args.gpu_util or DEFAULT_GPU_MEMORY_UTILIZATION
    if args.block_size is None:
        args.block_size = DEFAULT_BLOCK_SIZE


def _shape_from_args(args: argparse.Namespace) -> ModelShape:
    if args.model:
        shape = shape_from_config(read_model_config(args.model), dtype=args.dtype)
    else:
        if args.kv_heads is None or args.head_dim is None:
            raise PlanError("--layers needs --kv-heads and --head-dim too (or pass --model)")
        shape = ModelShape(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                           dtype=args.dtype or "bfloat16", num_attention_heads=args.attention_heads)
    if min(shape.num_layers, shape.num_kv_heads, shape.head_dim) < 1:
        raise PlanError("--layers, --kv-heads and --head-dim must be >= 1")
    if args.params_b is not None:
        shape = ModelShape(**{**shape.__dict__, "num_params": int(args.params_b * 1e9)})
    return shape


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        _fill_from_config(args)
        shape = _shape_from_args(args)
        weights_bytes = None if shape.num_params is None else shape.num_params * bytes_per_elem(shape.dtype)
        kv_shape = shape if not args.kv_cache_dtype else ModelShape(**{**shape.__dict__, "dtype": args.kv_cache_dtype})
        plan = plan_capacity(kv_shape, args.gpu_mem_gib, args.max_model_len, args.tp, weights_bytes=weights_bytes,
                             gpu_memory_utilization=args.gpu_util, activation_reserve_gib=args.reserve_gib,
                             min_full_context_requests=args.min_full_context, block_size=args.block_size,
                             kv_offload_gib=args.kv_offload_gib, working_set_tokens=args.working_set_tokens)
    except PlanError as exc:
        print(f"kvtide plan: {exc}", file=sys.stderr)
        return 2
    if not args.trace:
        print(json.dumps(plan_as_dict(kv_shape, plan), indent=2) if args.json else format_plan(kv_shape, plan))
        return 0
    if args.slo_ttft_p90_ms is None:
        print("kvtide plan: --trace needs --slo-ttft-p90-ms", file=sys.stderr)
        return 2
    planner = trace_planner()
    if planner is None:
        print("kvtide plan: --trace needs kvtide's simulator (entry point group "
              f"{PLANNERS_GROUP!r}); reinstall kvtide", file=sys.stderr)
        return 2
    try:
        fleet = planner(kv_bytes_per_replica=plan.kv_bytes_per_replica, kv_bytes_per_token=plan.kv_bytes_per_token,
                        max_model_len=plan.max_model_len, args=args,
                        cpu_kv_bytes_per_replica=plan.cpu_kv_bytes_per_replica)
    except ValueError as exc:
        print(f"kvtide plan: {exc}", file=sys.stderr)
        return 2
    if plan.cpu_kv_bytes_per_replica:
        fleet["cpu_kv_tier"] = TRACE_WITH_CPU_TIER
    if args.json:
        print(json.dumps({**plan_as_dict(kv_shape, plan), "fleet": fleet}, indent=2))
    else:
        print(format_plan(kv_shape, plan))
        for policy, entry in fleet["policies"].items():
            size = f"{entry['replicas']} replicas" if entry["replicas"] else f"more than {args.max_replicas} replicas"
            print(f"fleet for TTFT p90 <= {args.slo_ttft_p90_ms:g} ms on {args.trace} ({policy}, simulated): {size}")
        if plan.cpu_kv_bytes_per_replica:
            print(f"fleet on the trace:       {TRACE_WITH_CPU_TIER}")
    return 0 if all(entry["replicas"] for entry in fleet["policies"].values()) else 1


# The simulator's engines carry the planned tier (simulator/engine.py, invariant 8), its loads timed at
# engine.kv_offload.load_gib_per_s's default; its latencies are not yet validated against GPU runs.
TRACE_WITH_CPU_TIER = ("simulated with the CPU tier on every replica (loads at the default host link rate; the "
                       "simulator's latencies are not yet validated against a GPU run)")


# The fleet-size step on a trace lives in kvtide.simulator (a layer above this one): found through this
# entry point group, never imported.
PLANNERS_GROUP = "kvtide.planners"


def trace_planner():
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=PLANNERS_GROUP) if ep.name == "trace"]
    return found[0].load() if found else None
