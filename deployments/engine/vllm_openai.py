"""vLLM's own OpenAI serving layer, on this replica's engine.

kvtide's frontend serves the requests its own path implements (the measured fast path:
tokenize once, routed token ids, no second template). Every other request — tools, response
format and structured outputs, logprobs, n > 1, echo, batched prompts, chat template
options, multimodal or tool messages — is answered by vLLM's own OpenAI app, built here on
the same `AsyncLLM`, so it behaves exactly as `vllm serve` with the same flags would: same
validation, same errors, same response shapes. This is what Ray Serve LLM's LLMServer does.

The app's arguments come from vLLM's own CLI parser (every default as `vllm serve` has it),
with the `serving:` section on top and the engine's own configs, so the serving layer and
the engine agree (structured-outputs backend, reasoning parser, max_logprobs).

vLLM moved these entry points between versions; the lookups below try each known place and
pass only the keyword arguments the installed version's functions take.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from kvtide.config import KvtideConfig
from kvtide.deployments.engine.demo_model import lora_modules
from kvtide.deployments.logs import replica_logger

logger = replica_logger("vllm_openai")


def _first_attr(candidates: tuple[tuple[str, str], ...]) -> Any:
    import importlib

    for module_name, attr in candidates:
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {candidates} is in the installed vLLM")


def _parsed_server_args(model_path: str, adapters: list[str]) -> Any:
    """vLLM's `vllm serve` arguments with every default, for `model_path` and its adapters (name=path)."""
    make_arg_parser = _first_attr((("vllm.entrypoints.launchers.cli_args", "make_arg_parser"),
                                   ("vllm.entrypoints.openai.cli_args", "make_arg_parser")))
    parser_cls = _first_attr((("vllm.utils.argparse_utils", "FlexibleArgumentParser"),
                              ("vllm.utils", "FlexibleArgumentParser")))
    flags = ["--lora-modules", *adapters] if adapters else []
    return make_arg_parser(parser_cls()).parse_args(["--model", model_path, *flags])


def server_args(config: KvtideConfig, engine: Any) -> Any:
    """The argument namespace vLLM's app reads: parser defaults, then kvtide's config, then the engine's configs."""
    vllm_config = engine.vllm_config
    args = _parsed_server_args(vllm_config.model_config.model, lora_modules(config.lora.adapters))
    # Cached prompt tokens in usage, as kvtide's own path always reports them (extra_args may turn it off).
    args.enable_prompt_tokens_details = True
    for name, value in config.serving.server_args().items():
        setattr(args, name, value)
    args.served_model_name = [config.model_name]
    # The engine's own config objects: what the serving layer checks is what the engine enforces.
    args.structured_outputs_config = vllm_config.structured_outputs_config
    args.max_logprobs = vllm_config.model_config.max_logprobs
    args.enable_log_requests = False  # prompts are never logged (kvtide's rule)
    args.disable_fastapi_docs = True
    return args


def build_chat_renderer(config: KvtideConfig, model_path: str) -> tuple[Any, Any]:
    """(vLLM's OnlineRenderer, its chat request model) for this replica's model and serving options, built as vLLM's
    GPU-less render server builds them (vllm.entrypoints.launchers.render): the engine's arguments make the model
    config, `server_args` the serving options, so it renders what this replica's vLLM layer renders. Imports vLLM
    (seconds); no GPU, no engine."""
    import asyncio

    from starlette.datastructures import State
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from kvtide.deployments.engine.placement import engine_kwargs

    engine_args = AsyncEngineArgs(**engine_kwargs(config, model_path))
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # rendering runs no kernel (vLLM's render server does the same)
    vllm_config = VllmConfig(model_config=model_config, logging_config=engine_args.create_logging_config(),
                             structured_outputs_config=engine_args.create_structured_outputs_config())
    state = State()
    asyncio.run(init_render_app_state(vllm_config, state,
                                      server_args(config, types.SimpleNamespace(vllm_config=vllm_config))))
    return state.online_renderer, ChatCompletionRequest


def system_fingerprint(app: Any) -> str | None:
    """The fingerprint vLLM's layer puts in its responses (None where this vLLM has none)."""
    chat = getattr(app.state, "openai_serving_chat", None)
    return getattr(chat, "system_fingerprint", None)


def _call_with_accepted(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **the kwargs its signature names): vLLM versions differ in what they take."""
    accepted = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kwargs.items() if k in accepted})


async def build_vllm_openai_app(config: KvtideConfig, engine: Any) -> Any:
    """vLLM's OpenAI ASGI app serving `engine` (an AsyncLLM), its state initialised."""
    from starlette.datastructures import State

    build_app = _first_attr((("vllm.entrypoints.launchers.app", "build_app"),
                             ("vllm.entrypoints.openai.api_server", "build_app")))
    init_app_state = _first_attr((("vllm.entrypoints.launchers.api_server.app_state", "init_app_state"),
                                  ("vllm.entrypoints.openai.api_server", "init_app_state")))
    args = server_args(config, engine)
    supported_tasks = await engine.get_supported_tasks() if hasattr(engine, "get_supported_tasks") else ("generate",)
    app = _call_with_accepted(build_app, args, supported_tasks=supported_tasks, model_config=engine.model_config)
    state = State()
    await _call_with_accepted(init_app_state, engine, state=state, args=args, supported_tasks=supported_tasks,
                              vllm_config=engine.vllm_config)
    app.state._state.update(state._state)
    # On an engine error vLLM's handlers flip `state.server.should_exit` (its uvicorn server);
    # Ray Serve runs the HTTP server and restarts a replica whose health check fails, but the
    # attribute must exist, or the AttributeError replaces the engine's error in the response.
    app.state.server = types.SimpleNamespace()
    logger.info("vLLM's OpenAI serving layer ready (tool parser %s, reasoning parser %s)",
                args.tool_call_parser, config.serving.reasoning_parser)
    return app
