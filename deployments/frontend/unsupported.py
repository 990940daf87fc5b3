"""Request fields vLLM's OpenAI server acts on and kvtide's own path does not: never a silent 200.

An application written against vLLM's server may send any field of vLLM's request models.
kvtide's own path honours the fields its request models declare (protocol.py). Every other
field of vLLM's models is listed here with the values that ask for nothing (vLLM's defaults
and their spellings, e.g. `logprobs: false`, `tools: []`). A request with any other value
goes to vLLM's own serving layer (vllm_layer.py). kvtide's own parser refuses such a field
with a 400 whose `param` names it, so should a request with one ever reach kvtide's path, the
client learns at once that the answer would not be what it asked for, never a silent 200.

A field that neither kvtide nor vLLM knows is ignored, as vLLM's server ignores it (OpenAI
SDKs add optional keys over time). A unit test checks this table against the installed
vLLM's request models, so a field vLLM adds cannot slip through as a silent 200.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kvtide.deployments.frontend.protocol import ApiError

# Fields of both vLLM request models, with the values that ask for nothing.
_BOTH: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "watermarking": (None,),
    "truncate_prompt_tokens": (None,),
    "truncation_side": (None,),
    "prompt_logprobs": (None,),
    "logprob_token_ids": (None, []),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "echo": (False,),
    "priority": (0,),
    "request_id": (None,),
    "session_id": (None,),
    "return_tokens_as_token_ids": (None, False),
    "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,),
    "mm_payload": ("tensors",),
    "return_mm_kwargs": (None, False),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "vllm_xargs": (None, {}),
    "repetition_detection": (None,),
    "thinking_token_budget": (None,),
    "stream_interval": (None, 1),
}

NOT_HONOURED: dict[str, dict[str, tuple[Any, ...]]] = {
    "chat": {
        **_BOTH,
        "logprobs": (False, None),
        "top_logprobs": (0, None),
        "tools": (None, []),
        # "auto" or "required" or a named tool: with no tools vLLM refuses it too.
        "tool_choice": (None, "none"),
        "reasoning_effort": (None,),
        "documents": (None, []),
        "chat_template": (None,),
        "chat_template_kwargs": (None, {}),
        "media_io_kwargs": (None,),
        "mm_processor_kwargs": (None,),
        "add_generation_prompt": (True,),
        "continue_final_message": (False,),
        "add_special_tokens": (False,),
        "return_prompt_text": (None, False),
    },
    "completions": {
        **_BOTH,
        "logprobs": (None,),
        "suffix": (None,),
        "prompt_embeds": (None,),
        "add_special_tokens": (True,),
    },
}

# vLLM's /tokenize and /detokenize (only the chat form has fields kvtide lacks).
NOT_HONOURED["tokenize"] = NOT_HONOURED["detokenize"] = {}
NOT_HONOURED["tokenize_chat"] = {
    "continue_final_message": (False,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "media_io_kwargs": (None,),
    "mm_processor_kwargs": (None,),
    "tools": (None, []),
}

# vLLM fields kvtide's own path may ignore: they act only with a reasoning or tool parser, and
# a request that uses tools or reasoning goes to vLLM's layer anyway.
IGNORED_AS_VLLM_DOES = frozenset({"include_reasoning", "parallel_tool_calls"})


def _asks_for_nothing(value: Any, noops: tuple[Any, ...]) -> bool:
    # Type-exact: `True == 1` must not let `echo: 1` or `priority: false` through as a default.
    return any(type(value) is type(noop) and value == noop for noop in noops)


def first_unhonoured(fields: Mapping[str, Any], table: Mapping[str, tuple[Any, ...]]) -> str | None:
    """The first of `fields` that `table` lists with a value that asks for something; None if none does."""
    for name, value in fields.items():
        noops = table.get(name)
        if noops is not None and not _asks_for_nothing(value, noops):
            return name
    return None


def refuse_unhonoured(extra: Mapping[str, Any] | None, endpoint: str) -> None:
    """400 naming the first field of `extra` (a request's undeclared fields) that vLLM would act on."""
    table = NOT_HONOURED[endpoint]
    name = first_unhonoured(extra or {}, table)
    if name is not None:
        raise ApiError(400, f"'{name}' is not supported by this server (kvtide) yet; send the request "
                            f"without it, or with its default value ({json.dumps(table[name][0])})", param=name,
                       code="unsupported_field")
