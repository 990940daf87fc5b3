"""kvtide's config: one pydantic model tree, the leaf every other package imports.

It imports no other part of kvtide (a unit test pins that), so the deployments, the
autoscaler, the CLI and the chart's schema generator can all depend on it.

    base.py         Strict: the base of every section (unknown keys are errors)
    model.py        KvtideConfig, the sections without a module of their own, parse/load
    routing.py      RoutingConfig: the router policy and its tunables
    autoscaling.py  AutoscalingSettings, WarmStartSettings: the KV control law's tunables
    presets.py      the packaged presets (presets/*.yaml) and the default config path
"""

from kvtide.config.autoscaling import AutoscalingSettings, WarmStartSettings
from kvtide.config.base import Strict
from kvtide.config.model import (
    DEMO_MODEL,
    AdmissionConfig,
    AuthConfig,
    ConfigError,
    EngineConfig,
    HttpConfig,
    FrontendConfig,
    KvtideConfig,
    MetricsConfig,
    ReplicasConfig,
    ResourcesConfig,
    apply_overrides,
    config_to_dict,
    load_config,
    parse_config,
)
from kvtide.config.presets import default_config_path, preset_names, preset_path
from kvtide.config.routing import RoutingConfig

__all__ = [
    "DEMO_MODEL", "AdmissionConfig", "AuthConfig", "AutoscalingSettings", "ConfigError", "EngineConfig",
    "HttpConfig", "FrontendConfig", "KvtideConfig", "MetricsConfig", "ReplicasConfig", "ResourcesConfig",
    "RoutingConfig", "Strict", "WarmStartSettings", "apply_overrides", "config_to_dict", "default_config_path",
    "load_config", "parse_config", "preset_names", "preset_path",
]
