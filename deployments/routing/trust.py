"""Index trust: the router's predicted cached tokens against what the engine really had cached.

Per request routed by prefix_aware, the router predicts how many prompt tokens the replica
it picks already holds (`RoutingDecision.matched_tokens`: engine digests ∪ its own routing
history); the engine reports how many it really served from its prefix cache (vLLM's
`num_cached_tokens`, on the last delta). Comparing the two says how far the index can be
trusted: a false hit means affinity pulled a request to a replica that had to prefill it
anyway, a missed hit means the index forgot a prefix the engine still held.

How the prediction travels to the place that learns the outcome (the OpenAI frontend):

    the request's slot   RoutingKey.decision / GenerateRequest.decision: a plain dict the
                         router writes (`write_prediction`) in the caller's process, the
                         very object handed to the router as `pending_request.args[0]`
    direct mode          the routing peer reads the slot after `choose_replica` and adds
                         `PREDICTED_CACHED_TOKENS_HEADER` (`prediction_header`); HAProxy sets
                         it on the request it forwards (it strips `x-serve-router-*` from
                         clients), the replica's frontend decodes it (`decode_prediction_header`)
    ingress mode         the frontend reads its own GenerateRequest's slot (`read_prediction`)
                         once the engine stream has opened (routing is over by then)

The prediction also carries `exclusive_tokens`, the cached tokens no other replica held: the
engine that serves the request adds what it really hit of them to its cache's worth
(`exclusive_hit_tokens`, reported to the autoscaler for a cache-aware scale-down).

The prediction names the replica it is about: Ray may send a request elsewhere (a full
replica rejects and the next rank is tried; HAProxy re-dispatches a refused connection),
and a prediction for replica A says nothing about what B had cached. `compare` drops it then.

No Ray import: the router adapter, the routing peer and the frontend hand plain values in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, MutableMapping

# Router-owned namespace (x-serve-router-): HAProxy strips it from client requests, so only
# the routing peer can set it. Value: "<predicted cached tokens>;<replica unique id>;<exclusive tokens>"
# (the last field may be absent: 0).
PREDICTED_CACHED_TOKENS_HEADER = "x-serve-router-kvtide-predicted-cached-tokens"

Outcome = Literal["true_hit", "false_hit", "missed_hit", "true_miss"]
OUTCOMES: tuple[Outcome, ...] = ("true_hit", "false_hit", "missed_hit", "true_miss")
Direction = Literal["exact", "over", "under"]
DIRECTIONS: tuple[Direction, ...] = ("exact", "over", "under")

# Keys of the slot dict; plain values only, so the slot pickles with a GenerateRequest.
_REPLICA = "replica_id"
_TOKENS = "predicted_cached_tokens"
_EXCLUSIVE = "exclusive_tokens"
_MAX_TOKEN_DIGITS = 9  # a header is parsed, not trusted blindly: no 10^9-token prompts exist


@dataclass(frozen=True)
class Prediction:
    """The router's claim: `replica_id` holds the request's first `cached_tokens` prompt tokens,
    `exclusive_tokens` of them held by no other replica it knew of."""

    replica_id: str
    cached_tokens: int
    exclusive_tokens: int = 0


@dataclass(frozen=True)
class Comparison:
    """One request's prediction against the engine's report."""

    outcome: Outcome
    error_tokens: int  # engine cached − predicted (after `engine_cacheable_tokens`): > 0 under-, < 0 over-predicted

    @property
    def direction(self) -> Direction:
        if self.error_tokens == 0:
            return "exact"
        return "under" if self.error_tokens > 0 else "over"


# ---- the slot ------------------------------------------------------------------------------


def write_prediction(slot: MutableMapping[str, Any], replica_id: str, cached_tokens: int,
                     exclusive_tokens: int = 0) -> None:
    """The router's write: the replica it ranked first, the cached tokens it counted there and how
    many of them no other replica held."""
    slot[_REPLICA] = replica_id
    slot[_TOKENS] = int(cached_tokens)
    slot[_EXCLUSIVE] = int(exclusive_tokens)


def read_prediction(slot: Mapping[str, Any] | None) -> Prediction | None:
    """The prediction a router wrote into `slot`; None when none did (another policy, no candidates)."""
    if not slot:
        return None
    replica_id, tokens, exclusive = slot.get(_REPLICA), slot.get(_TOKENS), slot.get(_EXCLUSIVE, 0)
    if not isinstance(replica_id, str) or not replica_id or not isinstance(tokens, int) or tokens < 0:
        return None
    exclusive = exclusive if isinstance(exclusive, int) and 0 <= exclusive <= tokens else 0
    return Prediction(replica_id, tokens, exclusive)


# ---- the header (direct mode) ----------------------------------------------------------------


def prediction_header(slot: Mapping[str, Any] | None) -> dict[str, str]:
    """The routing peer's header carrying the slot's prediction to the replica; {} when there is none."""
    prediction = read_prediction(slot)
    if prediction is None:
        return {}
    return {PREDICTED_CACHED_TOKENS_HEADER:
            f"{prediction.cached_tokens};{prediction.replica_id};{prediction.exclusive_tokens}"}


def decode_prediction_header(value: str | None) -> Prediction | None:
    """The prediction of a `prediction_header` value; None when absent or malformed (then nothing is recorded)."""
    if not value:
        return None
    tokens, sep, rest = value.partition(";")
    replica_id, _, exclusive = rest.partition(";")  # replica ids hold no ";"
    tokens, replica_id, exclusive = tokens.strip(), replica_id.strip(), exclusive.strip() or "0"
    if (not sep or not replica_id or not _is_token_count(tokens) or not _is_token_count(exclusive)
            or int(exclusive) > int(tokens)):
        return None
    return Prediction(replica_id, int(tokens), int(exclusive))


def _is_token_count(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= _MAX_TOKEN_DIGITS


# ---- the comparison ----------------------------------------------------------------------------


def exclusive_hit_tokens(prediction: Prediction | None, served_replica_id: str, engine_cached_tokens: int) -> int:
    """Prompt tokens the serving replica answered from a cache no other replica held: its cache's
    worth to a cache-aware scale-down (autoscaling.standby). 0 without a prediction for this replica."""
    if prediction is None or prediction.replica_id != served_replica_id:
        return 0
    return max(min(engine_cached_tokens, prediction.exclusive_tokens), 0)


def engine_cacheable_tokens(prompt_tokens: int, block_size: int) -> int:
    """The most prompt tokens vLLM can serve from its prefix cache: whole blocks of all but the last token.

    vLLM always computes the prompt's last token (it needs its logits), so a prompt that is
    an exact multiple of the block size hits at most one block less than the router's
    full-block hashes cover. Capping the prediction at this keeps that engine rule from
    reading as a one-block over-prediction on every such request.
    """
    if prompt_tokens <= 1 or block_size <= 0:
        return 0
    return (prompt_tokens - 1) // block_size * block_size


def classify(predicted_tokens: int, engine_cached_tokens: int) -> Outcome:
    """The four cells of hit/miss: the router's prediction (rows) against the engine's report (columns)."""
    if predicted_tokens > 0:
        return "true_hit" if engine_cached_tokens > 0 else "false_hit"
    return "missed_hit" if engine_cached_tokens > 0 else "true_miss"


def compare(prediction: Prediction, served_replica_id: str, engine_cached_tokens: int, prompt_tokens: int,
            block_size: int) -> Comparison | None:
    """The request's comparison, or None when the replica that served it is not the one predicted."""
    if prediction.replica_id != served_replica_id:
        return None
    predicted = min(prediction.cached_tokens, engine_cacheable_tokens(prompt_tokens, block_size))
    engine = max(engine_cached_tokens, 0)
    return Comparison(classify(predicted, engine), engine - predicted)
