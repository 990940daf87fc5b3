"""How the OpenAI frontend reaches an engine: through a Serve handle, or in the same process.

    HandleEngineClient   ingress mode: a DeploymentHandle streaming call to an engine replica
                         picked by the request router; retried on another replica while no
                         token has come (the client never sees text twice)
    LocalEngineClient    direct mode: the frontend runs inside the engine replica and iterates
                         its vLLM stream directly; HAProxy retries a refused connection on
                         another replica, and a 503 this client answers only where the engine
                         was dead before the request reached it (a 500 is never retried: a
                         request that killed its engine must not be replayed onto the next)

Both hand back an `EngineStream` whose first delta has arrived (or that ended with none),
and raise `ApiError` for what the client should see: 429 (engine queue full), 503 (no
replica could serve it), 504 (deadline). Cancelling a stream aborts the request in vLLM,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator, Callable, Protocol

from kvtide.deployments.logs import replica_logger
from kvtide.deployments.frontend.admission import AdmissionLimits, Deadline
from kvtide.deployments.messages import GenerateDelta, GenerateRequest
from kvtide.deployments.frontend.protocol import ApiError

logger = replica_logger("engine_client")


class EngineStream:
    """An engine call whose first delta has arrived (`first`), or that ended with none."""

    def __init__(self, iterator: AsyncIterator[GenerateDelta], cancel: Callable[[], None]):
        self.iterator = iterator
        self._cancel = cancel
        self.first: GenerateDelta | None = None

    async def next(self, deadline: Deadline) -> GenerateDelta:
        """The next delta within the request's deadline (TimeoutError past it, StopAsyncIteration at the end)."""
        remaining_s = deadline.remaining_s(time.monotonic())
        if remaining_s is None:
            return await self.iterator.__anext__()
        return await asyncio.wait_for(self.iterator.__anext__(), remaining_s)

    def cancel(self) -> None:
        """Abort the request in the engine (its KV is freed); safe to call more than once."""
        try:
            self._cancel()
        except Exception:  # already finished, or its replica is gone
            pass


class EngineClient(Protocol):
    # Whether the call goes through a request router, which reads the request's block hashes
    # (and its prompt text, for ray_prefix); a local call needs neither.
    routes_requests: bool

    async def open(self, request: GenerateRequest, deadline: Deadline,
                   on_rejected: Callable[[str], None]) -> EngineStream: ...


def timeout_error(limits: AdmissionLimits, phase: str = "start") -> ApiError:
    return ApiError(504, f"the request did not {phase} within its deadline of {limits.request_timeout_s} s",
                    code="timeout")


def unavailable_error(limits: AdmissionLimits) -> ApiError:
    return ApiError(503, "no engine replica could serve the request; retry it", code="engine_unavailable",
                    headers={"Retry-After": str(limits.retry_after_s)})


def backpressure_error(limits: AdmissionLimits) -> ApiError:
    return ApiError(429, "the engines are at capacity; retry after the Retry-After delay", code="rate_limit_exceeded",
                    headers={"Retry-After": str(limits.retry_after_s)})


async def _first_delta(stream: EngineStream, deadline: Deadline, limits: AdmissionLimits,
                       on_rejected: Callable[[str], None]) -> EngineStream:
    """Wait for the first delta; on deadline or cancellation the call is cancelled first."""
    try:
        stream.first = await stream.next(deadline)
    except StopAsyncIteration:
        pass
    except (asyncio.TimeoutError, TimeoutError):
        stream.cancel()
        on_rejected("timeout")
        raise timeout_error(limits) from None
    except BaseException:
        stream.cancel()
        raise
    return stream


def engine_failure_kind(exc: BaseException) -> str | None:
    """How a handle call failed: "backpressure" (Serve's handle queue is full), "replica"
    (the replica or its engine died: another replica may serve it), or None (anything else)."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

    if isinstance(exc, BackPressureError):
        return "backpressure"
    if isinstance(exc, (RayActorError, ReplicaUnavailableError)):
        return "replica"
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BackPressureError):
            return "backpressure"
        if isinstance(cause, (RayActorError, ReplicaUnavailableError)):
            return "replica"
        # vLLM's engine core died under a live actor: check_health will replace the replica.
        if type(cause).__name__ in ("EngineDeadError", "EngineGenerateError"):
            return "replica"
    return None


class HandleEngineClient:
    """Ingress mode: stream from an engine replica through a Serve DeploymentHandle."""

    routes_requests = True

    def __init__(self, handle: Any, limits: AdmissionLimits):
        self.handle = handle
        self.limits = limits

    async def open(self, request: GenerateRequest, deadline: Deadline,
                   on_rejected: Callable[[str], None]) -> EngineStream:
        """Call an engine and wait for its first delta, retrying on another replica while none came.

        Serve's router drops a replica whose actor died from its candidates, so a retry
        lands on a survivor.
        """
        attempt = 0
        while True:
            call = request if attempt == 0 else dataclasses.replace(request, request_id=f"{request.request_id}-{attempt}")
            response = self.handle.options(stream=True).generate.remote(call)
            # Cancelling the handle call aborts the request inside the engine.
            stream = EngineStream(response.__aiter__(), response.cancel)
            try:
                return await _first_delta(stream, deadline, self.limits, on_rejected)
            except (ApiError, asyncio.CancelledError):
                raise
            except Exception as exc:
                kind = engine_failure_kind(exc)
                if kind == "backpressure":
                    on_rejected("engine_queue_full")
                    raise backpressure_error(self.limits) from None
                if kind != "replica" or attempt >= self.limits.max_retries:
                    logger.warning("request %s failed before its first token (attempt %d): %s",
                                   request.request_id, attempt + 1, type(exc).__name__)
                    raise unavailable_error(self.limits) from None
                logger.info("request %s: engine replica failed before its first token (%s); retrying",
                            request.request_id, type(exc).__name__)
                attempt += 1


class LocalEngineClient:
    """Direct mode: the frontend and the engine share a replica; `generate` is the replica's own."""

    routes_requests = False  # the routing peer already picked this replica

    def __init__(self, generate: Callable[[GenerateRequest], AsyncIterator[GenerateDelta]], limits: AdmissionLimits,
                 engine_dead: Callable[[], bool] = lambda: False):
        self.generate = generate
        self.limits = limits
        self.engine_dead = engine_dead  # the replica's engine is gone (EngineReplica.engine_dead)

    async def open(self, request: GenerateRequest, deadline: Deadline,
                   on_rejected: Callable[[str], None]) -> EngineStream:
        dead_at_hand_over = self.engine_dead()
        generator = self.generate(request)

        def cancel() -> None:
            # Closing the generator closes vLLM's, which aborts the request. A generator that
            # a cancellation or timeout already ran to its end closes at once.
            asyncio.ensure_future(generator.aclose())

        stream = EngineStream(generator.__aiter__(), cancel)
        try:
            return await _first_delta(stream, deadline, self.limits, on_rejected)
        except (ApiError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the engine failed this request before its first token
            logger.warning("request %s failed before its first token: %s", request.request_id, type(exc).__name__)
            if dead_at_hand_over:  # another replica can serve it: HAProxy retries the 503
                raise unavailable_error(self.limits) from None
            # The engine died while it held this request, which may be why: not retried elsewhere.
            raise ApiError(500, "the engine failed while starting this request", code="engine_failed") from None
