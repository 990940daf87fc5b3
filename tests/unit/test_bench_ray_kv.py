"""The `ray_kv` baseline's set-up: Ray Serve LLM mirrors kvtide's config, and its vLLM compat alias works."""

from __future__ import annotations

import subprocess
import sys

from kvtide.benchmarks.ray_llm_fleet import COMPAT_DIR, KV_ROUTER_CLASS, RAY_LLM_ENV, SERVER_CLS, child_env, llm_config_kwargs
from kvtide.config import parse_config


def test_llm_config_mirrors_kvtides_engine_flags_and_replicas():
    """Same engine kwargs (minus model naming), replica count and one CPU bundle per TP worker, KV-aware router."""
    config = parse_config({"replicas": {"num_replicas": 3}, "engine": {"max_num_seqs": 7}, "resources": {"device": "cpu"}})
    kw = llm_config_kwargs(config, "/models/demo")
    assert kw["model_loading_config"] == {"model_id": config.model_name, "model_source": "/models/demo"}
    assert kw["engine_kwargs"]["max_num_seqs"] == 7 and "model" not in kw["engine_kwargs"]
    assert kw["deployment_config"] == {"num_replicas": 3,
                                       "request_router_config": {"request_router_class": KV_ROUTER_CLASS}}
    assert kw["placement_group_config"] == {"bundles": [{"CPU": config.resources.cpus_per_worker}]}
    assert kw["server_cls"] == SERVER_CLS  # CPU: each engine bound to its own cores


def test_gpu_config_asks_for_the_gpu_share_and_keeps_ray_llms_server():
    """On GPUs a bundle holds the replica's GPU share, and no CPU binding subclass is needed."""
    config = parse_config({"resources": {"device": "gpu", "gpus_per_worker": 0.5},
                           "engine": {"kv_cache_memory_bytes": 1 << 30}})
    kw = llm_config_kwargs(config, "/m")
    assert kw["placement_group_config"]["bundles"][0]["GPU"] == 0.5 and kw["server_cls"] is None
    # vLLM's Ray worker must ask for the share, not a whole GPU, or it cannot fit the bundle
    assert kw["runtime_env"] == {"env_vars": {"VLLM_RAY_PER_WORKER_GPUS": "0.5"}}
    whole = llm_config_kwargs(parse_config({"resources": {"device": "gpu", "gpus_per_worker": 1}}), "/m")
    assert "runtime_env" not in whole


def test_child_env_sets_the_switches_and_puts_the_compat_folder_first():
    """Direct streaming, HAProxy and body forwarding on; compat folder first on PYTHONPATH; the cores listed."""
    env = child_env({"PYTHONPATH": "/x"}, [0, 1])
    assert all(env[k] == v for k, v in RAY_LLM_ENV.items())
    assert env["PYTHONPATH"].split(":") == [str(COMPAT_DIR), "/x"]
    assert env["KVTIDE_BENCH_CORES"] == "0,1"


def test_compat_alias_makes_the_moved_chat_utils_importable():
    """With the compat folder on PYTHONPATH, Ray 2.60's `from vllm.entrypoints.chat_utils import ...` works."""
    code = "from vllm.entrypoints.chat_utils import load_chat_template; print(load_chat_template.__module__)"
    out = subprocess.run([sys.executable, "-c", code], env=child_env({}, [0]), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("chat_utils")
