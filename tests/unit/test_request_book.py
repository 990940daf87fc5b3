"""The engine replica's books: kvtide's path and vLLM's layer book pending prefill, hits and trust alike."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvtide.deployments.engine.pending_prefill import PendingPrefill
from kvtide.deployments.engine.request_book import BookedEngine, RequestBook, engine_prompt_tokens
from kvtide.deployments.messages import KVTIDE_PATH, ROUTED, VLLM_LAYER_PATH, Routed
from kvtide.deployments.routing.trust import Prediction

REPLICA = "replica-a"


def _output(tokens: list[int], finished: bool = False, cached: int = 0) -> SimpleNamespace:
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)], finished=finished, num_cached_tokens=cached)


class Engine:
    """An engine's `generate` as vLLM's layer calls it: records each call, streams `script` (a step may hold
    an asyncio.Event to wait on), and records whether its stream was closed before the end."""

    def __init__(self, script: list):
        self.script = script
        self.calls: list[tuple] = []
        self.closed_early: list[str] = []
        self.vllm_config = "the engine's config"

    def generate(self, prompt, params, request_id, *args, **kwargs):
        self.calls.append((prompt, params, request_id, args, kwargs))
        return self._stream(request_id)

    async def _stream(self, request_id: str):
        done = False
        try:
            for step in self.script:
                if isinstance(step, asyncio.Event):
                    await step.wait()
                    continue
                yield step
            done = True
        finally:
            if not done:
                self.closed_early.append(request_id)


def _book(events: list) -> tuple[RequestBook, PendingPrefill, list[int]]:
    clock = [0.0]
    pending = PendingPrefill()
    book = RequestBook(REPLICA, pending, lambda ids, hashes, salt: len(ids) - (16 if hashes else 0),
                       on_booked=lambda path, tokens: events.append(("booked", path, tokens)),
                       on_finished=lambda f: events.append(("finished", f)), clock=lambda: clock[0])
    return book, pending, clock


@pytest.mark.parametrize("path", [KVTIDE_PATH, VLLM_LAYER_PATH])
def test_either_path_books_pending_prefill_until_the_first_token_and_credits_exclusive_hits(path):
    """Pending prefill from the call to the first output token; at the end, exclusive hits = min(engine cached,
    predicted exclusive) for the predicted replica, and the finish carries the engine's cached tokens."""
    events: list = []
    book, pending, _ = _book(events)
    release = asyncio.Event()
    engine = Engine([_output([]), release, _output([7]), _output([8], finished=True, cached=32)])
    seen_pending: list[int] = []

    async def run() -> None:
        stream = book.track(engine.generate({}, None, "r1"), "r1", path, list(range(48)), None, None,
                            Prediction(REPLICA, 32, exclusive_tokens=20))
        async for out in stream:
            seen_pending.append(pending.total_tokens)
            if not out.outputs[0].token_ids:
                release.set()

    asyncio.run(run())
    # booked at the call (48 uncached); still pending after an empty output; off at the first token
    assert seen_pending == [48, 0, 0]
    assert events[0] == ("booked", path, 48)
    (_, finished), = [e for e in events if e[0] == "finished"]
    assert (finished.path, finished.num_prompt_tokens, finished.num_cached_tokens, finished.exclusive_hit_tokens) \
        == (path, 48, 32, 20)
    assert book.exclusive_hit_tokens_total == 20 and pending.total_tokens == 0


@pytest.mark.parametrize("prediction, credited", [
    (None, 0),                                              # no prediction: nothing exclusive to credit
    (Prediction("replica-b", 32, exclusive_tokens=32), 0),  # a prediction about another replica
    (Prediction(REPLICA, 64, exclusive_tokens=64), 24),     # capped at what the engine really had cached
])
def test_exclusive_hits_need_a_prediction_for_this_replica_and_are_capped_by_the_engines_hit(prediction, credited):
    """The cache-worth credit follows routing.trust.exclusive_hit_tokens on either path."""
    book, _, _ = _book([])

    async def run() -> None:
        async for _ in book.track(Engine([_output([1], finished=True, cached=24)]).generate({}, None, "r"),
                                  "r", VLLM_LAYER_PATH, [1] * 40, None, None, prediction):
            pass

    asyncio.run(run())
    assert book.exclusive_hit_tokens_total == credited


