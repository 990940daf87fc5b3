"""API keys on a real cluster: 401 without or with a wrong key, 200 with the right one, the key never in a log."""

from __future__ import annotations

import glob
import os
import secrets
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from kvtide.cluster.app import build_from_config
from kvtide.config import load_config

REPO = Path(__file__).resolve().parents[2]
AUTH_APP = "kvtide-auth"


@pytest.fixture(scope="module")
def auth_app(cluster, cluster_config, tmp_path_factory):
    """A second app at /kvtide-auth whose ingress reads one API key from a file (one engine replica)."""
    key = "sk-kvtide-test-" + secrets.token_hex(16)
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# test key\n{key}\n")
    config = load_config(REPO / "config/presets/cpu.yaml", [
        "replicas.num_replicas=1", "frontend.num_replicas=1", f"served_model_name={AUTH_APP}",
        f"http.port={cluster_config.http.port}", f"metrics.port={cluster_config.metrics.port}",
        f"frontend.auth.api_keys_file={key_file}", "frontend.auth.require_keys=true"])
    serve.run(build_from_config(config), name=AUTH_APP, route_prefix=f"/{AUTH_APP}", blocking=False)
    try:
        yield cluster.base_url + f"/{AUTH_APP}", key
    finally:
        serve.delete(AUTH_APP)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_missing_and_wrong_keys_are_401_and_the_right_key_is_200(auth_app):
    """No key → 401, wrong or malformed key → 401 (OpenAI body), the configured key → 200, on every API route."""
    base, key = auth_app
    # ignore_eos: the completion count asserted below must not depend on the random model's EOS.
    body = {"model": AUTH_APP, "prompt": "def auth():", "max_tokens": 4, "ignore_eos": True}
    chat = {"model": AUTH_APP, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=base, timeout=120) as http:
        err = _error(http.post("/v1/completions", json=body), 401)
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        for header in (f"Bearer {key}x", "Bearer wrong", f"Basic {key}", key):
            err = _error(http.post("/v1/completions", json=body, headers={"Authorization": header}), 401)
            assert key not in err["message"]
        _error(http.post("/v1/chat/completions", json=chat), 401)
        _error(http.get("/v1/models"), 401)

        auth = {"Authorization": f"Bearer {key}"}
        ok = http.post("/v1/completions", json=body, headers=auth)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
        assert http.post("/v1/chat/completions", json=chat, headers=auth).status_code == 200
        assert http.get("/v1/models", headers=auth).json()["data"][0]["id"] == AUTH_APP
        # Probes stay open.
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200


def test_the_key_never_appears_in_ray_logs(auth_app, cluster):
    """After authenticated and refused requests, no file under Ray's log dirs contains the key."""
    base, key = auth_app
    with httpx.Client(base_url=base, timeout=120) as http:
        http.post("/v1/completions", json={"model": AUTH_APP, "prompt": "x", "max_tokens": 2},
                  headers={"Authorization": f"Bearer {key}"})
        http.post("/v1/completions", json={"model": AUTH_APP, "prompt": "x"}, headers={"Authorization": "Bearer nope"})
    # Every session's logs (this cluster's and any other on the machine): the key is in none.
    log_dirs = [d for d in glob.glob("/tmp/ray/session_*/logs") if os.path.isdir(d)]
    assert log_dirs
    needle = key.encode()
    scanned, hits = 0, []
    started = time.monotonic()
    for log_dir in log_dirs:
        for root, _, files in os.walk(log_dir):
            for name in files:
                path = os.path.join(root, name)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                scanned += 1
                if needle in data:
                    hits.append(path)
    print(f"\nauth: scanned {scanned} log files in {len(log_dirs)} Ray sessions "
          f"in {time.monotonic() - started:.1f} s; files holding the key: {len(hits)}")
    assert scanned > 0 and not hits, hits
