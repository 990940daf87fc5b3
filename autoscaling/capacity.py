"""Capacity planning: how many tokens of KV cache a replica holds, and what TP size to ask for.

Pure arithmetic on a model's shape; `autoscaling.cli` reads flags or a config.json and
prints the plan. How many KV blocks a replica has is what the KV autoscaler scales on,
so this is the number to size min/max replicas with.

    KV bytes per token      = 2 (K and V) × layers × kv_heads × head_dim × bytes_per_elem
                              (Llama-3.1-70B, bf16: 2 × 80 × 8 × 128 × 2 = 327,680 B)
    weights bytes           = params × bytes_per_elem (params given, or estimated below)
    usable per GPU          = gpu_mem × gpu_memory_utilization (0.9, vLLM's default)
                              − weights / tp − activation_reserve (2 GiB: activation peak
                              of a prefill step, CUDA graphs, NCCL buffers; vLLM measures
                              it by profiling, this is a planning figure)
    KV capacity per replica = usable per GPU × tp, in tokens: ÷ (KV bytes per token ×
                              max(kv_heads, tp) / kv_heads), because with tp > kv_heads
                              every GPU still stores one whole KV head (replicated)

CPU KV tier (engine.kv_offload, vLLM's native KV offloading): size_gib of pinned host memory per
replica, the total over its TP workers, each holding its share of every block as on GPU:
    CPU-tier blocks         = size_gib × 2^30 ÷ (replicated KV bytes per token × block_size)
A working set of prompt tokens is held by GPU + CPU capacity; a block found in the CPU tier is
loaded back (a host→GPU copy), not recomputed. Running requests need their KV on GPU, so the
concurrency figures count the GPU tier alone.

Suggested TP: the smallest power of two (1, 2, 4, …, 64) whose replica holds at least
`min_full_context_requests` (default 4) requests at full `max_model_len`, and that
divides the attention-head count when it is known (vLLM's TP requirement). Above 8 it
spans nodes.

Parameter estimate from config.json (Llama-style decoder, gated MLP):
    embeddings = vocab × hidden × (1 if tie_word_embeddings else 2)
    per layer  = hidden × heads × head_dim × 2        (q, o)
               + hidden × kv_heads × head_dim × 2     (k, v)
               + 3 × hidden × intermediate            (gate, up, down)
               + 2 × hidden                           (norms)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30

BYTES_PER_ELEM = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "float8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_ACTIVATION_RESERVE_GIB = 2.0
DEFAULT_MIN_FULL_CONTEXT_REQUESTS = 4
DEFAULT_TYPICAL_LENS = (1024, 4096)
DEFAULT_BLOCK_SIZE = 16  # vLLM's and kvtide's engine.block_size default
_TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


class PlanError(ValueError):
    """A model shape or flag set that cannot be planned; the message says which and the fix."""


def bytes_per_elem(dtype: str) -> int:
    key = dtype.lower().removeprefix("torch.")
    if key not in BYTES_PER_ELEM:
        raise PlanError(f"dtype {dtype!r} is unknown; use one of {', '.join(sorted(BYTES_PER_ELEM))}")
    return BYTES_PER_ELEM[key]


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model's architecture that decide its KV and weight memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    num_attention_heads: int | None = None
    num_params: int | None = None  # known (--params-b) or estimated from config.json

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) × layers × kv_heads × head_dim × bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_elem(self.dtype)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal checkpoints nest the language model's shape under text_config.
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return {**config, **config["text_config"]}
    return config


def estimate_num_params(config: dict[str, Any]) -> int | None:
    """Llama-style parameter count from config.json; None when a needed field is missing."""
    config = _text_config(config)
    try:
        vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
        intermediate, layers = int(config["intermediate_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    per_layer = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
                 + 3 * hidden * intermediate + 2 * hidden)
    return embeddings + layers * per_layer + hidden


def shape_from_config(config: dict[str, Any], dtype: str | None = None) -> ModelShape:
    """ModelShape from a Hugging Face config.json dict; `dtype` overrides the file's."""
    config = _text_config(config)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        raise PlanError("config.json needs num_hidden_layers and num_attention_heads; "
                        "pass --layers/--kv-heads/--head-dim instead") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim")
    if not head_dim:
        if "hidden_size" not in config:
            raise PlanError("config.json has neither head_dim nor hidden_size; pass --head-dim")
        head_dim = int(config["hidden_size"]) // heads
    file_dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    chosen = dtype or str(file_dtype)
    bytes_per_elem(chosen)  # fail early on an unknown dtype
    return ModelShape(num_layers=layers, num_kv_heads=kv_heads, head_dim=int(head_dim), dtype=chosen,
                      num_attention_heads=heads, num_params=estimate_num_params(config))


