"""`lora:` — LoRA adapters served beside the base model (vLLM's multi-LoRA).

Each adapter is served as a model of its own name (listed in /v1/models with the base model
as `parent`); a request naming it is answered by vLLM's serving layer on the replica with the
adapter applied. vLLM keys the adapter into its KV block hashes, so the router does too: an
adapter's prompts are routed on that adapter's cached blocks.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from kvtide.config.base import Strict

# The adapter path that builds a random demo adapter of the demo model (no hub is needed).
DEMO_ADAPTER = "demo"


class LoraConfig(Strict):
    """Adapters by served name, and vLLM's LoRA capacity per engine."""

    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="Served name -> adapter directory (PEFT layout) on every engine node; 'demo': a random "
                    "adapter of the demo model, built locally.")
    max_loras: int = Field(4, ge=1, description="Adapters one engine batch may mix (vLLM's max_loras).")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank (vLLM's max_lora_rank).")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters kept in host memory per engine (vLLM's max_cpu_loras); null: max_loras.")

    @model_validator(mode="after")
    def _check(self) -> "LoraConfig":
        for name, path in self.adapters.items():
            if not name or not path:
                raise ValueError("lora.adapters: every adapter needs a name and a path")
        return self

    def engine_args(self) -> dict[str, object]:
        """vLLM's engine arguments for these adapters ({} when none is configured)."""
        if not self.adapters:
            return {}
        args: dict[str, object] = {"enable_lora": True, "max_loras": self.max_loras,
                                   "max_lora_rank": self.max_lora_rank}
        if self.max_cpu_loras is not None:
            args["max_cpu_loras"] = self.max_cpu_loras
        return args
