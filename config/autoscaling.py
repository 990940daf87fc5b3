"""The `autoscaling:` section of the kvtide config.

    AutoscalingSettings
    ├── policy                  kv (this package's control law) | queue_length (Ray's default)
    ├── target/upper/lower_kv_perc, look_back_s, upscale/downscale_delay_s, max_step, ...
    ├── fast_upscale, fast_upscale_delay_s, trend_window_s, trend_horizon_s   the fast up-path
    ├── scale_down_cooldown_s   no scale-down this soon after a scale-up
    ├── target_ongoing_requests only for queue_length
    ├── standby_replicas, standby_timeout_s, scale_down_chooser, cache_value_window_s, sleep_level
    │                           standby engines and which replica a scale-down takes (autoscaling.standby)
    └── warm_start  WarmStartSettings   prefill hot prefixes on a new replica first

It only matters when `replicas` gives min/max (autoscaling). Declared once, here: the
control law (`kvtide.autoscaling.control_law`, whose docstring gives each default's
reason) takes this model as its tunables, and the Ray policy adapter receives it as plain
data and validates it back.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvtide.config.base import Strict


class WarmStartSettings(Strict):
    """Cache-warm scale-up: a new replica prefills the hottest shared prefixes before taking traffic."""

    enabled: bool = Field(True, description="Prefill hot prefixes on a new replica before it takes traffic.")
    token_budget: int = Field(
        32768, ge=0, description="Most prompt tokens a new replica prefills for warm-up (0 disables it)."
    )
    max_prefixes: int = Field(16, ge=0, description="Most distinct prefixes a new replica prefills.")
    max_kv_fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="Largest share of the replica's KV cache the warm prefixes may fill."
    )


class AutoscalingSettings(Strict):
    """How engine replicas scale between replicas.min_replicas and replicas.max_replicas."""

    policy: Literal["kv", "queue_length"] = Field(
        "kv",
        description="kv: scale on KV-block utilization, waiting requests and preemptions; "
        "queue_length: Ray Serve's default request-count policy (for comparison).",
    )
    target_kv_perc: float = Field(
        0.7, gt=0.0, lt=1.0,
        description="KV-block utilization a scale-up sizes the deployment for.",
    )
    upper_kv_perc: float = Field(
        0.85, gt=0.0, le=1.0,
        description="Scale up when KV utilization over running + starting replicas stays above this.",
    )
    lower_kv_perc: float = Field(
        0.6, gt=0.0, lt=1.0,
        description="Scale down when KV utilization projected onto one replica fewer stays below this.",
    )
    look_back_s: float = Field(
        30.0, gt=0.0, description="Window the replica signals are averaged over (Ray's look_back_period_s)."
    )
    metrics_push_interval_s: float = Field(
        2.0, gt=0.0,
        description="How often each replica pushes its autoscaling stats to the Serve controller: the engine "
        "deployment's metrics_interval_s (what Ray 2.60 reads) and "
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S (its announced replacement; `kvtide serve` and the Helm chart set it on every Ray process). Ray's default "
        "is 10 s, slow for KV pressure. Must be below look_back_s.",
    )
    upscale_delay_s: float = Field(
        30.0, ge=0.0,
        description="How long look-back-mean pressure must persist before adding replicas (the slow path).",
    )
    downscale_delay_s: float = Field(
        300.0, ge=0.0, description="How long slack must persist before removing replicas."
    )
    fast_upscale: bool = Field(
        True,
        description="Scale up within seconds when the latest KV samples trend across upper_kv_perc or "
        "waiting requests rise or requests get preempted; false leaves only the look-back-mean path.",
    )
    fast_upscale_delay_s: float = Field(
        2.0, ge=0.0, le=60.0,
        description="How long a fast-path trigger (KV trend, rising queue, preemptions) must hold before adding "
        "replicas (the law never waits longer than upscale_delay_s on it).",
    )
    trend_window_s: float = Field(
        10.0, gt=0.0, le=120.0,
        description="Span of the latest samples the fast path fits its KV trend line to (least squares).",
    )
    trend_horizon_s: float = Field(
        4.0, ge=0.0, le=120.0,
        description="How far ahead the fast path extends the KV trend line: it fires when the line crosses "
        "upper_kv_perc within this horizon.",
    )
    scale_down_cooldown_s: float = Field(
        60.0, ge=0.0, le=3600.0,
        description="No scale-down within this long of the last scale-up.",
    )
    max_step: int = Field(2, ge=1, description="Most replicas added or removed by one decision.")
    upscale_waiting_per_replica: float = Field(
        2.0, gt=0.0,
        description="Mean waiting requests per running replica that count as queueing (a reason to scale up).",
    )
    upscale_preemptions_per_replica: float = Field(
        1.0, gt=0.0,
        description="Preemptions per running replica within the window that count as preempting.",
    )
    target_ongoing_requests: float = Field(
        16.0, gt=0.0,
        description="queue_length policy only: ongoing requests per replica Ray aims for "
        "(about half of engine.max_num_seqs is a fair baseline).",
    )
    standby_replicas: int = Field(
        0, ge=0, le=64,
        description="Engines kept started beyond the active replicas, asleep (vLLM sleep mode on GPU; awake but "
        "unrouted on CPU) and out of routing and the KV average: a scale-up wakes one in seconds instead of "
        "starting a replica. kv policy only. Each holds its Ray resources (its GPUs) while it waits.",
    )
    standby_timeout_s: float = Field(
        300.0, ge=0.0,
        description="A standby beyond standby_replicas (a replica a scale-down put to sleep) is stopped after this long.",
    )
    scale_down_chooser: Literal["cache_aware", "ray"] = Field(
        "cache_aware",
        description="Which replica a scale-down takes. cache_aware: the active replica whose cache is worth least "
        "(prefix-cache hit tokens it served within cache_value_window_s from blocks no other replica held, plus a "
        "tenth of its other hits) goes to standby (asleep when "
        "standby_replicas > 0 on GPU, else awake and unrouted) and is stopped after standby_timeout_s; ray: Ray "
        "Serve chooses which replica to stop. kv policy only.",
    )
    cache_value_window_s: float = Field(
        60.0, gt=0.0, le=3600.0,
        description="Window over which a replica's served prefix-cache hits (those only it held, and the rest) make "
        "its cache's worth for cache_aware.",
    )
    sleep_level: Literal[1, 2] = Field(
        1,
        description="vLLM sleep level of a standby engine on GPU: 1 offloads the weights to host memory and frees "
        "the KV cache (wakes fastest), 2 discards the weights too (least host memory, reloads them on wake).",
    )
    warm_start: WarmStartSettings = Field(default_factory=WarmStartSettings)

    @property
    def manages_roles(self) -> bool:
        """Whether the kv policy assigns active/standby roles (standby engines or a cache-aware scale-down)."""
        return self.policy == "kv" and (self.standby_replicas > 0 or self.scale_down_chooser == "cache_aware")

    @model_validator(mode="after")
    def _check(self) -> "AutoscalingSettings":
        lower, target, upper = self.lower_kv_perc, self.target_kv_perc, self.upper_kv_perc
        defaults = {name: type(self).model_fields[name].default
                    for name in ("lower_kv_perc", "target_kv_perc", "upper_kv_perc")}
        fix = ("keep lower_kv_perc < target_kv_perc < upper_kv_perc (defaults "
               f"{defaults['lower_kv_perc']} < {defaults['target_kv_perc']} < {defaults['upper_kv_perc']})")
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
        if self.policy == "queue_length" and self.standby_replicas > 0:
            raise ValueError(
                f"autoscaling.standby_replicas={self.standby_replicas} needs autoscaling.policy=kv (Ray's queue_length "
                "policy cannot keep replicas out of routing); set policy: kv or standby_replicas: 0")
        if self.scale_down_chooser == "ray" and self.standby_replicas > 0:
            raise ValueError(
                f"autoscaling.standby_replicas={self.standby_replicas} needs autoscaling.scale_down_chooser=cache_aware: "
                "a standby pool has kvtide assign roles, so a scale-down puts a replica kvtide chooses to standby; "
                "set scale_down_chooser: cache_aware or standby_replicas: 0")
        # Ray (2.60) pushes replica stats every metrics_interval_s, which kvtide sets to
        # metrics_push_interval_s, and warns (later: raises) unless the window is longer.
        if self.look_back_s <= self.metrics_push_interval_s:
            raise ValueError(
                f"autoscaling.look_back_s={self.look_back_s} is not above "
                f"autoscaling.metrics_push_interval_s={self.metrics_push_interval_s}: a window must span more "
                "than one stats push; raise look_back_s or lower metrics_push_interval_s"
            )
        return self
