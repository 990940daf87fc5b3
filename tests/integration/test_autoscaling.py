"""The KV autoscaler on a real cluster: load that fills the KV cache adds a replica, which starts warm."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from ray import serve
from support import ThreadClients, decided_engines, metric_sum, running_engines, wait_for, words_text

from kvtide.cluster.app import build_from_config
from kvtide.config import load_config

REPO = Path(__file__).resolve().parents[2]
APP = "kvtide-autoscale"
MODEL = "kvtide-demo-as"


def test_kv_pressure_scales_up_warm_and_back_down(cluster, cluster_config):
    """Four long requests fill the KV cache → a second replica (queue_length would keep one); it starts warm; idle → one (the retired one)."""
    config = load_config(REPO / "config/presets/cpu.yaml", [
        f"http.port={cluster_config.http.port}", f"metrics.port={cluster_config.metrics.port}",
        f"served_model_name={MODEL}", "replicas.num_replicas=null", "replicas.min_replicas=1",
        "replicas.max_replicas=2", "engine.max_model_len=2048",
        # 12 MiB of KV: ~4k tokens, so three long requests fill one replica.
        "engine.kv_cache_memory_bytes=12582912",
        "autoscaling.metrics_push_interval_s=1", "autoscaling.look_back_s=2", "autoscaling.upscale_delay_s=2",
        "autoscaling.downscale_delay_s=8", "autoscaling.scale_down_cooldown_s=10",
        "autoscaling.target_kv_perc=0.35", "autoscaling.upper_kv_perc=0.5", "autoscaling.lower_kv_perc=0.15",
        "autoscaling.max_step=1", "autoscaling.warm_start.token_budget=4096",
        # The scale-down sets the least valuable replica aside and, with no standby wait, retires it.
        "autoscaling.standby_timeout_s=0",
    ])
    serve.run(build_from_config(config), name=APP, route_prefix="/as", blocking=False)
    base = cluster.base_url + "/as"
    client = ThreadClients(base_url=base, timeout=180)
    stop = threading.Event()
    try:
        assert running_engines(APP) == 1
        hot = words_text(7, 450)  # a shared system prompt of ~900 tokens, seen by the ingress as hot
        for i in range(4):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": f"{hot} q{i}", "max_tokens": 1})
            assert r.status_code == 200, r.text
        first_replica = r.headers["x-kvtide-replica"]

        def load(worker: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                client.post("/v1/completions", json={
                    "model": MODEL, "prompt": words_text(1000 * worker + n, 600), "max_tokens": 300})

        # Few requests, long contexts: 4 in flight is far under the request count Ray's
        # queue_length policy aims for per replica, so it would not add a replica; KV does.
        num_workers = 4
        assert num_workers < config.autoscaling.target_ongoing_requests
        workers = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(num_workers)]
        for w in workers:
            w.start()
        # The load stops once the second replica is decided, before it can take traffic: a
        # long request landing on the new replica (4k tokens of KV) would evict the warmed
        # prefix and make the check below depend on timing. The law never scales down while
        # a replica starts, so the decision stands.
        wait_for(lambda: decided_engines(APP) == 2, timeout_s=90, interval_s=0.5, what="a scale-up decision")
        stop.set()
        for w in workers:
            w.join(timeout=180)
        assert not any(w.is_alive() for w in workers), "a load request never finished"
        # The bound is generous (engine start on a loaded 2-core machine); wait_for raises past it.
        wait_for(lambda: running_engines(APP) == 2, timeout_s=150, interval_s=1.0, what="a second engine replica")

        # The new replica prefilled the hot prefix before taking traffic, so its very first
        # request of the hot group is served from cache.
        served_by_new = None
        for i in range(12):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": f"{hot} after{i}", "max_tokens": 1})
            assert r.status_code == 200, r.text
            if r.headers["x-kvtide-replica"] != first_replica:
                served_by_new = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                break
        assert served_by_new is not None, "no hot-group request reached the new replica"
        assert served_by_new >= 512, f"the new replica's first hot request had {served_by_new} cached tokens"
        wait_for(lambda: metric_sum(cluster.metrics_url, "ray_kvtide_engine_warmup_prefill_tokens_total",
                                    model=MODEL) > 0, timeout_s=60, what="the warm-up prefill counter")

        wait_for(lambda: running_engines(APP) == 1, timeout_s=120, interval_s=1.0, what="scale back down to min")
    finally:
        stop.set()
        serve.delete(APP)
