"""Admission control at the frontend: say "slow down" (429) instead of queueing forever.

A request passes three bounds on its way to a token; past any of them it is refused at
once with an answer the client can act on, and nothing waits without limit:

    client ─► ingress replica ─[1 gate]─► engine handle ─[2 handle queue]─► engine replica
                                                                            vLLM batch (max_num_seqs)
              └──────────────────── [3 deadline: request_timeout_s] ──────► + vLLM waiting queue

1. The gate (`AdmissionGate`, one per frontend replica: an ingress replica, or in direct
   mode an engine replica): at most `limit` requests at once, counted from admission to the
   last byte. Past it: 429 + `Retry-After`, no queue in front of it. The default limit is
   the fleet's capacity split over the frontend replicas:

       ingress mode  limit = ceil((engine replicas × max_num_seqs + max_queued_requests) / ingress replicas)
       direct mode   limit = max_num_seqs + ceil(max_queued_requests / engine replicas)

   i.e. every batch slot of every engine, plus a bounded queue (default: one more batch per
   engine replica) that waits inside the engines' own schedulers. With autoscaling the
   engine count is `max_replicas`: the fleet the gate must not starve once scaled up.
2. The handle queue (Ray Serve's `max_queued_requests` on the Engine deployment, set by
   kvtide.cluster.app): requests waiting for a replica slot at one ingress's handle. It only fills
   when engines are missing (a replica died, the autoscaler has not caught up), and then
   the handle raises `BackPressureError`, which the ingress also answers with 429.
3. The deadline: `request_timeout_s` from arrival to the last byte. Before the first byte
   the answer is 504; once a stream has started, an SSE error event and `[DONE]`. The
   engine call is cancelled, which aborts the request in vLLM and frees its KV blocks.

Health, readiness and model listing never pass the gate: they stay answerable at saturation.
Serve's own per-replica cap on the Ingress deployment is derived from the gate (gate +
`UNGATED_CALLS_HEADROOM`), so Serve never queues what the gate should refuse.
Pure logic (no Ray): the frontend adapts it; unit-tested with plain numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtide.config import KvtideConfig


@dataclass(frozen=True)
class AdmissionLimits:
    """The numbers one frontend (an engine replica in direct mode, an Ingress replica) enforces, derived once from the config.

    Why a boundary type: the same derivation sizes the ingress gate and the engine
    deployment's handle queue (kvtide.cluster.app), and both must agree.
    """

    max_ongoing_requests: int  # the gate, per frontend
    # Serve's max_ongoing_requests on the Ingress deployment: the gate plus room for the
    # calls that bypass it (health, readiness, models, hot-prefix lookups). Below the gate,
    # Serve would queue requests in its proxy where the gate cannot answer 429.
    ingress_max_ongoing_requests: int
    max_queued_requests_per_handle: int  # Serve's handle queue on the Engine deployment, per caller
    request_timeout_s: float | None
    retry_after_s: int
    max_retries: int


# Concurrent ungated calls (probes, /v1/models, hot-prefix lookups) an ingress replica takes
# on top of its gate.
UNGATED_CALLS_HEADROOM = 64


def engine_replicas_for_capacity(config: KvtideConfig) -> int:
    """Engine replicas the fleet's capacity is sized for: the fixed count, or the autoscaling ceiling."""
    replicas = config.replicas
    count = replicas.max_replicas if replicas.autoscaling else replicas.num_replicas
    return max(1, count or 0)


def admission_limits(config: KvtideConfig) -> AdmissionLimits:
    """Explicit limits win; null ones follow the engine fleet's batch capacity."""
    admission = config.frontend.admission
    num_ingress = config.frontend.num_replicas
    batch_slots = engine_replicas_for_capacity(config) * config.engine.max_num_seqs
    queued = batch_slots if admission.max_queued_requests is None else admission.max_queued_requests
    ongoing = admission.max_ongoing_requests
    if ongoing is None and config.http.mode == "direct":
        # Each engine replica admits its own batch plus its share of the fleet's queue.
        ongoing = config.engine.max_num_seqs + math.ceil(queued / engine_replicas_for_capacity(config))
    elif ongoing is None:
        ongoing = max(1, math.ceil((batch_slots + queued) / num_ingress))
    return AdmissionLimits(
        max_ongoing_requests=ongoing,
        ingress_max_ongoing_requests=ongoing + UNGATED_CALLS_HEADROOM,
        max_queued_requests_per_handle=max(1, math.ceil(queued / num_ingress)),
        request_timeout_s=admission.request_timeout_s,
        retry_after_s=admission.retry_after_s,
        max_retries=admission.max_retries,
    )


def max_prompt_chars(config: KvtideConfig) -> int:
    """Characters a prompt may have before it is tokenized.

    Tokenizing runs on the frontend's event loop, so a multi-megabyte prompt would stall
    every request of that replica. No tokenizer packs 16 characters into every token of a
    real prompt, so 16 × max_model_len only refuses prompts that could never fit anyway.
    """
    explicit = config.frontend.max_prompt_chars
    return explicit if explicit is not None else 16 * config.engine.max_model_len


class AdmissionGate:
    """A counter with a ceiling: `try_enter` admits or refuses, `leave` releases.

    Not a semaphore on purpose: a full gate refuses at once (429) instead of parking the
    caller, so an overloaded replica's memory and latency stay bounded. Single-threaded
    (one asyncio loop per frontend), so no lock is needed.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit = limit
        self.num_ongoing = 0
        self.num_rejected = 0

    def try_enter(self) -> bool:
        if self.num_ongoing >= self.limit:
            self.num_rejected += 1
            return False
        self.num_ongoing += 1
        return True

    def leave(self) -> None:
        if self.num_ongoing <= 0:
            raise RuntimeError("AdmissionGate.leave without a matching try_enter")
        self.num_ongoing -= 1


class Deadline:
    """Time left of a request's budget; `remaining_s` is None when there is no deadline.

    The clock is injected (time is a parameter) so the unit tests need no sleeps.
    """

    def __init__(self, timeout_s: float | None, now_s: float):
        self.expires_s = None if timeout_s is None else now_s + timeout_s

    def remaining_s(self, now_s: float) -> float | None:
        if self.expires_s is None:
            return None
        return max(0.0, self.expires_s - now_s)
