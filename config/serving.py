"""`serving:` — the options a vLLM user sets on vLLM's OpenAI server, in one place.

The engine replica runs vLLM's own OpenAI serving layer for every request that uses a part
of vLLM's API kvtide's own path does not implement (tools, response_format, logprobs, n, …).
These options configure it exactly as the same flags configure `vllm serve`: the tool-call
parser, the reasoning parser, the chat template, structured outputs. Some are engine
arguments in vLLM (max_logprobs, the structured-outputs backend, the reasoning parser):
they are set here, not in `engine.extra_args`, so one section says how requests are served.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kvtide.config.base import Strict
from kvtide.config.vllm_args import check_extra_args, frontend_arg_names

# vLLM server arguments kvtide owns, with why: serving.extra_args may not set them.
KVTIDE_OWNS_SERVER_ARGS = {
    "host": "http.host", "port": "http.port", "uds": "http.host and http.port",
    "api_key": "frontend.auth (kvtide checks the keys before vLLM sees a request)",
    "root_path": "the chart's ingress", "middleware": "kvtide's own app wraps vLLM's",
    "ssl_keyfile": "TLS ends at the ingress", "ssl_certfile": "TLS ends at the ingress",
    "ssl_ca_certs": "TLS ends at the ingress", "ssl_cert_reqs": "TLS ends at the ingress",
    "ssl_ciphers": "TLS ends at the ingress", "enable_ssl_refresh": "TLS ends at the ingress",
    "grpc_port": "kvtide serves HTTP only", "uvicorn_log_level": "Ray Serve runs the HTTP server",
    "disable_uvicorn_access_log": "Ray Serve runs the HTTP server",
    "lora_modules": "lora.adapters, each served name to its adapter directory",
}


class StructuredOutputsSettings(Strict):
    """vLLM's structured-outputs config (`--structured-outputs-config`): how constrained decoding runs."""

    backend: Literal["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"] = Field(
        "auto", description="Grammar backend for response_format, structured_outputs and tool_choice "
                            "required/named; auto lets vLLM choose per request.")
    disable_any_whitespace: bool = Field(
        False, description="JSON without free whitespace: a model that favours whitespace cannot fill "
                           "max_tokens with it (xgrammar and guidance).")
    disable_additional_properties: bool = Field(
        False, description="guidance only: a json_schema without additionalProperties forbids extra keys.")


class ServingConfig(Strict):
    """vLLM's OpenAI serving options (names as `vllm serve` flags, with dashes as underscores)."""

    fast_path: bool = Field(
        True, description="kvtide's own request path for the requests it implements (plain generation: the "
                          "routing peer's token ids, no second tokenizing); false: vLLM's serving layer "
                          "answers every request (direct mode).")
    peer_renders_chat: bool = Field(
        False, description="The routing peer renders a chat that vLLM's layer answers (tools, response_format, "
                           "logprobs, ...) with vLLM's own renderer and hands its token ids to the replica, whose "
                           "vLLM then skips the chat template and tokenizer (kv_transfer_params.prompt_token_ids). "
                           "The peer imports vLLM (seconds, in the background; about 0.6 GiB).")
    tool_call_parser: str | None = Field(
        None, description="Parser that turns the model's output into tool_calls (e.g. hermes, llama3_json, "
                          "mistral); needed for tool_choice auto.")
    enable_auto_tool_choice: bool = Field(
        False, description="Let the model decide when to call a tool (tool_choice auto); needs tool_call_parser.")
    reasoning_parser: str | None = Field(
        None, description="Parser that splits reasoning from the answer (e.g. deepseek_r1, qwen3): "
                          "the reasoning goes to message.reasoning.")
    chat_template: str | None = Field(
        None, description="Chat template (a file path or the template itself) instead of the tokenizer's.")
    response_role: str = Field("assistant", min_length=1,
                               description="Role of the generated message when add_generation_prompt is true.")
    max_logprobs: int = Field(20, ge=-1, description="Most logprobs/top_logprobs a request may ask for (-1: no limit).")
    enable_scale_out: bool = Field(
        False, description="vLLM's tokens-in/out endpoints: /v1/{api}/render, /v1/{api}/derender and "
                           "/inference/v1/generate (off, as in vLLM: they answer 403).")
    responses_store: bool = Field(
        False, description="vLLM's Responses store (VLLM_ENABLE_RESPONSES_API_STORE): /v1/responses keeps what "
                           "it answers in the engine replica that made it (store, previous_response_id, background, "
                           "GET and cancel by id; in memory, never evicted, as in vLLM); kvtide routes a request "
                           "naming a response to that replica. Off, as in vLLM: store is ignored.")
    structured_outputs: StructuredOutputsSettings = Field(default_factory=StructuredOutputsSettings)
    extra_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other option of vLLM's OpenAI server, by its FrontendArgs name (e.g. "
                    "chat_template_content_format, enable_prompt_tokens_details, tool_parser_plugin); "
                    "names are checked against the installed vLLM.")

    @model_validator(mode="after")
    def _check(self) -> "ServingConfig":
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("serving.enable_auto_tool_choice needs serving.tool_call_parser (e.g. hermes)")
        check_extra_args("serving", self.extra_args, type(self).model_fields, KVTIDE_OWNS_SERVER_ARGS,
                         frontend_arg_names(), "an option of the installed vLLM's OpenAI server")
        return self

    def engine_args(self) -> dict[str, Any]:
        """The serving options vLLM takes as engine arguments (the engine enforces them)."""
        structured = self.structured_outputs.model_dump()
        args: dict[str, Any] = {"max_logprobs": self.max_logprobs, "structured_outputs_config": structured}
        if self.reasoning_parser:
            args["reasoning_parser"] = self.reasoning_parser
        return args

    def server_args(self) -> dict[str, Any]:
        """The serving options vLLM's OpenAI serving layer reads from its parsed arguments."""
        return {"tool_call_parser": self.tool_call_parser, "enable_auto_tool_choice": self.enable_auto_tool_choice,
                "chat_template": self.chat_template, "response_role": self.response_role,
                "enable_scale_out": self.enable_scale_out, **self.extra_args}
