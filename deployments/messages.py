"""What crosses the ingress → engine boundary (a DeploymentHandle call).

Why a boundary type: the ingress tokenizes once and the engine never sees text input,
so the request carries token ids plus plain sampling values; the engine streams back
small deltas. Both sides are plain dataclasses so Ray pickles them cheaply and
neither side imports the other's heavy dependencies (vLLM stays out of the ingress).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Mapping


# OpenAI's neutral sampling values (vLLM's server uses the same): what an unset field means
# when the model's generation_config gives no default.
_NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                     "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling values the ingress validated; None means the engine's default."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks, tests)
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def vllm_kwargs(self, model_defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """vLLM SamplingParams arguments. A field the request left unset takes, as in vLLM's
        server, the model's default (`model_defaults`: its generation_config's sampling
        values, vLLM's `get_diff_sampling_param()`), else OpenAI's neutral default."""
        defaults = {**_NEUTRAL_SAMPLING, **(model_defaults or {})}

        def value(name: str) -> Any:
            sent = getattr(self, name)
            return defaults[name] if sent is None else sent

        return {
            "max_tokens": self.max_tokens,
            **{name: value(name) for name in _NEUTRAL_SAMPLING},
            "seed": self.seed,
            "stop": list(self.stop) or None,
            "stop_token_ids": list(self.stop_token_ids) or None,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
        }


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    # Chained hashes of the prompt's full KV blocks (deployments.routing.block_hash),
    # computed once at the ingress; the prefix-aware router matches on them.
    block_hashes: tuple[int, ...] = ()
    # The rendered prompt text, only for the ray_prefix baseline router (Ray Serve LLM's
    # PrefixCacheAffinityRouter matches characters of an argument's `prompt`).
    prompt: str | None = None
    # vLLM's prefix-cache isolation key; block_hashes already start from its salt_root.
    cache_salt: str | None = None
    # A multi-turn conversation's id (prompts.session_key): prefix_aware keeps it on one replica.
    session_key: str | None = None
    # Written by the request router in the caller's process (routing.trust.write_prediction:
    # the replica it ranked first and the cached tokens it counted there), read by the frontend
    # when the stream ends. Mutable inside a frozen request on purpose: the router receives
    # this very object. Plain data, so it pickles along to the engine (a few bytes); out of
    # eq/hash/repr. A retry's dataclasses.replace shares the dict, so it holds the last pick.
    decision: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class RoutingKey:
    """What a pick-only routing call (direct mode's routing peer) hands the engine's request router.

    The same attributes the routers read off a GenerateRequest (block_hashes; prompt for the
    ray_prefix baseline), without a request to send: the router only names a replica.
    """

    block_hashes: tuple[int, ...] = ()
    prompt: str | None = None
    # A multi-turn conversation's id (the OpenAI `user` field or an x-session-id header):
    # prefix_aware keeps its turns on one replica while under the load guard. None: no session.
    session_key: str | None = None
    # The router's prediction for its pick (routing.trust.write_prediction), read by the routing
    # peer once choose_replica returns; the same slot as GenerateRequest.decision.
    decision: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The replica holding the stored response this request continues (routing.response_pins):
    # every router sends it there while that replica runs (routing.ray_router.pinned_rank).
    pinned_replica: str | None = None


@dataclass
class GenerateDelta:
    """One streamed step: new text, token counts so far, and the finish reason at the end."""

    text: str
    num_output_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    # On the first delta with tokens: the engine's own time from the call to that token
    # (queue + prefill), so the frontend can tell the serving path's share of TTFT.
    engine_ttft_s: float | None = None
    # Which engine replica served it (surfaced as the x-kvtide-replica response header).
    replica_id: str = ""
    # The output token ids of this step (the client's `return_token_ids`).
    token_ids: tuple[int, ...] = ()
    # What stopped generation when finish_reason is "stop": the stop string or stop token id
    # matched (None for EOS), as vLLM's server reports it.
    stop_reason: int | str | None = None


@dataclass
class VllmLayerCall:
    """A request for vLLM's own serving layer on an engine replica (ingress mode): the HTTP request
    as the frontend received it, with what the engine deployment's request router reads off a
    call (block_hashes, session_key, prompt, decision), so it is routed like a GenerateRequest."""

    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    method: str = "POST"
    query_string: bytes = b""  # GET /v1/responses/{id} takes its options there
    block_hashes: tuple[int, ...] = ()
    session_key: str | None = None
    prompt: str | None = None
    decision: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    pinned_replica: str | None = None  # as RoutingKey's: a stored response's replica


# ---- the path a generation request takes, and what its engine call books --------------------

# kvtide's own path (plain chat and completions) or vLLM's serving layer in the replica (tools, structured
# outputs, logprobs, Responses, Messages, ...): frontend/vllm_layer.request_path decides, once per request.
KVTIDE_PATH = "kvtide"
VLLM_LAYER_PATH = "vllm_layer"
PATHS = (KVTIDE_PATH, VLLM_LAYER_PATH)


@dataclass(frozen=True)
class Routed:
    """What the router said about a request handed to vLLM's layer: its prediction (a routing.trust.Prediction;
    None: none made, or none trusted: a prediction header counts only under the routing peer's signature)."""

    prediction: Any = None


# The request being handed to vLLM's layer in this task (frontend/vllm_layer.VllmLayerResponse sets it); the
# engine calls vLLM's app makes for it read it (engine/request_book.BookedEngine).
ROUTED: ContextVar[Routed | None] = ContextVar("kvtide_routed", default=None)


@dataclass(frozen=True)
class Finished:
    """One generation's end as the engine booked it (engine/request_book.py): the engine's cached prompt tokens
    against the router's prediction, and the exclusive hits credited."""

    request_id: str
    path: str
    prediction: Any  # routing.trust.Prediction, or None
    num_prompt_tokens: int
    num_cached_tokens: int
    exclusive_hit_tokens: int
