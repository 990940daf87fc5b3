"""The routing peer's tokenizing off its event loop: threads, each with a PromptBuilder of its own.

Why: HAProxy consults the routing peer before it forwards every POST, and the peer tokenizes
the prompt to hash its blocks. On the peer's event loop a burst of N requests is tokenized one
after another (~1 ms per ~1k tokens), so the burst reaches the engine spread over several of
its steps, where bare vLLM would have admitted it in one. Hugging Face's fast tokenizers
release the GIL while they encode, so threads tokenize a burst side by side. Each thread works
with its own tokenizer copy: a fast tokenizer shared between threads can fail with "Already
borrowed" (huggingface/tokenizers#537).
"""

from __future__ import annotations

import asyncio
import copy
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from kvtide.config import KvtideConfig
from kvtide.deployments.frontend.prompts import PromptBuilder

T = TypeVar("T")


class PromptPool:
    """`await pool.run(fn)` calls fn(builder) on a worker thread with a builder no other call holds."""

    def __init__(self, builders: list[PromptBuilder]):
        if not builders:
            raise ValueError("a PromptPool needs at least one builder")
        self.builders = list(builders)
        self._free: queue.SimpleQueue[PromptBuilder] = queue.SimpleQueue()
        for builder in builders:
            self._free.put(builder)
        # As many threads as builders: a running call always finds a free builder.
        self._executor = ThreadPoolExecutor(len(builders), thread_name_prefix="kvtide-tokenize")
        self.num_threads = len(builders)
        # Calls submitted and not yet finished on their thread (a call its caller stopped waiting for
        # still holds a thread until it ends); read and written on the event loop only.
        self.num_busy = 0

    @classmethod
    def for_config(cls, config: KvtideConfig, tokenizer: Any) -> PromptPool | None:
        """http.router_tokenize_threads builders over copies of `tokenizer`; None when it is 0."""
        threads = config.http.router_tokenize_threads
        if not threads:
            return None
        return cls([PromptBuilder(config, copy.deepcopy(tokenizer)) for _ in range(threads)])

    def saturated(self, backlog_per_thread: int) -> bool:
        """Whether every thread has `backlog_per_thread` calls waiting or running: a new call would wait behind them."""
        return self.num_busy >= self.num_threads * backlog_per_thread

    async def run(self, fn: Callable[[PromptBuilder], T], timeout_s: float | None = None) -> T:
        """fn(builder) on a thread; TimeoutError past `timeout_s` (the call still ends on its thread)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._with_builder, fn)
        self.num_busy += 1
        future.add_done_callback(self._on_done)
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)

    def _on_done(self, future: Any) -> None:
        self.num_busy -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a call nobody waits for any more must not warn at collection

    def _with_builder(self, fn: Callable[[PromptBuilder], T]) -> T:
        builder = self._free.get_nowait()  # never empty: one builder per thread
        try:
            return fn(builder)
        finally:
            self._free.put(builder)
