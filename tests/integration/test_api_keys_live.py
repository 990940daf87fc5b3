"""API keys on a real cluster: 401 without or with a wrong key, 200 with the right one, the key never in a log;
two keys are two tenants that cannot reach each other's requests, stored responses or cached prefixes; nobody
reaches the routing peer or a replica's own port around HAProxy."""

from __future__ import annotations

import glob
import os
import re
import secrets
import threading
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from kvtide.cluster.app import build_from_config
from kvtide.config import load_config

REPO = Path(__file__).resolve().parents[2]
AUTH_APP = "kvtide-auth"


TENANT_B_KEY = "sk-kvtide-tenant-b-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def auth_app(cluster, cluster_config, tmp_path_factory):
    """A second app at /kvtide-auth whose ingress reads two API keys from a file, tenant-a's (yielded) and
    tenant-b's (TENANT_B_KEY); one engine replica, with vLLM's tokens-in API and the Responses store on."""
    key = "sk-kvtide-test-" + secrets.token_hex(16)
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# test keys\ntenant-a {key}\ntenant-b {TENANT_B_KEY}\n")
    config = load_config(REPO / "config/presets/cpu.yaml", [
        "replicas.num_replicas=1", "frontend.num_replicas=1", f"served_model_name={AUTH_APP}",
        f"http.port={cluster_config.http.port}", f"metrics.port={cluster_config.metrics.port}",
        f"frontend.auth.api_keys_file={key_file}", "frontend.auth.require_keys=true",
        "serving.enable_scale_out=true", "serving.responses_store=true"])
    serve.run(build_from_config(config), name=AUTH_APP, route_prefix=f"/{AUTH_APP}", blocking=False)
    try:
        yield cluster.base_url + f"/{AUTH_APP}", key
    finally:
        serve.delete(AUTH_APP)


def _client(base: str, key: str | None) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=120, headers={"Authorization": f"Bearer {key}"} if key else {})


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


# A template whose render would run for hours: rendered anywhere before the key check, the request would hang.
LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"


def test_a_keyless_request_with_its_own_template_is_refused_without_rendering_it(auth_app):
    """A keyless chat carrying a looping chat_template (in chat_template_kwargs) gets its 401 at once: the routing
    peer checks the key before it parses or renders anything (rendered, it would not answer for hours)."""
    base, _ = auth_app
    chat = {"model": AUTH_APP, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"chat_template": LOOPING_TEMPLATE}, "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    with _client(base, None) as http:
        for _ in range(8):  # more than the peer has tokenize threads: none of them is held
            started = time.monotonic()
            _error(http.post("/v1/chat/completions", json=chat), 401)
            assert time.monotonic() - started < 30
    with _client(base, auth_app[1]) as http:  # with a key the template is vLLM's to refuse (400), not rendered
        started = time.monotonic()
        assert http.post("/v1/chat/completions", json=chat).status_code == 400
        assert time.monotonic() - started < 30


def test_a_second_tenant_cannot_abort_the_first_ones_request(auth_app):
    """tenant-b's abort naming tenant-a's running request (as vLLM's engine knows it) stops nothing and is answered
    as an abort of an unknown id; tenant-a's own abort of a request stops it."""
    from support import _abort_try, generated_until_aborted

    base, key = auth_app
    max_tokens = 600
    with _client(base, key) as a, _client(base, TENANT_B_KEY) as b:
        unknown = b.post("/inference/v1/abort_requests", json={"request_ids": ["no-such-request"]})
        crossed = b.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-shared-id"]})
        assert (crossed.status_code, crossed.content) == (unknown.status_code, unknown.content)
        tokens, reasons = _abort_try(a, AUTH_APP, "shared-id", max_tokens, abort_client=b)
        assert tokens == max_tokens and "length" in reasons, (tokens, reasons)
        tokens, reasons = generated_until_aborted(a, AUTH_APP, "own-abort", 4000)
        assert tokens < 4000 and "abort" in reasons


