"""From an OpenAI request body to prompt token ids: read, validate, apply the chat template, tokenize.

One builder serves every place a prompt is tokenized, so they always agree on the tokens
(and therefore on the KV block hashes the router matches against the engines' caches):
the OpenAI frontend (an ingress replica, or an engine replica serving HTTP directly) and
the direct-mode routing peer, which tokenizes only to hash blocks.

    read_body (413) → parse_json_body (400) → parse (400 per field, 404 model) → tokens (400: too many
    messages or characters, template errors, token ids out of vocabulary) → budget (400:
    prompt + max_tokens over the context)

Every refusal is an `ApiError` naming the field; nothing here talks to an engine.

Tokenize once in direct mode: the routing peer has already tokenized the body to hash its
blocks, so it hands the token ids to the replica HAProxy pins the request to, in the
header `ROUTED_TOKENS_HEADER` (base64 of little-endian uint32). The name is in the
`x-serve-router-` namespace, which HAProxy strips from client requests before it applies
the peer's headers, so a client cannot send it through HAProxy. The replica still runs
every check that does not need the tokenizer (message count, characters, vocabulary range,
context budget) on those ids. Beside them go the ids' block hashes
(routing_key.ROUTED_HASHES_HEADER), so the replica does not hash them again either. Above
`MAX_ROUTED_TOKENS` the peer leaves both out and the replica tokenizes itself (a header that
large would crowd HAProxy's buffer).
"""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Sequence

from pydantic import BaseModel, ValidationError

from kvtide.config import KvtideConfig
from kvtide.deployments.logs import replica_logger
from kvtide.deployments.frontend.admission import max_prompt_chars
from kvtide.deployments.frontend.protocol import ApiError, ChatCompletionRequest, CompletionRequest, validation_error_to_api
from kvtide.deployments.routing.block_hash import chain_key
from kvtide.deployments.frontend.routing_key import ROUTED_HASHES_HEADER, decode_uints, encode_block_hashes, encode_uints
from kvtide.deployments.frontend.token_encoder import TokenEncoder
from kvtide.deployments.frontend.unsupported import refuse_unhonoured
from kvtide.deployments.frontend.api_bodies import body_endpoint, chat_view
from kvtide.deployments.messages import VLLM_LAYER_PATH
from kvtide.deployments.frontend.vllm_layer import request_path
from kvtide.deployments.tenancy import with_tenant_salt

# Fields kvtide's request models declare that vLLM's layer takes in shapes kvtide's own path does
# not (n > 1, a batch of prompts, tool or multimodal messages, per-chunk usage): not checked by
# kvtide's rules when vLLM's layer answers (vLLM checks them), as is `model` (an adapter's name).
_VLLM_SHAPED_FIELDS = frozenset({"model", "n", "prompt", "messages", "stream_options"})
# vLLM's APIs whose engine prompt is token ids it concatenates, not a text or template it renders.
_TOKEN_PROMPT_ENDPOINTS = frozenset({"generate", "generative_scoring"})
logger = replica_logger("prompts")

# Completions default to 16 output tokens, as OpenAI's legacy endpoint does.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# A JSON escape of a UTF-16 surrogate; only then can a parsed body hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
ROUTED_TOKENS_HEADER = "x-serve-router-kvtide-prompt-tokens"
SESSION_HEADER = "x-session-id"  # Ray Serve's default RAY_SERVE_SESSION_ID_HEADER_KEY
MAX_ROUTED_TOKENS = 16384  # 87 KB of base64: well inside HAProxy's request buffer
def encode_token_ids(token_ids: list[int]) -> str:
    """Token ids as a header value: base64 of little-endian uint32."""
    return encode_uints(token_ids, "I")


def decode_token_ids(value: str | None) -> list[int] | None:
    """The ids of an `encode_token_ids` value; None when absent or malformed (then tokenize)."""
    packed = decode_uints(value, "I")
    return packed.tolist() if packed is not None else None


@dataclass(frozen=True)
class RoutingOnlyRequest:
    """What routing reads of a request vLLM's own layer answers (kvtide's models do not parse it).

    `cache_salt` is the chain key (routing.block_hash.chain_key): the salt and the LoRA adapter.
    """

    cache_salt: str | None
    user: str | None


@dataclass(frozen=True)
class Prompt:
    """A validated request and what the engine needs from it."""

    request: CompletionRequest | ChatCompletionRequest | RoutingOnlyRequest
    token_ids: list[int]
    max_tokens: int
    # The ids are vLLM's own rendering of a chat its layer answers (vllm_render.py): the replica hands them
    # to vLLM instead of rendering again.
    vllm_rendered: bool = False