def test_block_hashes_that_came_with_the_request_are_used_for_the_uncached_count():
    """kvtide's path hands its routed block hashes to the cache lookup; vLLM's layer hands none (hashed from tokens)."""
    events: list = []
    book, _, _ = _book(events)

    async def run() -> None:
        async for _ in book.track(Engine([_output([1], finished=True)]).generate({}, None, "r"), "r", KVTIDE_PATH,
                                  [1] * 40, [11, 12], None, None):
            pass

    asyncio.run(run())
    assert events[0] == ("booked", KVTIDE_PATH, 24)


def test_vllms_layer_gets_the_engine_with_a_booked_generate_and_the_prediction_of_its_hand_over():
    """BookedEngine: attributes are the engine's; generate passes every argument through and books the call under
    vllm_layer with the prediction ROUTED holds in the calling task; the salt is read from the engine input."""
    events: list = []
    book, _, _ = _book(events)
    engine = Engine([_output([5], finished=True, cached=16)])
    booked = BookedEngine(engine, book)
    assert booked.vllm_config == "the engine's config"

    async def run() -> list:
        ROUTED.set(Routed(Prediction(REPLICA, 16, exclusive_tokens=16)))
        prompt = {"type": "token", "prompt_token_ids": [3] * 20, "cache_salt": "s"}
        return [out async for out in booked.generate(prompt, "params", "r9", lora_request=None, priority=2)]

    outs = asyncio.run(run())
    assert len(outs) == 1 and engine.calls[0][1:] == ("params", "r9", (), {"lora_request": None, "priority": 2})
    assert events[0] == ("booked", VLLM_LAYER_PATH, 20)
    assert book.exclusive_hit_tokens_total == 16


def test_an_input_without_token_ids_is_passed_through_unbooked():
    """Embeddings or a streaming input: vLLM's stream as it is, nothing booked."""
    events: list = []
    book, _, _ = _book(events)
    engine = Engine([_output([5], finished=True)])

    async def run() -> list:
        return [out async for out in BookedEngine(engine, book).generate({"prompt_embeds": object()}, None, "r")]

    assert len(asyncio.run(run())) == 1 and events == []


def test_closing_the_booked_stream_closes_the_engines_and_takes_the_request_off_the_books():
    """A client leaving closes the booked stream: the engine's stream is closed (vLLM aborts the request) and the
    request's pending prefill is dropped without a finish."""
    events: list = []
    book, pending, _ = _book(events)
    engine = Engine([_output([]), asyncio.Event()])  # waits forever after its first (empty) output

    async def run() -> None:
        stream = BookedEngine(engine, book).generate({"prompt_token_ids": [1] * 30}, None, "r")
        await stream.__anext__()
        assert pending.total_tokens == 30
        await stream.aclose()

    asyncio.run(run())
    assert engine.closed_early == ["r"] and pending.total_tokens == 0
    assert [e[0] for e in events] == ["booked"]


@pytest.mark.parametrize("prompt, expected", [
    ({"type": "token", "prompt_token_ids": [1, 2], "cache_salt": "s"}, ([1, 2], "s")),
    ({"prompt_token_ids": [1]}, ([1], None)),
    (SimpleNamespace(prompt_token_ids=[4], cache_salt=None), ([4], None)),
    ({"type": "embeds", "prompt_embeds": None}, None),
    (object(), None),
])
def test_the_engine_input_gives_its_token_ids_and_salt(prompt, expected):
    """What vLLM's layer passes to generate (a tokens input dict, a request object) gives (ids, salt); else None."""
    assert engine_prompt_tokens(prompt) == expected
