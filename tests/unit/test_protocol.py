"""OpenAI request validation and response shapes, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtide.deployments.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    chat_response,
    validation_error_to_api,
)


def _api_error(model_cls, data):
    with pytest.raises(ValidationError) as exc:
        model_cls.model_validate(data)
    return validation_error_to_api(exc.value.errors())


def test_unknown_fields_are_accepted():
    """New optional OpenAI fields from newer SDKs do not break requests."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": {}, "suffix": None})
    assert req.prompt == "x"


def test_single_prompt_list_is_unwrapped():
    """A one-element list of prompts (or of token lists) is the same as one prompt."""
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]


def test_stop_string_becomes_list():
    """`stop` may be a string or a list; both become a list."""
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": "\n"}).stop == ["\n"]


def test_max_completion_tokens_wins_over_max_tokens():
    """Chat's current max_completion_tokens takes precedence over the deprecated max_tokens."""
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 9})
    assert req.max_output_tokens == 9


def test_content_parts_are_joined():
    """Text content parts are concatenated into the message text."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].text() == "ab"


@pytest.mark.parametrize(("data", "param", "needle"), [
    ({"model": "m", "prompt": "x", "n": 2}, "n", "n must be an integer from 1 to 128"),
    ({"model": "m", "prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"model": "m"}, "prompt", "missing required field"),
    ({"model": "", "prompt": "x"}, "model", "at least 1 character"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop", "must not be empty"),
])
def test_errors_name_the_param(data, param, needle):
    """Validation failures map to a 400 whose param is the offending field."""
    err = _api_error(CompletionRequest, data)
    assert err.status == 400 and err.param == param and needle in err.message


def test_nested_chat_error_param_is_dotted_path():
    """A bad role deep in messages is reported as messages.N.role."""
    err = _api_error(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "a"},
                                                                         {"role": "robot", "content": "b"}]})
    assert err.param == "messages.1.role"


def test_usage_and_chat_response_shape():
    """A chat response carries the assistant message, finish_reason and usage with cached tokens."""
    body = chat_response("id1", "m", 1, "hello", "stop", Usage(10, 2, cached_tokens=8))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 8}}
    assert set(validation_error_to_api([]).body()["error"]) == {"message", "type", "param", "code"}