def parse_json_body(body: bytes) -> Any:
    """The body as JSON; 400 for anything else (including a lone UTF-16 surrogate)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(body):
        # Paired surrogates decode to one character; a lone one can be neither tokenized nor sent on.
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "a string in the request body holds a lone UTF-16 surrogate (U+D800..U+DFFF)",
                           code="invalid_value") from None
    return data


def session_key(prompt: Prompt | None, session_header: str | None) -> str | None:
    """A conversation's routing key: the `x-session-id` header, else the OpenAI `user` field
    (None `prompt`: a body routed without one, e.g. a Responses API request; the header alone).

    prefix_aware keeps a session's turns on the replica that holds its history (under the
    load guard). The header is Ray Serve's session header (RAY_SERVE_SESSION_ID_HEADER_KEY),
    which HAProxy also forwards to the routing peer; `user` names an end user, whose
    requests are usually one conversation at a time.
    """
    return session_header or (prompt.request.user if prompt is not None else None) or None


# chat_template_kwargs keys vLLM refuses in a request ("Found unexpected chat template kwargs"): a template of
# the client's own would run whatever loops it holds (vLLM renders one only with --trust-request-chat-template).
REFUSED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})


def template_options(kwargs: Any) -> dict[str, Any] | None:
    """A body's `chat_template_kwargs` as the routing prompt passes them to the template; None where vLLM refuses
    the request (a template or `tokenize` of the client's, or not an object): then it is routed by load."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or REFUSED_TEMPLATE_KWARGS & kwargs.keys():
        return None
    return kwargs


def chat_template_text(template: str | None) -> str | None:
    """serving.chat_template as vLLM's server reads `--chat-template`: a file's text, or the template itself."""
    if template is None:
        return None
    path = Path(template)
    if path.is_file():
        return path.read_text()
    if not any(c in template for c in "{}\n"):
        raise ValueError(f"serving.chat_template: {template!r} is neither a file here nor a template")
    return codecs.decode(template, "unicode_escape")  # an inline template may spell newlines as \n


def load_tokenizer(config: KvtideConfig) -> Any:
    """The served model's tokenizer (the same files vLLM loads, so the token ids agree)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model)


class PromptBuilder:
    """Validates and tokenizes requests for one served model (the tokenizer is injected)."""

    def __init__(self, config: KvtideConfig, tokenizer: Any):
        self.tokenizer = tokenizer
        # The routing peer's vLLM renderer (vllm_render.RenderSlot) when serving.peer_renders_chat is on.
        self.vllm_render: Any = None
        self.encode = TokenEncoder(tokenizer)
        self.model_name = config.model_name
        self.max_model_len = config.engine.max_model_len
        self.max_body_bytes = config.frontend.max_body_bytes
        self.max_messages = config.frontend.max_messages
        self.max_prompt_chars = max_prompt_chars(config)
        self.vocab_size = len(tokenizer)
        # The configured template (serving.chat_template) renders here too, so kvtide's path, the
        # routing peer and vLLM's layer render a conversation into the same tokens.
        self.chat_template = chat_template_text(config.serving.chat_template)
        self.adapters = frozenset(config.lora.adapters)  # LoRA adapters, served by vLLM's layer

    async def read_body(self, request: Any) -> bytes:
        """The raw body of a Starlette request, refused (413) past frontend.max_body_bytes."""
        declared = request.headers.get("content-length")
        limit = self.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        return bytes(body)

    def build(self, endpoint: str, data: Any, routed_tokens: list[int] | None = None) -> Prompt:
        """Validate a parsed body for `endpoint` ("completions" or "chat") and tokenize its prompt.

        `routed_tokens`: the routing peer's tokens of this very body (direct mode), used
        instead of tokenizing again; every other check still runs on them.
        """
        if routed_tokens is not None:
            self.check_vocabulary(routed_tokens, "prompt")
        if endpoint == "chat":
            req = self.parse(data, ChatCompletionRequest, "chat")
            token_ids = self.chat_tokens(req, routed_tokens)
            max_tokens = self._budget(token_ids, req.max_output_tokens, None, "messages")
        else:
            req = self.parse(data, CompletionRequest, "completions")
            token_ids = self.completion_tokens(req, routed_tokens)
            max_tokens = self._budget(token_ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
        self._check_min_tokens(req, max_tokens)
        return Prompt(req, token_ids, max_tokens)

    def routed_tokens_header(self, token_ids: list[int], hashes: Sequence[int] = ()) -> dict[str, str]:
        """The routing peer's headers carrying `token_ids` (and their block hashes, if any) to the
        replica; {} when too long or empty."""
        if not token_ids or len(token_ids) > MAX_ROUTED_TOKENS:
            return {}
        headers = {ROUTED_TOKENS_HEADER: encode_token_ids(token_ids)}
        if hashes:
            headers[ROUTED_HASHES_HEADER] = encode_block_hashes(hashes)
        return headers

    def routing_prompt(self, body: bytes, tenant_tag: str | None = None, isolate_caches: bool = True) -> Prompt | None:
        """Best-effort prompt of a raw body, for routing only: None when it is not a valid request."""
        return self.routing_view(body, tenant_tag, isolate_caches)[0]

    def routing_view(self, body: bytes, tenant_tag: str | None = None, isolate_caches: bool = True,
                     answers_all: bool = False) -> tuple[Prompt | None, str | None]:
        """A raw body's prompt for routing (None when it does not render: not a valid request, or one vLLM's layer
        will refuse) and the path that will serve it (vllm_layer.request_path; `answers_all`: a serving option makes
        vLLM's layer answer everything; None when the body is no JSON object with a known shape).

        The replica that serves the request validates it again and answers any error itself.
        `tenant_tag`: the requester's tenant (tenancy.py), mixed into the cache salt as the replica mixes it.
        """
        path = None
        try:
            data = with_tenant_salt(parse_json_body(body), tenant_tag, isolate_caches)
            endpoint = body_endpoint(data)
            path = request_path(data, endpoint, self.adapters, answers_all=answers_all)
            if path == VLLM_LAYER_PATH:
                return self._vllm_layer_routing_prompt(endpoint, data), path
            return self.build(endpoint, data), path
        except ApiError:
            return None, path
        except Exception as exc:  # a bug on some input must cost routing quality, never the request
            logger.warning("routing prompt failed (%s); routed by load alone", type(exc).__name__)
            return None, None

    def check_common_fields(self, data: Any, endpoint: str) -> None:
        """400 naming the first field kvtide's own path also takes (sampling, limits, stream) whose value
        it would refuse, for a request vLLM's layer answers: the same input gets the same answer on
        both paths, and vLLM never sees what kvtide bounds (a seed past int64, an empty stop string)."""
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_value")
        model_cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        common = {k: v for k, v in data.items() if k in model_cls.model_fields and k not in _VLLM_SHAPED_FIELDS}
        placeholder = {"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"}
        try:
            model_cls.model_validate({**common, "model": self.model_name, **placeholder})
        except ValidationError as exc:
            raise validation_error_to_api(exc.errors()) from None

    def _vllm_layer_routing_prompt(self, endpoint: str, data: dict[str, Any]) -> Prompt | None:
        """The prompt vLLM's own layer will render for a request it answers (tools and template options
        included, as vLLM passes them to the template; a Messages or Responses body as the chat vLLM
        converts it to, api_bodies.py), so that agents' long shared system prompts and tool definitions
        route to the replica that has them cached. None when it does not render."""
        salt, user, model = data.get("cache_salt"), data.get("user"), data.get("model")
        # An adapter's blocks chain from their own root, as vLLM keys the adapter into its hashes.
        lora = model if isinstance(model, str) and model in self.adapters else None
        request = RoutingOnlyRequest(chain_key(salt if isinstance(salt, str) and salt else None, lora),
                                     user if isinstance(user, str) else None)
        try:
            if endpoint in _TOKEN_PROMPT_ENDPOINTS:
                token_ids = self._token_prompt(endpoint, data)
            elif endpoint == "chat" and self.vllm_render is not None and (
                    ids := self.vllm_render.prompt_ids(data)):
                return Prompt(request, ids, 0, vllm_rendered=True)
            elif endpoint != "completions":
                view = chat_view(endpoint, data)
                if view is None or not view.messages:
                    return None
                self._check_conversation([{"content": m.get("content") if isinstance(m.get("content"), str) else ""}
                                          for m in view.messages])
                options = template_options(data.get("chat_template_kwargs"))
                if options is None:
                    return None
                template = {"chat_template": self.chat_template} if self.chat_template is not None else {}
                # A partial view renders as a prefix of vLLM's prompt: no generation prompt after it.
                text = self.tokenizer.apply_chat_template(
                    view.messages, tools=view.tools, tokenize=False,
                    add_generation_prompt=view.complete and data.get("add_generation_prompt", True),
                    continue_final_message=view.complete and data.get("continue_final_message", False),
                    **template, **options)
                token_ids = self.encode(text, add_special_tokens=False)
            else:
                prompt = data["prompt"]
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]  # a batch: route on its first prompt
                if isinstance(prompt, str):
                    token_ids = self.text_tokens(prompt)
                else:
                    token_ids = self._vocabulary_ids(prompt)
        except Exception:  # anything vLLM would refuse, it refuses itself on the replica
            return None
        return Prompt(request, token_ids, 0) if token_ids else None

    def _vocabulary_ids(self, ids: Any) -> list[int]:
        """A client's token-id list as sent, if it is one of this vocabulary (the routed-tokens header packs
        them as uint32); [] otherwise: vLLM answers the request itself, routed by load."""
        ok = isinstance(ids, list) and all(type(t) is int and 0 <= t < self.vocab_size for t in ids)
        return list(ids) if ok else []

    def _token_prompt(self, endpoint: str, data: dict[str, Any]) -> list[int]:
        """The engine prompt vLLM builds for a body of its tokens-in APIs: /inference/v1/generate sends
        `token_ids` as they are; /generative_scoring scores each item after the query (before it with
        `item_first`), the query tokenized with `add_special_tokens` and an item without: route on the
        first item's prompt, whose query part every other item's prompt shares."""
        if endpoint == "generate":
            return self._vocabulary_ids(data["token_ids"])
        query, items = data["query"], data["items"]
        if isinstance(query, str):
            query = self.text_tokens(query, add_special_tokens=data.get("add_special_tokens", True) is not False)
        item = items[0] if isinstance(items, list) and items else []
        if isinstance(item, str):
            item = self.text_tokens(item, add_special_tokens=False)
        query, item = self._vocabulary_ids(query), self._vocabulary_ids(item)
        return item + query if data.get("item_first") is True else query + item

    def parse(self, data: Any, model_cls: type[BaseModel], endpoint: str) -> Any:
        """A parsed body validated as `model_cls`: 400 naming the bad or unhonoured field, 404 for another
        model (a request model whose `model` is optional may leave it out)."""
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_value")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error_to_api(exc.errors()) from None
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        refuse_unhonoured(req.model_extra, endpoint)
        return req

    def _budget(self, prompt_ids: list[int], requested: int | None, default: int | None, prompt_param: str) -> int:
        """Output tokens for this request; 400 if prompt + max_tokens cannot fit the context.

        `prompt_param`: the body field that holds the prompt ("prompt", or "messages" for chat),
        named in the error when the prompt alone is too long.
        """
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise ApiError(400, "the prompt is empty: it has no tokens", param="prompt", code="invalid_value")
        room = self.max_model_len - num_prompt
        if room <= 0:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; "
                                f"the prompt has {num_prompt} tokens", param=prompt_param, code="context_length_exceeded")
        max_tokens = requested if requested is not None else (default or room)
        if num_prompt + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; you requested "
                                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                                f"completion). Reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    @staticmethod
    def _check_min_tokens(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> None:
        if req.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens})",
                           param="min_tokens", code="invalid_value")

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        # Tokenizing runs on the event loop: a huge prompt is refused before it can stall it.
        if num_chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {num_chars} characters; the limit is {self.max_prompt_chars} "
                                "(frontend.max_prompt_chars)", param=param, code="prompt_too_long")

    def check_vocabulary(self, token_ids: list[int], param: str) -> None:
        if token_ids and max(token_ids) >= self.vocab_size:
            bad = next(t for t in token_ids if t >= self.vocab_size)
            raise ApiError(400, f"token id {bad} is out of range; the vocabulary has {self.vocab_size} tokens",
                           param=param, code="invalid_value")

    def completion_tokens(self, req: CompletionRequest, routed_tokens: list[int] | None = None) -> list[int]:
        if isinstance(req.prompt, str):
            self._check_prompt_chars(len(req.prompt), "prompt")
            if routed_tokens is not None:
                return routed_tokens
            return self.encode(req.prompt, add_special_tokens=True)
        self.check_vocabulary(req.prompt, "prompt")
        return list(req.prompt)

    def chat_tokens(self, req: ChatCompletionRequest, routed_tokens: list[int] | None = None) -> list[int]:
        conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
        if routed_tokens is None:
            return self.template_tokens(conversation)
        self._check_conversation(conversation)
        return routed_tokens

    def _check_conversation(self, conversation: list[dict[str, str]]) -> None:
        if len(conversation) > self.max_messages:
            raise ApiError(400, f"the request has {len(conversation)} messages; the limit is {self.max_messages} "
                                "(frontend.max_messages)", param="messages", code="too_many_messages")
        self._check_prompt_chars(sum(len(m["content"]) for m in conversation), "messages")

    def template_tokens(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                        add_special_tokens: bool = False) -> list[int]:
        """Chat messages rendered with the model's chat template, then tokenized (limits checked first)."""
        self._check_conversation(conversation)
        try:
            template = {"chat_template": self.chat_template} if self.chat_template is not None else {}
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **template)
        except Exception as exc:  # a template may reject a role order; that is the client's input
            raise ApiError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages", code="invalid_value") from None
        # The template already holds BOS: by default no special tokens are added again.
        return self.encode(text, add_special_tokens=add_special_tokens)

    def text_tokens(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A plain prompt's tokens (BOS added by default, as for a completion)."""
        self._check_prompt_chars(len(text), "prompt")
        return self.encode(text, add_special_tokens=add_special_tokens)
