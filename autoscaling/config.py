"""The `autoscaling:` section of the kvtide config.

    AutoscalingSettings
    ├── policy                  kv (this package's control law) | queue_length (Ray's default)
    ├── target/upper/lower_kv_perc, look_back_s, upscale/downscale_delay_s, max_step, ...
    ├── target_ongoing_requests only for queue_length
    └── warm_start  WarmStartSettings   prefill hot prefixes on a new replica first

It only matters when `replicas` gives min/max (autoscaling). The law's tunables are
documented in `autoscaling.control_law`; `law_tunables()` hands them over.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autoscaling.control_law import LawTunables

_DEFAULTS = LawTunables()


class _Strict(BaseModel):
    """Unknown keys are errors: a typo must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WarmStartSettings(_Strict):
    """Cache-warm scale-up: a new replica prefills the hottest shared prefixes before taking traffic."""

    enabled: bool = Field(True, description="Prefill hot prefixes on a new replica before it takes traffic.")
    token_budget: int = Field(
        32768, ge=0, description="Most prompt tokens a new replica prefills for warm-up (0 disables it)."
    )
    max_prefixes: int = Field(16, ge=0, description="Most distinct prefixes a new replica prefills.")
    max_kv_fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="Largest share of the replica's KV cache the warm prefixes may fill."
    )


class AutoscalingSettings(_Strict):
    """How engine replicas scale between replicas.min_replicas and replicas.max_replicas."""

    policy: Literal["kv", "queue_length"] = Field(
        "kv",
        description="kv: scale on KV-block utilization, waiting requests and preemptions; "
        "queue_length: Ray Serve's default request-count policy (for comparison).",
    )
    target_kv_perc: float = Field(
        _DEFAULTS.target_kv_perc, gt=0.0, lt=1.0,
        description="KV-block utilization a scale-up sizes the deployment for.",
    )
    upper_kv_perc: float = Field(
        _DEFAULTS.upper_kv_perc, gt=0.0, le=1.0,
        description="Scale up when KV utilization over running + starting replicas stays above this.",
    )
    lower_kv_perc: float = Field(
        _DEFAULTS.lower_kv_perc, gt=0.0, lt=1.0,
        description="Scale down when KV utilization projected onto one replica fewer stays below this.",
    )
    look_back_s: float = Field(
        30.0, gt=0.0, description="Window the replica signals are averaged over (Ray's look_back_period_s)."
    )
    upscale_delay_s: float = Field(
        _DEFAULTS.upscale_delay_s, ge=0.0, description="How long pressure must persist before adding replicas."
    )
    downscale_delay_s: float = Field(
        _DEFAULTS.downscale_delay_s, ge=0.0, description="How long slack must persist before removing replicas."
    )
    max_step: int = Field(_DEFAULTS.max_step, ge=1, description="Most replicas added or removed by one decision.")
    upscale_waiting_per_replica: float = Field(
        _DEFAULTS.upscale_waiting_per_replica, gt=0.0,
        description="Mean waiting requests per running replica that count as queueing (a reason to scale up).",
    )
    upscale_preemptions_per_replica: float = Field(
        _DEFAULTS.upscale_preemptions_per_replica, gt=0.0,
        description="Preemptions per running replica within the window that count as preempting.",
    )
    target_ongoing_requests: float = Field(
        16.0, gt=0.0,
        description="queue_length policy only: ongoing requests per replica Ray aims for "
        "(about half of engine.max_num_seqs is a fair baseline).",
    )
    warm_start: WarmStartSettings = Field(default_factory=WarmStartSettings)

    @model_validator(mode="after")
    def _check(self) -> "AutoscalingSettings":
        lower, target, upper = self.lower_kv_perc, self.target_kv_perc, self.upper_kv_perc
        fix = (f"keep lower_kv_perc < target_kv_perc < upper_kv_perc (defaults "
               f"{_DEFAULTS.lower_kv_perc} < {_DEFAULTS.target_kv_perc} < {_DEFAULTS.upper_kv_perc})")
        if lower >= upper:
            raise ValueError(
                f"autoscaling.lower_kv_perc={lower} is not below autoscaling.upper_kv_perc={upper}; "
                f"lower it or raise upper_kv_perc: {fix}"
            )
        if not lower < target:
            raise ValueError(
                f"autoscaling.target_kv_perc={target} is not above autoscaling.lower_kv_perc={lower}; "
                f"raise target_kv_perc or lower lower_kv_perc: {fix}"
            )
        if not target < upper:
            raise ValueError(
                f"autoscaling.target_kv_perc={target} is not below autoscaling.upper_kv_perc={upper}; "
                f"lower target_kv_perc or raise upper_kv_perc: {fix}"
            )
        return self

    def law_tunables(self) -> LawTunables:
        """The control law's knobs, taken from this section."""
        return LawTunables(
            target_kv_perc=self.target_kv_perc,
            upper_kv_perc=self.upper_kv_perc,
            lower_kv_perc=self.lower_kv_perc,
            upscale_delay_s=self.upscale_delay_s,
            downscale_delay_s=self.downscale_delay_s,
            max_step=self.max_step,
            upscale_waiting_per_replica=self.upscale_waiting_per_replica,
            upscale_preemptions_per_replica=self.upscale_preemptions_per_replica,
        )
