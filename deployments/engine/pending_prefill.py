"""Prompt tokens an engine replica has accepted but not yet prefilled, for the router's cost model.

Why: a request count says little about the work queued on an LLM engine. On a
shared-prefix load, a queued request whose system prompt is cached costs its question
(~100 tokens); a cold one costs the whole prompt (thousands). A count-based cost moves
requests off the replica that holds their prefix once queues grow, and each move is a
cold prefill of the whole prompt that evicts another group, so the hit rate collapses as
the load rises. So each engine reports the uncached prompt tokens still ahead of its
first token, and the router weighs them.

Per request: on arrival, its prompt tokens minus the longest prefix of its blocks that
the replica's own block set holds (the same view the router's digests come from); off
the books at its first output token (prefill done) or when it ends. Pure; the engine
replica calls it from its event loop only.

Drain rate: the report is up to a period (~1 s) old when a router reads it, and a GPU
finishes a prefill of a few thousand tokens in a fraction of that: a replica caught
mid-prefill at its report would look loaded for the whole period, and the router's picks
would herd onto the others. So the engine also reports how fast its backlog drains: tokens taken off the books by a
first token, over the seconds the backlog was non-empty, both decayed with a time constant
(`rate_tau_s`) so the rate follows a changing load. Busy time, not wall time: at a light
load the rate is still the speed of a prefill, not the arrival rate. The router drains
the reported backlog at this rate between reports (`deployments.routing.backlog`).
"""

from __future__ import annotations

import math


class PendingPrefill:
    """request id → uncached prompt tokens, for requests whose first token has not come yet."""

    def __init__(self, rate_tau_s: float = 10.0) -> None:
        self._tokens: dict[str, int] = {}
        self._total = 0
        self._rate_tau_s = rate_tau_s
        self._drained_tokens = 0.0  # decayed sum of tokens prefilled (first tokens)
        self._busy_s = 0.0  # decayed sum of seconds with a non-empty backlog
        self._clock_s: float | None = None  # time of the last event

    @staticmethod
    def uncached_tokens(num_prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
        """Prompt tokens left to compute when the first `cached_blocks` full blocks are cached."""
        return max(0, num_prompt_tokens - cached_blocks * block_size)

    def start(self, request_id: str, uncached_tokens: int, now_s: float | None = None) -> None:
        self.done(request_id, now_s=now_s)  # a reused id must not count twice
        self._advance(now_s)
        self._tokens[request_id] = uncached_tokens
        self._total += uncached_tokens

    def done(self, request_id: str, prefilled: bool = False, now_s: float | None = None) -> None:
        """Prefill finished (`prefilled`: its first token came) or the request ended: idempotent.

        Only prefilled tokens count toward the drain rate: an abort takes its tokens off the
        books without computing them.
        """
        tokens = self._tokens.pop(request_id, None)
        if tokens is not None:
            self._advance(now_s)
            self._total -= tokens
            if prefilled:
                self._drained_tokens += tokens

    def _advance(self, now_s: float | None) -> None:
        """Bring the decayed sums to `now_s`: busy time accrues while the backlog is non-empty."""
        if now_s is None:
            return
        if self._clock_s is not None and now_s > self._clock_s:
            elapsed = now_s - self._clock_s
            keep = math.exp(-elapsed / self._rate_tau_s)
            self._drained_tokens *= keep
            self._busy_s = self._busy_s * keep + (elapsed if self._total > 0 else 0.0)
        self._clock_s = now_s if self._clock_s is None else max(self._clock_s, now_s)

    def drain_rate_tokens_per_s(self, now_s: float | None = None) -> float:
        """Tokens the backlog lost per busy second, recently; 0.0 until a prefill finished (unknown)."""
        self._advance(now_s)
        if self._busy_s <= 0.0 or self._drained_tokens <= 0.0:
            return 0.0
        return self._drained_tokens / self._busy_s

    @property
    def total_tokens(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._tokens)