def test_a_second_tenant_cannot_read_cancel_or_continue_the_first_ones_stored_response(auth_app):
    """GET, cancel and previous_response_id of tenant-a's stored response from tenant-b answer 404 as for an
    unknown id; tenant-a reads and continues its own."""
    base, key = auth_app
    with _client(base, key) as a, _client(base, TENANT_B_KEY) as b:
        made = a.post("/v1/responses", json={"model": AUTH_APP, "input": "hello", "max_output_tokens": 4})
        assert made.status_code == 200, made.text
        response_id = made.json()["id"]
        assert a.get(f"/v1/responses/{response_id}").status_code == 200
        unknown = b.get("/v1/responses/resp_nosuchresponse").status_code
        assert unknown == 404
        assert b.get(f"/v1/responses/{response_id}").status_code == unknown
        assert b.post(f"/v1/responses/{response_id}/cancel").status_code == unknown
        follow = {"model": AUTH_APP, "input": "more", "max_output_tokens": 4, "previous_response_id": response_id}
        assert b.post("/v1/responses", json=follow).status_code == 404
        assert a.post("/v1/responses", json=follow).status_code == 200


def test_cached_prefixes_do_not_cross_tenants(auth_app):
    """A prompt tenant-a sent is cached for tenant-a's next request, but tenant-b's identical request reuses none
    of it (cached_tokens 0): no tenant learns another's prompts from the cache."""
    base, key = auth_app
    prompt = "tenant cache probe " + secrets.token_hex(8) + " " + "lorem ipsum " * 40
    body = {"model": AUTH_APP, "prompt": prompt, "max_tokens": 1}

    def cached(client: httpx.Client) -> int:
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return (resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    with _client(base, key) as a, _client(base, TENANT_B_KEY) as b:
        assert cached(a) == 0
        assert cached(a) > 0
        assert cached(b) == 0
        assert cached(b) > 0  # tenant-b's own second request hits its own blocks


def _haproxy_dir() -> Path:
    """This cluster's node's HAProxy files (Ray writes them per node id)."""
    import ray

    return Path("/tmp/haproxy-serve") / ray.get_runtime_context().get_node_id()


def _haproxy_configs() -> list[str]:
    return [(_haproxy_dir() / "haproxy.cfg").read_text()]


def test_the_routers_headers_sent_straight_to_a_replica_port_are_ignored(auth_app):
    """A keyed request sent to the engine replica's own port (around HAProxy) with forged routed token ids is served
    on its own prompt: without the routing peer's signature the header is not used."""
    from kvtide.deployments.frontend.prompts import ROUTED_TOKENS_HEADER, encode_token_ids

    base, key = auth_app
    body = {"model": AUTH_APP, "prompt": "hi", "max_tokens": 1}
    with _client(base, key) as a:
        honest = a.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"]
    servers = {m for cfg in _haproxy_configs() for m in re.findall(r"server \S+ ([0-9.]+:[0-9]+)", cfg)}
    forged = {ROUTED_TOKENS_HEADER: encode_token_ids(list(range(5, 90))), "Authorization": f"Bearer {key}"}
    served = []
    for server in sorted(servers):  # every replica's own port (the app's route prefix, as HAProxy sends it)
        try:
            resp = httpx.post(f"http://{server}/{AUTH_APP}/v1/completions", json=body, headers=forged, timeout=60)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200 and resp.json().get("model") == AUTH_APP:
            served.append(resp.json()["usage"]["prompt_tokens"])
    assert served and set(served) == {honest}, (served, honest)


def test_the_routing_peer_answers_only_haproxy(auth_app):
    """POST /internal/route without HAProxy's consult token is a 403 (nothing parsed, picked or booked); the live
    HAProxy config carries kvtide's rules (header timeout, the disconnect header dropped, a failed consult as an
    OpenAI-shaped 503 with Retry-After)."""
    lua = list(_haproxy_dir().glob("kvtide-*.lua"))
    assert lua and all(oct(p.stat().st_mode & 0o777) == "0o600" for p in lua)
    routers = {m for p in lua for m in re.findall(r'host = "([0-9.]+)", port = ([0-9]+)', p.read_text())}
    assert routers
    for host, port in routers:
        resp = httpx.post(f"http://{host}:{port}/internal/route", content=b'{"prompt": "hi"}', timeout=30)
        assert resp.status_code == 403, resp.text
    for cfg in _haproxy_configs():
        assert "timeout http-request" in cfg and "del-header x-request-disconnect-disabled" in cfg
        assert "Ingress request router failed" not in cfg and "hdr Retry-After 1" in cfg  # a failed consult: JSON 503
