"""cluster.local.stop() after a start that a signal interrupted."""

from __future__ import annotations

import ray
from ray import serve

from kvtide.cluster import local


def test_stop_without_a_ray_connection_starts_no_new_ray(monkeypatch):
    """Not connected to Ray (an interrupted start): stop skips serve.shutdown, which would start a fresh Ray."""
    calls: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    local.stop(drain_timeout_s=1.0)
    assert calls == ["ray.shutdown"]
