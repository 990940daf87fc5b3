"""Every field of vLLM's request models is honoured, or refused with a 400 naming it: never a silent 200."""

from __future__ import annotations

import json

import pytest

from fakes import FakeTokenizer

from kvtide.config import parse_config
from kvtide.deployments.frontend.pipeline import sampling_spec
from kvtide.deployments.frontend.prompts import PromptBuilder
from kvtide.deployments.frontend.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvtide.deployments.frontend.unsupported import IGNORED_AS_VLLM_DOES, NOT_HONOURED
from kvtide.deployments.messages import SamplingSpec

CONFIG = parse_config({"model": "/m", "served_model_name": "m", "engine": {"max_model_len": 256}})
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _build(endpoint: str, **fields):
    body = {**(CHAT if endpoint == "chat" else COMPLETION), **fields}
    return PromptBuilder(CONFIG, FakeTokenizer()).build(endpoint, json.loads(json.dumps(body)))


def _vllm_request_models():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

    return {"chat": (VllmChat, ChatCompletionRequest), "completions": (VllmCompletion, CompletionRequest)}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_vllm_request_field_is_honoured_or_listed_as_not_honoured(endpoint):
    """The installed vLLM's request fields ⊆ kvtide's declared fields ∪ the not-honoured table (∪ two no-ops)."""
    vllm_model, ours = _vllm_request_models()[endpoint]
    unaccounted = set(vllm_model.model_fields) - set(ours.model_fields) - set(NOT_HONOURED[endpoint]) \
        - IGNORED_AS_VLLM_DOES
    assert unaccounted == set()
    # And no declared field is also in the table (it would be refused though honoured).
    assert set(ours.model_fields) & set(NOT_HONOURED[endpoint]) == set()


@pytest.mark.parametrize(("endpoint", "field", "value"), [
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "tool_choice", "required"),
    ("chat", "response_format", {"type": "json_object"}),
    ("chat", "logprobs", True),
    ("chat", "top_logprobs", 3),
    ("chat", "chat_template_kwargs", {"enable_thinking": False}),
    ("chat", "echo", True),
    ("completions", "logprobs", 0),
    ("completions", "echo", True),
    ("completions", "suffix", "x"),
    ("completions", "logit_bias", {"5": 10}),
    ("completions", "structured_outputs", {"regex": "a+"}),
    ("completions", "priority", 1),
    ("completions", "echo", 1),  # not False: type-exact, so 1 does not pass as the default
])
def test_a_field_kvtide_does_not_honour_is_a_400_naming_it(endpoint, field, value):
    """tools, response_format, logprobs, echo…: 400 with param = the field, code unsupported_field."""
    with pytest.raises(ApiError) as info:
        _build(endpoint, **{field: value})
    assert (info.value.status, info.value.param, info.value.code) == (400, field, "unsupported_field")


@pytest.mark.parametrize(("endpoint", "fields"), [
    ("chat", {"logprobs": False, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
              "echo": False, "add_generation_prompt": True, "include_reasoning": False, "parallel_tool_calls": True}),
    ("completions", {"logprobs": None, "echo": False, "logit_bias": {}, "length_penalty": 1.0, "priority": 0}),
    ("completions", {"some_future_openai_field": 1}),  # unknown to vLLM too: ignored, as vLLM does
])
def test_default_values_of_those_fields_are_accepted(endpoint, fields):
    """A field sent with the value that asks for nothing (what SDKs and benchmark clients send) is a 200."""
    assert _build(endpoint, **fields).token_ids


def test_continuous_usage_stats_is_refused_naming_it():
    """stream_options.continuous_usage_stats (usage in every chunk) is not supported: a 400 naming it."""
    with pytest.raises(ApiError) as info:
        _build("chat", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert (info.value.status, info.value.param) == (400, "stream_options.continuous_usage_stats")


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", -2), ("top_k", 1.5), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("min_tokens", -1), ("stop_token_ids", [-1]), ("skip_special_tokens", "no"),
])
def test_sampling_fields_out_of_vllms_range_are_a_400_naming_them(field, value):
    """Bounds as vLLM's SamplingParams checks them: refused here, never an error inside the engine."""
    with pytest.raises(ApiError) as info:
        _build("completions", **{field: value})
    assert info.value.status == 400 and info.value.param.split(".")[0] == field  # stop_token_ids.0: the item


def test_repetition_penalty_must_be_finite():
    """Infinity (which Python's JSON reader accepts) is refused like vLLM refuses it."""
    with pytest.raises(ApiError) as info:
        PromptBuilder(CONFIG, FakeTokenizer()).build("completions", {**COMPLETION, "repetition_penalty": float("inf")})
    assert info.value.param == "repetition_penalty"


def test_min_tokens_above_max_tokens_is_a_400():
    """min_tokens past the request's max_tokens (given, or the completions default 16) names min_tokens."""
    with pytest.raises(ApiError) as info:
        _build("completions", min_tokens=17)
    assert (info.value.status, info.value.param) == (400, "min_tokens")
    assert _build("completions", min_tokens=16).max_tokens == 16


def test_the_sampling_fields_reach_vllms_sampling_params_unchanged():
    """Each honoured sampling field arrives in the engine's SamplingParams arguments as sent."""
    fields = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "presence_penalty": 0.5,
              "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_tokens": 3, "stop_token_ids": [5, 9],
              "include_stop_str_in_output": True, "skip_special_tokens": False,
              "spaces_between_special_tokens": False, "seed": 11, "stop": ["x"], "ignore_eos": True}
    prompt = _build("completions", max_tokens=8, **fields)
    kwargs = sampling_spec(prompt.request, prompt.max_tokens).vllm_kwargs()
    assert kwargs == {**fields, "max_tokens": 8}


def test_unset_sampling_fields_take_vllms_server_defaults():
    """Nothing sent: the values vLLM's OpenAI server uses (its _DEFAULT_SAMPLING_PARAMS), and a real SamplingParams accepts them."""
    from vllm import SamplingParams

    kwargs = SamplingSpec(max_tokens=4).vllm_kwargs()
    assert {k: kwargs[k] for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty")} == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    assert SamplingParams(**kwargs).max_tokens == 4


def test_the_models_generation_config_defaults_fill_only_unset_fields():
    """As vLLM's server: the model's sampling defaults apply where the request is silent; a sent value wins."""
    model_defaults = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 99}
    kwargs = SamplingSpec(max_tokens=4, temperature=0.2).vllm_kwargs(model_defaults)
    assert (kwargs["temperature"], kwargs["top_k"], kwargs["repetition_penalty"]) == (0.2, 20, 1.1)
    assert kwargs["max_tokens"] == 4 and kwargs["top_p"] == 1.0  # the frontend's budget; neutral where no default


@pytest.mark.parametrize(("vllm_name", "ours_name", "table"), [
    ("TokenizeCompletionRequest", "TokenizeCompletion", "tokenize"),
    ("TokenizeChatRequest", "TokenizeChat", "tokenize_chat"),
    ("DetokenizeRequest", "Detokenize", "detokenize"),
])
def test_every_vllm_tokenizer_request_field_is_honoured_or_refused(vllm_name, ours_name, table):
    """/tokenize and /detokenize: vLLM's request fields ⊆ kvtide's declared fields ∪ the not-honoured table."""
    from vllm.entrypoints.serve.tokenize import protocol as vllm_protocol

    from kvtide.deployments.frontend import tokenize_api

    vllm_fields = set(getattr(vllm_protocol, vllm_name).model_fields)
    ours = set(getattr(tokenize_api, ours_name).model_fields)
    assert vllm_fields - ours - set(NOT_HONOURED[table]) == set()