def read_model_config(model_path: str | Path) -> dict[str, Any]:
    """A model directory's (or a config.json file's) contents."""
    path = Path(model_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"no config.json at {str(model_path)!r}; --model takes a local HF-format model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanError(f"{str(path)!r} is not valid JSON: {exc}") from None


@dataclass(frozen=True)
class CapacityPlan:
    """Everything `kvtide plan` prints, computed once."""

    kv_bytes_per_token: int
    weights_bytes: int
    tensor_parallel_size: int
    kv_bytes_per_replica: int  # negative: the weights do not fit
    kv_tokens_per_replica: int
    max_model_len: int
    max_full_context_requests: int
    requests_at_len: dict[int, int]
    suggested_tensor_parallel_size: int | None
    min_full_context_requests: int
    gpu_memory_utilization: float
    activation_reserve_gib: float
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_blocks_per_replica: int = 0
    # The CPU KV tier: its host memory per replica (engine.kv_offload.size_gib; 0: no tier) and what it holds.
    cpu_kv_bytes_per_replica: int = 0
    cpu_kv_tokens_per_replica: int = 0
    cpu_kv_blocks_per_replica: int = 0
    # Replicas whose KV holds a working set of prompt tokens: on GPU KV alone, and on GPU + CPU.
    working_set_tokens: int | None = None
    working_set_replicas_gpu: int | None = None
    working_set_replicas: int | None = None

    @property
    def fits(self) -> bool:
        return self.kv_tokens_per_replica >= self.max_model_len

    @property
    def total_kv_tokens_per_replica(self) -> int:
        """Tokens one replica's GPU KV and CPU tier hold together (the CPU tier alone holds none that run)."""
        if self.kv_tokens_per_replica <= 0:
            return 0
        return self.kv_tokens_per_replica + self.cpu_kv_tokens_per_replica


def _replicated_kv_bytes_per_token(shape: ModelShape, tp: int) -> float:
    """KV bytes one token takes over a replica's `tp` GPUs: with tp > kv_heads each GPU keeps a whole head."""
    return shape.kv_bytes_per_token * max(shape.num_kv_heads, tp) / shape.num_kv_heads


def _kv_for_tp(shape: ModelShape, weights_bytes: int, gpu_mem_gib: float, tp: int,
               gpu_memory_utilization: float, activation_reserve_gib: float) -> tuple[int, int]:
    """(KV bytes, KV tokens) one replica of `tp` GPUs holds."""
    per_gpu = gpu_mem_gib * GIB * gpu_memory_utilization - weights_bytes / tp - activation_reserve_gib * GIB
    kv_bytes = int(per_gpu * tp)
    return kv_bytes, max(int(kv_bytes // _replicated_kv_bytes_per_token(shape, tp)), 0)


def _cpu_tier(shape: ModelShape, tp: int, kv_offload_gib: float | None, block_size: int) -> tuple[int, int, int]:
    """(host bytes, tokens, blocks) of one replica's CPU KV tier of `kv_offload_gib` GiB; zeros without one.

    vLLM's tier holds whole blocks, each as many bytes as on the replica's GPUs together."""
    if kv_offload_gib is None:
        return 0, 0, 0
    host_bytes = int(kv_offload_gib * GIB)
    blocks = int(host_bytes // (_replicated_kv_bytes_per_token(shape, tp) * block_size))
    return host_bytes, blocks * block_size, blocks


def _replicas_holding(tokens: int, per_replica: int) -> int | None:
    """Replicas whose `per_replica` tokens of KV hold `tokens` together; None when a replica holds none."""
    return math.ceil(tokens / per_replica) if per_replica > 0 else None


def suggest_tp(shape: ModelShape, weights_bytes: int, gpu_mem_gib: float, max_model_len: int,
               min_full_context_requests: int = DEFAULT_MIN_FULL_CONTEXT_REQUESTS,
               gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
               activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB) -> int | None:
    """Smallest power-of-two TP holding `min_full_context_requests` full-context requests; None if none does."""
    for tp in _TP_CANDIDATES:
        if shape.num_attention_heads and shape.num_attention_heads % tp:
            continue
        _, tokens = _kv_for_tp(shape, weights_bytes, gpu_mem_gib, tp, gpu_memory_utilization, activation_reserve_gib)
        if tokens >= min_full_context_requests * max_model_len:
            return tp
    return None


def plan_capacity(
    shape: ModelShape,
    gpu_mem_gib: float,
    max_model_len: int,
    tensor_parallel_size: int = 1,
    *,
    weights_bytes: int | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB,
    typical_lens: tuple[int, ...] = DEFAULT_TYPICAL_LENS,
    min_full_context_requests: int = DEFAULT_MIN_FULL_CONTEXT_REQUESTS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_offload_gib: float | None = None,
    working_set_tokens: int | None = None,
) -> CapacityPlan:
    """The capacity of one replica of `tensor_parallel_size` GPUs (and of its CPU KV tier of `kv_offload_gib`
    GiB), the TP size to suggest, and the replicas that hold `working_set_tokens` of prompt KV."""
    if gpu_mem_gib <= 0 or max_model_len <= 0 or tensor_parallel_size < 1:
        raise PlanError("--gpu-mem-gib and --max-model-len must be > 0 and --tp >= 1")
    if block_size < 1:
        raise PlanError(f"--block-size {block_size}: a KV block holds at least one token")
    if kv_offload_gib is not None and kv_offload_gib <= 0:
        raise PlanError(f"--kv-offload-gib {kv_offload_gib:g}: the CPU KV tier's size must be > 0 "
                        "(leave it out for none)")
    if working_set_tokens is not None and working_set_tokens <= 0:
        raise PlanError(f"--working-set-tokens {working_set_tokens}: must be > 0")
    if weights_bytes is None:
        if shape.num_params is None:
            raise PlanError("the weights' size is unknown; pass --params-b (billions of parameters) "
                            "or --model with a config.json that has vocab/hidden/intermediate sizes")
        weights_bytes = shape.num_params * bytes_per_elem(shape.dtype)
    kv_bytes, kv_tokens = _kv_for_tp(shape, weights_bytes, gpu_mem_gib, tensor_parallel_size,
                                     gpu_memory_utilization, activation_reserve_gib)
    cpu_bytes, cpu_tokens, cpu_blocks = _cpu_tier(shape, tensor_parallel_size, kv_offload_gib, block_size)
    return CapacityPlan(
        kv_bytes_per_token=shape.kv_bytes_per_token,
        weights_bytes=weights_bytes,
        tensor_parallel_size=tensor_parallel_size,
        kv_bytes_per_replica=kv_bytes,
        kv_tokens_per_replica=kv_tokens,
        max_model_len=max_model_len,
        max_full_context_requests=kv_tokens // max_model_len,
        requests_at_len={n: kv_tokens // n for n in typical_lens if n <= max_model_len},
        suggested_tensor_parallel_size=suggest_tp(shape, weights_bytes, gpu_mem_gib, max_model_len,
                                                  min_full_context_requests, gpu_memory_utilization,
                                                  activation_reserve_gib),
        min_full_context_requests=min_full_context_requests,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve_gib=activation_reserve_gib,
        block_size=block_size,
        kv_blocks_per_replica=kv_tokens // block_size,
        cpu_kv_bytes_per_replica=cpu_bytes,
        cpu_kv_tokens_per_replica=cpu_tokens,
        cpu_kv_blocks_per_replica=cpu_blocks,
        working_set_tokens=working_set_tokens,
        working_set_replicas_gpu=None if working_set_tokens is None else _replicas_holding(
            working_set_tokens, kv_tokens),
        working_set_replicas=None if working_set_tokens is None else _replicas_holding(
            working_set_tokens, kv_tokens + cpu_tokens if kv_tokens > 0 else 0),
    )


def format_plan(shape: ModelShape, plan: CapacityPlan) -> str:
    """The plan as the lines `kvtide plan` prints."""
    def gib(num_bytes: int) -> str:
        return f"{num_bytes / GIB:,.1f} GiB"

    lines = [
        f"model shape:              {shape.num_layers} layers, {shape.num_kv_heads} KV heads, "
        f"head_dim {shape.head_dim}, {shape.dtype}",
        f"KV bytes per token:       {plan.kv_bytes_per_token:,}",
        f"weights:                  {plan.weights_bytes:,} bytes ({gib(plan.weights_bytes)})",
        f"tensor parallel size:     {plan.tensor_parallel_size} "
        f"(gpu_memory_utilization {plan.gpu_memory_utilization}, "
        f"activation reserve {plan.activation_reserve_gib} GiB per GPU)",
    ]
    if plan.kv_bytes_per_replica <= 0:
        lines.append(f"KV capacity per replica:  none: the weights do not fit in {plan.tensor_parallel_size} GPU(s)")
    else:
        lines.append(f"KV capacity per replica:  {plan.kv_tokens_per_replica:,} tokens "
                     f"({gib(plan.kv_bytes_per_replica)})")
        lines.append(f"max concurrent requests:  {plan.max_full_context_requests:,} at full context "
                     f"({plan.max_model_len:,} tokens)")
        for length, count in plan.requests_at_len.items():
            lines.append(f"                          {count:,} at {length:,} tokens")
        if plan.cpu_kv_bytes_per_replica:
            lines.append(f"CPU KV tier per replica:  {plan.cpu_kv_tokens_per_replica:,} tokens "
                         f"({plan.cpu_kv_blocks_per_replica:,} blocks of {plan.block_size}) "
                         f"in {gib(plan.cpu_kv_bytes_per_replica)} of host memory")
            lines.append(f"GPU + CPU KV per replica: {plan.total_kv_tokens_per_replica:,} tokens of cached prompts: "
                         "a hit in the CPU tier costs a load (host→GPU copy), not a recompute; running requests "
                         "need GPU KV (the counts above)")
            lines.append(f"host memory per replica:  {gib(plan.cpu_kv_bytes_per_replica)} pinned for the tier, on top "
                         "of what its pod needs otherwise (the chart adds it per engine to worker pods' memory and "
                         "/dev/shm)")
    if plan.working_set_tokens is not None:
        lines.append(_working_set_line(plan))
    suggested = plan.suggested_tensor_parallel_size
    lines.append(
        f"suggested TP size:        {suggested} (smallest power of two holding "
        f">= {plan.min_full_context_requests} full-context requests)"
        if suggested is not None else
        f"suggested TP size:        none up to {_TP_CANDIDATES[-1]} holds "
        f"{plan.min_full_context_requests} full-context requests; lower --max-model-len"
    )
    return "\n".join(lines)


def _working_set_line(plan: CapacityPlan) -> str:
    """The replicas whose KV holds the working set: GPU + CPU where a tier is configured, next to GPU alone."""
    head = f"working set of {plan.working_set_tokens:,} tokens: "
    if plan.working_set_replicas_gpu is None:
        return head + "no replica holds any of it (the weights leave no KV cache)"
    if not plan.cpu_kv_bytes_per_replica:
        return head + f"{plan.working_set_replicas_gpu:,} replicas hold it in GPU KV"
    return (head + f"{plan.working_set_replicas:,} replicas hold it in GPU + CPU KV "
            f"({plan.working_set_replicas_gpu:,} in GPU KV alone); CPU-tier hits cost a load, not a recompute")


def plan_as_dict(shape: ModelShape, plan: CapacityPlan) -> dict[str, Any]:
    """JSON-ready plan (for `kvtide plan --json`)."""
    data = asdict(plan)
    data["total_kv_tokens_per_replica"] = plan.total_kv_tokens_per_replica
    data["requests_at_len"] = {str(k): v for k, v in plan.requests_at_len.items()}
    data["model_shape"] = asdict(shape)
    return data


__all__ = ["CapacityPlan", "ModelShape", "PlanError", "bytes_per_elem", "estimate_num_params", "format_plan",
           "plan_as_dict", "plan_capacity", "read_model_config", "shape_from_config", "suggest_tp"]
