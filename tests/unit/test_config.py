"""The one config model: defaults, YAML + overrides, and errors that name field, value and fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtide.config import ConfigError, KvtideConfig, apply_overrides, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_valid():
    """An empty config is a valid one-replica GPU config of the demo model."""
    config = parse_config({})
    assert config.model == "demo" and config.replicas.num_replicas == 1
    assert config.engine.block_size == 16 and config.http.port == 8000 and config.metrics.port == 8080


@pytest.mark.parametrize("name", ["cpu.yaml", "gpu-tp2.yaml"])
def test_example_configs_load(name):
    """Every config preset in config/presets validates."""
    assert isinstance(load_config(REPO / "config/presets" / name), KvtideConfig)


def test_overrides_parse_yaml_scalars():
    """--set values are YAML scalars: ints, bools and null arrive typed."""
    config = load_config(REPO / "config/presets/cpu.yaml",
                         ["engine.max_model_len=2048", "engine.enforce_eager=false", "engine.max_num_batched_tokens=null"])
    assert config.engine.max_model_len == 2048
    assert config.engine.enforce_eager is False and config.engine.max_num_batched_tokens is None


def test_overrides_do_not_mutate_input():
    """Applying overrides returns a new dict and leaves the loaded YAML untouched."""
    data = {"engine": {"seed": 1}}
    merged = apply_overrides(data, ["engine.seed=2"])
    assert data["engine"]["seed"] == 1 and merged["engine"]["seed"] == 2


@pytest.mark.parametrize(("data", "needles"), [
    ({"engine": {"block_sise": 32}}, ["engine.block_sise", "unknown key", "did you mean 'block_size'"]),
    ({"modle": "x"}, ["modle", "did you mean 'model'"]),
    ({"engine": {"block_size": 24}}, ["engine.block_size=24", "use one of"]),
    ({"engine": {"tensor_parallel_size": 0}}, ["engine.tensor_parallel_size", "got 0", "greater than or equal to 1"]),
    ({"engine": {"gpu_memory_utilization": 1.5}}, ["engine.gpu_memory_utilization", "1.5"]),
    ({"engine": {"dtype": "fp8"}}, ["engine.dtype", "'fp8'", "bfloat16"]),
    ({"replicas": {"min_replicas": 3, "max_replicas": 2}}, ["min_replicas=3", "max_replicas=2", "min_replicas <= max_replicas"]),
    ({"replicas": {"num_replicas": 2, "min_replicas": 1, "max_replicas": 2}}, ["either num_replicas", "not both"]),
    ({"replicas": {"min_replicas": 1}}, ["needs both min_replicas and max_replicas"]),
    ({"routing": {"policy": "random"}}, ["routing.policy", "'random'"]),
    ({"http": {"port": 8080}}, ["http.port and metrics.port are both 8080"]),
    ({"http": {"port": "eighty"}}, ["http.port", "'eighty'"]),
    ({"engine": {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 4096}},
     ["max_num_batched_tokens=512", "max_model_len=4096", "enable_chunked_prefill: true"]),
    ({"engine": {"kv_offload": {"size_gib": 0}}}, ["engine.kv_offload.size_gib", "got 0", "greater than 0"]),
    ({"engine": {"kv_offload": {"size_gib": 8, "backend": "mooncake"}}},
     ["engine.kv_offload.backend", "'mooncake'", "'native'", "'lmcache'"]),
    ({"engine": {"kv_offload": {"load_gib_per_s": -1}}}, ["engine.kv_offload.load_gib_per_s", "got -1"]),
    ({"engine": {"kv_offload": {"size_gb": 8}}}, ["engine.kv_offload.size_gb", "did you mean 'size_gib'"]),
])
def test_bad_config_names_field_value_and_fix(data, needles):
    """Each bad config raises ConfigError whose message names the field, the value and the fix."""
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    for needle in needles:
        assert needle in str(exc.value)


def test_the_cpu_kv_tier_is_off_by_default_and_in_every_packaged_preset():
    """engine.kv_offload defaults to no tier (size_gib null) of vLLM's native backend; no preset turns it on."""
    from kvtide.config import preset_names, preset_path

    offload = parse_config({}).engine.kv_offload
    assert (offload.size_gib, offload.backend) == (None, "native") and offload.load_gib_per_s > 0
    for name in preset_names():
        assert load_config(preset_path(name)).engine.kv_offload.size_gib is None, name


def test_a_cpu_kv_tier_on_a_cpu_engine_fails_at_load_quoting_vllms_refusal():
    """A CPU tier on a CPU engine is refused at load (not at engine start), quoting vLLM's own reason and the fix."""
    with pytest.raises(ConfigError) as exc:
        load_config(REPO / "config/presets/cpu.yaml", ["engine.kv_offload.size_gib=4"])
    message = str(exc.value)
    assert "engine.kv_offload.size_gib=4 with resources.device=cpu" in message
    assert '"CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"' in message
    assert "set engine.kv_offload.size_gib: null" in message


def test_the_native_tier_owns_kv_transfer_config_and_lmcache_or_no_tier_leave_it_to_the_user():
    """extra_args.kv_transfer_config is refused with the native tier on, and passes with lmcache or no tier."""
    transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}
    with pytest.raises(ConfigError) as exc:
        parse_config({"engine": {"kv_offload": {"size_gib": 8}, "extra_args": {"kv_transfer_config": transfer}}})
    assert "engine.extra_args.kv_transfer_config: kvtide sets this itself while engine.kv_offload.size_gib" in str(
        exc.value)
    for offload in ({"size_gib": 8, "backend": "lmcache"}, {}):
        config = parse_config({"engine": {"kv_offload": offload, "extra_args": {"kv_transfer_config": transfer}}})
        assert config.engine.extra_args["kv_transfer_config"] == transfer


