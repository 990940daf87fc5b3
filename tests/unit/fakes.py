"""Fakes and builders shared by unit tests (imported by basename: `from fakes import ...`)."""

from __future__ import annotations

import asyncio
from typing import Callable, Iterator, Sequence

from kvtide.config import parse_config
from kvtide.deployments.frontend.admission import admission_limits
from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot


class FakeTokenizer:
    """One token per character (after a BOS): enough to check lengths, templates and limits.

    `calls` counts encodes and template renderings, so a test can prove tokenizing was skipped.
    """

    def __init__(self) -> None:
        self.calls = 0

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return ([1] if add_special_tokens else []) + [ord(c) % 256 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, conversation, tokenize: bool, add_generation_prompt: bool) -> str:
        self.calls += 1
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + ("<assistant>" if add_generation_prompt else "")


def snapshots(loads: dict[str, int]) -> list[ReplicaSnapshot]:
    """One replica snapshot per id, with that many requests in flight."""
    return [ReplicaSnapshot(rid, num_ongoing_requests=n) for rid, n in loads.items()]


def index_holding(prompt: Sequence[BlockHash], ttl_s: float, held: dict[str, int]) -> PrefixIndex:
    """An index where replica r's engine holds the first held[r] blocks of `prompt`."""
    index = PrefixIndex(ttl_s)
    for rid, n in held.items():
        index.apply_digest(CacheDigest.from_hashes(rid, 1, 1, prompt[:n]))
    return index


def run_slices(steps: Iterator[None], after_each: Callable[[], None]) -> int:
    """Drive `PrefixIndex.apply_digest_steps` to its end, calling `after_each` between slices; the slice count.

    Asserts the digest was applied (the generator returns True).
    """
    slices = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            assert done.value is True
            return slices
        slices += 1
        after_each()


async def settle_digest_slices(router, max_turns: int = 10_000) -> None:
    """Let the event loop turn until the router has applied every queued digest slice.

    The router applies one slice per loop turn (`loop.call_soon`); each turn here is a future
    resolved by a callback queued behind them, so the wait is counted in turns, not in time.
    """
    loop = asyncio.get_running_loop()
    for _ in range(max_turns):
        if not router._fleet.num_queued_digests:
            return
        turn = loop.create_future()
        loop.call_soon(turn.set_result, None)
        await turn
    raise AssertionError("digest slices did not finish")


# The default config's admission limits (max_retries 2, retry_after_s 1).
DEFAULT_LIMITS = admission_limits(parse_config({}))


class RecordingEngineHandle:
    """An engine DeploymentHandle for HandleVllmApp: records each VllmLayerCall, answers a bare 200.

    `failures`: what the calls raise in turn before answering (None: that call answers); `cut_after_start`:
    an answering call raises this after its response start."""

    def __init__(self, failures=(), cut_after_start=None):
        self.calls = []
        self.failures = list(failures)
        self.cut_after_start = cut_after_start

    def options(self, **_):
        return self

    @property
    def vllm_openai(self):
        return self

    def remote(self, call):
        self.calls.append(call)
        failure = self.failures.pop(0) if self.failures else None

        async def messages():
            if failure is not None:
                raise failure
            yield {"type": "http.response.start", "status": 200, "headers": []}
            if self.cut_after_start is not None:
                raise self.cut_after_start
        return messages()
