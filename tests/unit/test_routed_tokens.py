"""Tokenize once in direct mode: the routing peer's token ids travel to the replica in a header."""

from __future__ import annotations

import json

import pytest
from ray.serve._private.constants import SERVE_INGRESS_ROUTER_HEADER_PREFIX

from fakes import FakeTokenizer

from kvtide.config import parse_config
from kvtide.deployments.frontend.prompts import (
    MAX_ROUTED_TOKENS,
    ROUTED_TOKENS_HEADER,
    PromptBuilder,
    decode_token_ids,
    encode_token_ids,
)
from kvtide.deployments.frontend.protocol import ApiError

CONFIG = parse_config({"model": "/m", "served_model_name": "m", "engine": {"max_model_len": 64}})




CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "m", "prompt": "abc", "max_tokens": 4}


def test_the_header_is_in_the_namespace_haproxy_strips_from_clients():
    """A client cannot smuggle token ids through HAProxy: the name starts with Ray's router-owned prefix."""
    assert ROUTED_TOKENS_HEADER.startswith(SERVE_INGRESS_ROUTER_HEADER_PREFIX)


@pytest.mark.parametrize("ids", [[], [0], [1, 2, 3], [2**32 - 1, 0, 128_000]])
def test_token_ids_round_trip(ids):
    """encode/decode is lossless for any uint32 ids."""
    assert decode_token_ids(encode_token_ids(ids)) == (ids or None)


@pytest.mark.parametrize("value", [None, "", "not base64!", "AAA=", "AAAAAAA="])
def test_a_missing_or_malformed_header_means_tokenize(value):
    """Absent, non-base64 or not a whole number of uint32s: None, and the replica tokenizes itself."""
    assert decode_token_ids(value) is None


@pytest.mark.parametrize(("endpoint", "body"), [("chat", CHAT), ("completions", COMPLETION)])
def test_routed_tokens_give_the_same_prompt_without_tokenizing(endpoint, body):
    """The peer's tokens of a body build the same Prompt as tokenizing it, and the tokenizer is not called."""
    tokenizer = FakeTokenizer()
    builder = PromptBuilder(CONFIG, tokenizer)
    tokenized = builder.build(endpoint, body)
    calls = tokenizer.calls
    peer_tokens = builder.routing_prompt(json.dumps(body).encode()).token_ids
    tokenizer.calls = calls
    routed = builder.build(endpoint, body, routed_tokens=decode_token_ids(encode_token_ids(peer_tokens)))
    assert routed == tokenized and tokenizer.calls == calls


@pytest.mark.parametrize(("body", "routed", "code"), [
    (COMPLETION, [1, 999], "invalid_value"),                   # out of the vocabulary: never sent to the engine
    (COMPLETION, list(range(1, 62)), "context_length_exceeded"),  # the budget is checked on the routed tokens
    ({**CHAT, "messages": [{"role": "user", "content": "x"}] * 2000}, [1], "too_many_messages"),
])
def test_routed_tokens_still_pass_every_check(body, routed, code):
    """Checks that need no tokenizer run on routed tokens too: vocabulary, context budget, message count."""
    endpoint = "chat" if "messages" in body else "completions"
    with pytest.raises(ApiError) as err:
        PromptBuilder(CONFIG, FakeTokenizer()).build(endpoint, body, routed_tokens=routed)
    assert err.value.status == 400 and err.value.code == code


def test_the_peer_leaves_the_header_out_when_empty_or_too_long():
    """No tokens (an invalid body) or more than MAX_ROUTED_TOKENS: no header, the replica tokenizes."""
    builder = PromptBuilder(CONFIG, FakeTokenizer())
    assert builder.routed_tokens_header([]) == {}
    assert builder.routed_tokens_header([1] * (MAX_ROUTED_TOKENS + 1)) == {}
    assert decode_token_ids(builder.routed_tokens_header([5, 6])[ROUTED_TOKENS_HEADER]) == [5, 6]
