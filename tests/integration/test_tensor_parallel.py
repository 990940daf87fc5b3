"""A tensor-parallel (TP=2) engine on CPU serves requests, in the same Ray cluster."""

from __future__ import annotations

import httpx
from ray import serve

from kvtide.cluster.app import build_from_config
from kvtide.config import load_config
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TP_APP = "kvtide-tp2"


def test_tp2_engine_on_cpu_serves_a_request(cluster, cluster_config):
    """An engine split over two CPU workers (one core each) answers a completion correctly."""
    config = load_config(REPO / "config/presets/cpu.yaml", [
        "engine.tensor_parallel_size=2", "replicas.num_replicas=1",
        f"http.port={cluster_config.http.port}", f"metrics.port={cluster_config.metrics.port}",
        "served_model_name=kvtide-demo-tp2",
    ])
    serve.run(build_from_config(config), name=TP_APP, route_prefix="/tp2", blocking=False)
    try:
        status = serve.status().applications[TP_APP]
        engine = status.deployments["Engine"]
        assert engine.replica_states.get("RUNNING") == 1
        resp = httpx.post(cluster.base_url + "/tp2/v1/completions", timeout=120, json={
            "model": "kvtide-demo-tp2", "prompt": "def tensor_parallel():", "max_tokens": 8, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]
    finally:
        serve.delete(TP_APP)
