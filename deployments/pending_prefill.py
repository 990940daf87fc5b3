"""Prompt tokens an engine replica has accepted but not yet prefilled, for the router's cost model.

Why: a request count says little about the work queued on an LLM engine. On a
shared-prefix load, a queued request whose system prompt is cached costs its question
(~100 tokens); a cold one costs the whole prompt (thousands). On 4 H200 replicas
(benchmarks/results/h200-session-2026-12-01) the router's count-based cost moved
requests off the replica that held their prefix once queues grew, and each move was a
cold 6k-token prefill that evicted another group: the hit rate fell from 0.75 to 0.15
as the load rose. So each engine reports the uncached prompt tokens still ahead of its
first token, and the router weighs them.

Per request: on arrival, its prompt tokens minus the longest prefix of its blocks that
the replica's own block set holds (the same view the router's digests come from); off
the books at its first output token (prefill done) or when it ends. Pure; the engine
replica calls it from its event loop only.
"""

from __future__ import annotations


class PendingPrefill:
    """request id → uncached prompt tokens, for requests whose first token has not come yet."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}
        self._total = 0

    @staticmethod
    def uncached_tokens(num_prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
        """Prompt tokens left to compute when the first `cached_blocks` full blocks are cached."""
        return max(0, num_prompt_tokens - cached_blocks * block_size)

    def start(self, request_id: str, uncached_tokens: int) -> None:
        self.done(request_id)  # a reused id must not count twice
        self._tokens[request_id] = uncached_tokens
        self._total += uncached_tokens

    def done(self, request_id: str) -> None:
        """Prefill finished (first token) or the request ended: idempotent."""
        tokens = self._tokens.pop(request_id, None)
        if tokens is not None:
            self._total -= tokens

    @property
    def total_tokens(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._tokens)