def test_several_errors_are_all_reported():
    """All problems are listed at once, one line each, so a user fixes them in one go."""
    with pytest.raises(ConfigError) as exc:
        parse_config({"engine": {"seed": -1, "max_num_seqs": 0}, "bogus": 1})
    lines = str(exc.value).splitlines()[1:]
    assert len(lines) == 3


def test_missing_file_and_non_mapping_are_clear(tmp_path):
    """A missing file or a YAML list at top level is a ConfigError, not a traceback."""
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_malformed_override_is_clear():
    """An override without '=' says how to write it."""
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["engine.seed"])


def test_autoscaling_bounds_replace_fixed_count():
    """Giving min/max replicas alone switches to autoscaling with min as the initial count."""
    config = parse_config({"replicas": {"min_replicas": 2, "max_replicas": 5}})
    assert config.replicas.autoscaling and config.replicas.replicas_at_start == 2


def test_model_name_defaults():
    """Clients address the demo as 'kvtide-demo' and a hub id by its last path part."""
    assert parse_config({}).model_name == "kvtide-demo"
    assert parse_config({"model": "meta-llama/Llama-3.1-8B"}).model_name == "Llama-3.1-8B"
    assert parse_config({"model": "x/y", "served_model_name": "prod"}).model_name == "prod"


def test_old_ingress_section_is_read_as_frontend_with_one_warning(caplog):
    """A config written with the old `ingress` section keeps its values (under frontend) and says so once."""
    with caplog.at_level("WARNING", logger="kvtide.config"):
        config = parse_config({"ingress": {"max_messages": 7, "auth": {"require_keys": True}}})
    assert config.frontend.max_messages == 7 and config.frontend.auth.require_keys is True
    assert [r.getMessage() for r in caplog.records if "'ingress'" in r.getMessage()] == [
        "kvtide config: section 'ingress' is now called 'frontend'; read as 'frontend' (rename it in your config)"]


def test_old_override_key_reaches_the_frontend():
    """`--set ingress.max_messages=9` (the old key) sets frontend.max_messages."""
    assert load_config(None, ["ingress.max_messages=9"]).frontend.max_messages == 9


def test_old_and_new_section_together_is_an_error_naming_both():
    """Both `ingress` and `frontend` set: refused, since which one was meant cannot be known."""
    with pytest.raises(ConfigError, match="both 'ingress' and 'frontend'"):
        parse_config({"ingress": {"max_messages": 7}, "frontend": {"max_messages": 8}})


def test_old_override_key_applies_over_a_file_written_with_either_name(tmp_path):
    """`--set ingress.x=…` on a config whose file says `frontend:` (or `ingress:`) lands in frontend, no conflict."""
    for section in ("frontend", "ingress"):
        path = tmp_path / f"{section}.yaml"
        path.write_text(f"{section}:\n  max_messages: 3\n  max_body_bytes: 4096\n")
        config = load_config(path, ["ingress.max_messages=9"])
        assert (config.frontend.max_messages, config.frontend.max_body_bytes) == (9, 4096)


def test_extra_engine_args_reach_the_engine_kwargs():
    """engine.extra_args passes any vLLM engine argument through to AsyncEngineArgs as given."""
    from kvtide.deployments.engine.placement import engine_kwargs

    config = parse_config({"engine": {"extra_args": {"kv_cache_dtype": "fp8", "num_gpu_blocks_override": 64}}})
    kwargs = engine_kwargs(config, "/m")
    assert (kwargs["kv_cache_dtype"], kwargs["num_gpu_blocks_override"]) == ("fp8", 64)


@pytest.mark.parametrize(("extra", "needle"), [
    ({"kv_cache_dtyp": "fp8"}, "engine.extra_args.kv_cache_dtyp: not an engine argument of the installed vLLM; "
                               "did you mean 'kv_cache_dtype'?"),
    ({"max_model_len": 8}, "engine.extra_args.max_model_len: kvtide exposes it; set engine.max_model_len instead"),
    ({"kv_events_config": {}}, "engine.extra_args.kv_events_config: kvtide sets this itself"),
    ({"kv_offloading_size": 8}, "engine.extra_args.kv_offloading_size: kvtide sets this itself "
                                "(from engine.kv_offload.size_gib)"),
    ({"kv_offloading_backend": "lmcache"}, "engine.extra_args.kv_offloading_backend: kvtide sets this itself "
                                           "(from engine.kv_offload.backend)"),
])
def test_a_bad_extra_engine_arg_fails_when_the_config_loads_naming_the_fix(extra, needle):
    """A misspelt, exposed or kvtide-owned name is refused at load, in one line naming the fix."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_config({"engine": {"extra_args": extra}})


def test_every_extra_arg_name_is_a_real_engine_arg_of_the_installed_vllm():
    """The names read from vLLM's source are exactly AsyncEngineArgs' dataclass fields (public ones)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    from kvtide.config.vllm_args import engine_arg_names

    public = {f.name for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_")}
    assert engine_arg_names() == public
