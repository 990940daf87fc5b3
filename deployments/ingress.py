"""Ingress mode's front door: a Serve deployment that owns the tokenizer and the engine handle.

    client ─HTTP─► Ingress replica (frontend.app + frontend.pipeline) ─handle─► EngineReplica (router picks)

Who needs it: Ray clusters where Serve's HAProxy direct ingress cannot run, and side-by-side
comparisons; direct mode (the default) has no Ray hop on the token path.

The OpenAI app, the request pipeline and the handle client live in deployments/frontend/
(app, pipeline, prompts, engine_client, sse); this class wires them for one replica
and answers the engines' warm-start lookups (`hot_prefixes`). Direct mode (deployments.server)
wires the same parts inside the engine replica instead.
"""

from __future__ import annotations

import asyncio

from ray import serve
from ray.serve.handle import DeploymentHandle

from kvtide.config import KvtideConfig, parse_config
from kvtide.deployments.frontend.engine_client import HandleEngineClient
from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
from kvtide.deployments.frontend.app import build_frontend, build_openai_app
from kvtide.deployments.frontend.vllm_layer import HandleVllmApp, fleet_caller

READY_TIMEOUT_S = 5.0


@serve.ingress()
class Ingress:
    """One ingress replica: tokenizes, admits, and streams from engines through a handle."""

    def __init__(self, engine: DeploymentHandle, config_dict: dict):
        config: KvtideConfig = parse_config(config_dict)
        self.engine = engine
        self.frontend, self.api_keys = build_frontend(
            config, lambda limits: HandleEngineClient(engine, limits), HotPrefixTracker(config.engine.block_size),
            "ingress")
        # What kvtide's path does not implement goes whole to an engine replica's vLLM layer.
        self.frontend.vllm_app = HandleVllmApp(engine, self.frontend.vllm_routing_fields, self.frontend.limits)
        self.frontend.fleet_vllm = fleet_caller(engine)

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.frontend, self.api_keys, self._engine_ready)

    async def _engine_ready(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.engine.ready.remote(), timeout=READY_TIMEOUT_S))
        except Exception:
            return False

    async def hot_prefixes(self, limit: int = 32) -> list[tuple[list[int], float]]:
        """Handle method (not HTTP): shared prefixes a new engine replica should prefill."""
        return self.frontend.routing.hottest(limit)
