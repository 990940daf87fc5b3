"""The LoRA prompt-logprobs check: what a round sends and when an answer counts as whole."""

from __future__ import annotations

from collections import Counter

from kvtide.benchmarks.lora_prompt_logprobs import _bodies, _prompt_logprobs_ok, _stream_fault


def test_a_round_streams_on_every_model_and_asks_prompt_logprobs_both_ways_on_each():
    """Per model: two streams, one prompt_logprobs and one echo + logprobs request, all distinct prompts per round."""
    bodies = _bodies(["base", "sql", "chat"], round_index=3)
    assert Counter((kind, body["model"]) for kind, body in bodies) == Counter(
        {(kind, m): (2 if kind == "stream" else 1) for kind in ("stream", "prompt_logprobs", "echo_logprobs")
         for m in ("base", "sql", "chat")})
    assert all(body["prompt_logprobs"] == 1 for kind, body in bodies if kind == "prompt_logprobs")
    assert all(body["echo"] and body["logprobs"] == 1 for kind, body in bodies if kind == "echo_logprobs")


def test_a_prompt_logprobs_answer_is_whole_only_with_an_entry_per_prompt_token():
    """prompt_logprobs: exactly one entry per prompt token; echo: at least the prompt's tokens in the logprobs."""
    usage = {"prompt_tokens": 3}
    assert _prompt_logprobs_ok("prompt_logprobs", {"choices": [{"prompt_logprobs": [None, {}, {}]}], "usage": usage})
    assert not _prompt_logprobs_ok("prompt_logprobs", {"choices": [{"prompt_logprobs": [None, {}]}], "usage": usage})
    assert _prompt_logprobs_ok("echo_logprobs", {"choices": [{"logprobs": {"tokens": list("abcde")}}], "usage": usage})
    assert not _prompt_logprobs_ok("echo_logprobs", {"choices": [{"logprobs": {"tokens": ["a"]}}], "usage": usage})


def test_a_stream_is_whole_when_it_ends_with_done_and_no_event_is_an_error():
    """Parsed per event: text that is the token `error` passes; an error event, a cut stream or junk fails, named."""
    chunk = 'data: {"id": "c", "choices": [{"index": 0, "text": "%s"}]}\n\n'
    assert _stream_fault(chunk % "error" + chunk % " ok" + "data: [DONE]\n\n") is None
    error_event = 'data: {"error": {"message": "engine died", "code": 503}}\n\n'
    assert "not a completion chunk" in _stream_fault(chunk % "a" + error_event + "data: [DONE]\n\n")
    assert "no [DONE]" in _stream_fault(chunk % "a")
    assert "not JSON" in _stream_fault("data: {cut\n\ndata: [DONE]\n\n")
