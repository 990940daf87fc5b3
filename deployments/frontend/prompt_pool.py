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
        self._free: queue.SimpleQueue[PromptBuilder] = queue.SimpleQueue()
        for builder in builders:
            self._free.put(builder)
        # As many threads as builders: a running call always finds a free builder.
        self._executor = ThreadPoolExecutor(len(builders), thread_name_prefix="kvtide-tokenize")

    @classmethod
    def for_config(cls, config: KvtideConfig, tokenizer: Any) -> PromptPool | None:
        """http.router_tokenize_threads builders over copies of `tokenizer`; None when it is 0."""
        threads = config.http.router_tokenize_threads
        if not threads:
            return None
        return cls([PromptBuilder(config, copy.deepcopy(tokenizer)) for _ in range(threads)])

    async def run(self, fn: Callable[[PromptBuilder], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._with_builder, fn)

    def _with_builder(self, fn: Callable[[PromptBuilder], T]) -> T:
        builder = self._free.get_nowait()  # never empty: one builder per thread
        try:
            return fn(builder)
        finally:
            self._free.put(builder)
