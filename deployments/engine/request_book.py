"""Every generation an engine replica runs, booked the same way whichever path made it.

Two paths end in the engine's `generate`: kvtide's own (EngineReplica.generate, plain chat and
completions) and vLLM's serving layer in the replica (tools, structured outputs, logprobs, the
Responses and Messages APIs: frontend/vllm_layer.py). What the routers and the autoscaler know of
a replica is what is booked here, so a fleet serving mostly agents is routed and scaled on the
same picture as one serving plain chat:

    pending prefill     the uncached prompt tokens ahead of each request's first token
                        (pending_prefill.py), reported with the routing stats
    exclusive hits      cached tokens no other replica held when the request was routed
                        (routing.trust), this cache's worth to a cache-aware scale-down
    index trust         the router's predicted cached tokens against the engine's, for each
                        finished request (`on_finished`; the direct-mode frontend counts them)
    per path            requests and uncached prompt tokens booked by path (`on_booked`)

vLLM's layer is given `BookedEngine`: the engine, with a `generate` that books each call. What
the router said about the request (its prediction) reaches that call through `ROUTED`, set
around the hand-over to vLLM's app: vLLM's handlers run in the hand-over's task, so the context
variable is theirs too.

Pure (no vLLM or Ray import): the replica hands in its engine and its clock.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable, Sequence

from kvtide.deployments.engine.pending_prefill import PendingPrefill
from kvtide.deployments.messages import ROUTED, VLLM_LAYER_PATH, Finished
from kvtide.deployments.routing.trust import Prediction, exclusive_hit_tokens


def engine_prompt_tokens(prompt: Any) -> tuple[list[int], str | None] | None:
    """(prompt token ids, cache salt) of what vLLM's layer passes to `generate` (a tokens input dict, or a request
    object carrying `prompt_token_ids`); None for an input without token ids (embeddings, a streaming input)."""
    if isinstance(prompt, dict):
        token_ids, salt = prompt.get("prompt_token_ids"), prompt.get("cache_salt")
    else:
        token_ids, salt = getattr(prompt, "prompt_token_ids", None), getattr(prompt, "cache_salt", None)
    if not isinstance(token_ids, list):
        return None
    return token_ids, salt if isinstance(salt, str) else None


def _noop(*_: Any) -> None:
    return None


class RequestBook:
    """One replica's books. `uncached_tokens(token_ids, block_hashes, cache_salt)`: the prompt tokens this replica
    must still compute (its own block set's view); `on_booked(path, uncached_tokens)` and `on_finished(Finished)`
    export what is booked. Called from the replica's event loop only."""

    def __init__(self, replica_id: str, pending: PendingPrefill,
                 uncached_tokens: Callable[[Sequence[int], Sequence[int] | None, str | None], int],
                 on_booked: Callable[[str, int], None] = _noop, on_finished: Callable[[Finished], None] = _noop,
                 clock: Callable[[], float] = time.monotonic):
        self.replica_id = replica_id
        self.pending = pending
        self.uncached_tokens = uncached_tokens
        self.on_booked, self.on_finished = on_booked, on_finished
        self.clock = clock
        self.exclusive_hit_tokens_total = 0

    async def track(self, outputs: AsyncIterator[Any], request_id: str, path: str, token_ids: Sequence[int],
                    block_hashes: Sequence[int] | None, cache_salt: str | None,
                    prediction: Prediction | None) -> AsyncIterator[Any]:
        """`outputs` (one request's vLLM RequestOutputs), passed through and booked: pending prefill from the
        call to the first output token, the exclusive hits and the finish at the last output. Closing this
        stream closes `outputs` (vLLM then aborts the request in the engine)."""
        uncached = self.uncached_tokens(token_ids, block_hashes, cache_salt)
        self.pending.start(request_id, uncached, self.clock())
        self.on_booked(path, uncached)
        waiting_first = True
        try:
            async for out in outputs:
                if waiting_first and any(completion.token_ids for completion in out.outputs):
                    waiting_first = False
                    self.pending.done(request_id, prefilled=True, now_s=self.clock())
                if out.finished:
                    self._finish(request_id, path, prediction, len(token_ids), out.num_cached_tokens or 0)
                yield out
        finally:
            self.pending.done(request_id, now_s=self.clock())
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()

    def _finish(self, request_id: str, path: str, prediction: Prediction | None, num_prompt_tokens: int,
                num_cached_tokens: int) -> None:
        exclusive = exclusive_hit_tokens(prediction, self.replica_id, num_cached_tokens)
        self.exclusive_hit_tokens_total += exclusive
        self.on_finished(Finished(request_id, path, prediction, num_prompt_tokens, num_cached_tokens, exclusive))


class BookedEngine:
    """The engine as vLLM's serving layer is given it: every attribute the engine's, but `generate`, which books
    the call on `book` (path `vllm_layer`, the prediction from `ROUTED`)."""

    def __init__(self, engine: Any, book: RequestBook):
        self._engine = engine
        self._book = book

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        outputs = self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
        tokens = engine_prompt_tokens(prompt)
        if tokens is None:  # nothing to weigh as a prompt: passed through as vLLM made it
            return outputs
        routed = ROUTED.get()
        token_ids, salt = tokens
        return self._book.track(outputs, request_id, VLLM_LAYER_PATH, token_ids, None, salt,
                                routed.prediction if routed is not None else None)
