"""Direct mode's routing peer without Serve: its answer carries the router's prediction to the replica.

`RouterPeer.route` is driven with a stand-in `self` whose engine handle runs the real
PrefixAwareRouter on the RoutingKey, as Ray's `choose_replica(key, _reserve=False)` does in
the peer's process; no Ray instance is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from types import SimpleNamespace

import pytest

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from fakes import FakeTokenizer, settle_digest_slices

from kvtide.config import parse_config
from kvtide.deployments.frontend.auth import ApiKeys
from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
from kvtide.deployments.internal_auth import CONSULT_HEADER, ROUTE_SIGNATURE_HEADER, consult_token
from kvtide.deployments.messages import RoutingKey
from kvtide.deployments.frontend.prompt_pool import PromptPool
from kvtide.deployments.frontend.prompts import ROUTED_TOKENS_HEADER, PromptBuilder, decode_token_ids
from kvtide.deployments.frontend.routing_key import ROUTED_HASHES_HEADER, PromptRouting, decode_block_hashes
from kvtide.deployments.routing.ray_router import PrefixAwareRouter
from kvtide.deployments.router_peer import HEADER_HEADROOM_BYTES, RouterPeer, route_app, route_headers
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.messages import KVTIDE_PATH, VLLM_LAYER_PATH
from kvtide.deployments.frontend.vllm_layer import PATH_HEADER
from kvtide.deployments.routing.snapshot import CacheDigest
from kvtide.deployments.routing.trust import (
    PREDICTED_CACHED_TOKENS_HEADER,
    Prediction,
    decode_prediction_header,
    write_prediction,
)

SECRET = b"k" * 32
CONFIG = parse_config({"model": "/m", "served_model_name": "m", "engine": {"max_model_len": 64}})
BS = CONFIG.engine.block_size
DEPLOYMENT = DeploymentID(name="Engine", app_name="app")
BODY = json.dumps({"model": "m", "prompt": "y" * 40, "max_tokens": 1}).encode()  # 41 tokens: 2 full blocks


class FakeReplica:
    """The attributes of a RunningReplica the router and the peer read."""

    def __init__(self, unique_id: str, routing_stats: dict | None = None):
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.routing_stats = routing_stats or {}
        self.max_ongoing_requests = 100


class RouterHandle:
    """`choose_replica(key, _reserve=False)` as Ray runs it: the deployment's router ranks, the first is taken."""

    def __init__(self, router: PrefixAwareRouter, replicas: list[FakeReplica]):
        self.router, self.replicas = router, replicas

    @contextlib.asynccontextmanager
    async def choose_replica(self, key: RoutingKey, _reserve: bool = True):
        ranks = await self.router.choose_replicas(self.replicas, PendingRequest(args=[key], kwargs={}, metadata=None))
        yield SimpleNamespace(_replica=ranks[0][0])


def _stand_in_peer(prompts, router, replicas, *, pool=None, buffer_bytes=CONFIG.http.router_buffer_bytes,
                   keys=(), tokenize_timeout_s=CONFIG.http.router_tokenize_timeout_s):
    """A RouterPeer without Serve (its constructor loads a tokenizer from disk and the cluster secret), its
    engine handle running `router` over `replicas`."""
    peer = RouterPeer.__new__(RouterPeer)
    peer.__dict__.update(prompts=prompts, prompt_pool=pool, block_size=BS, buffer_bytes=buffer_bytes,
                         routing=PromptRouting(CONFIG, prompts.tokenizer, HotPrefixTracker(BS)),
                         engine=RouterHandle(router, replicas), secret=SECRET, api_keys=ApiKeys(keys),
                         isolate_caches=True, tokenize_timeout_s=tokenize_timeout_s, vllm_answers_all=False)
    return peer


def _one_replica_router() -> tuple[PrefixAwareRouter, list[FakeReplica]]:
    """A prefix-aware router over one replica, "a", with no digest."""
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BS, seed=0)
    replicas = [FakeReplica("a")]
    router.update_replicas(replicas)
    return router, replicas


@pytest.mark.parametrize("threads", [0, 2], ids=["on-the-loop", "tokenize-threads"])
def test_the_peer_answers_with_the_routers_prediction_for_its_pick(threads):
    """route(): the replica the router picked, the token ids with their block hashes, and a prediction header
    naming it with its cached prompt tokens (the same whether the peer tokenizes on its event loop or in its
    PromptPool's threads)."""
    prompts = PromptBuilder(CONFIG, FakeTokenizer())
    pool = PromptPool([PromptBuilder(CONFIG, FakeTokenizer()) for _ in range(threads)]) if threads else None
    token_ids = prompts.routing_prompt(BODY).token_ids
    hashes = block_hashes(token_ids, BS)

    async def scenario():
        router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(block_size=BS, seed=0)
        digest = CacheDigest.from_hashes("engine-b", 1, 1, hashes)
        replicas = [FakeReplica("a"), FakeReplica("b", {"digest": digest, "reported_s": 1.0})]
        router.update_replicas(replicas)
        await settle_digest_slices(router)  # the digest's slices run on the next loop turns
        return await RouterPeer.route(_stand_in_peer(prompts, router, replicas, pool=pool), BODY)

    answer = asyncio.run(scenario())
    assert answer["replica_id"].endswith("#b")
    headers = answer["request_headers"]
    assert set(headers) == {PATH_HEADER, ROUTED_TOKENS_HEADER, ROUTED_HASHES_HEADER, PREDICTED_CACHED_TOKENS_HEADER,
                            ROUTE_SIGNATURE_HEADER}
    assert headers[PATH_HEADER] == KVTIDE_PATH
    assert decode_block_hashes(headers[ROUTED_HASHES_HEADER], len(token_ids), BS) == tuple(hashes)
    # "a" holds none of the prompt: all of b's cached tokens are b's alone.
    assert decode_prediction_header(headers[PREDICTED_CACHED_TOKENS_HEADER]) == Prediction("b", 2 * BS, 2 * BS)


def test_route_headers_add_the_prediction_only_when_the_router_wrote_one():
    """A baseline router writes nothing: the answer then carries the token ids alone."""
    prompts = PromptBuilder(CONFIG, FakeTokenizer())
    key = RoutingKey()
    assert set(route_headers(prompts, [1, 2, 3], key, ROOM)) == {PATH_HEADER, ROUTED_TOKENS_HEADER}
    write_prediction(key.decision, "b", 0)
    headers = route_headers(prompts, [1, 2, 3], key, ROOM)
    assert decode_prediction_header(headers[PREDICTED_CACHED_TOKENS_HEADER]) == Prediction("b", 0)


ROOM = 1 << 20


def test_route_headers_leave_out_the_token_ids_where_haproxys_buffer_has_no_room_for_them():
    """Token ids and hashes that would not fit beside the body in HAProxy's buffer are left out (the replica
    tokenizes and hashes); the prediction still goes."""
    prompts = PromptBuilder(CONFIG, FakeTokenizer())
    ids = list(range(1, 301))
    key = RoutingKey(block_hashes=tuple(block_hashes(ids, BS)))
    write_prediction(key.decision, "b", 0)
    size = sum(len(k) + len(v) + 4 for k, v in prompts.routed_tokens_header(ids, key.block_hashes).items())
    assert set(route_headers(prompts, ids, key, size)) == {
        PATH_HEADER, ROUTED_TOKENS_HEADER, ROUTED_HASHES_HEADER, PREDICTED_CACHED_TOKENS_HEADER}
    assert set(route_headers(prompts, ids, key, size - 1)) == {PATH_HEADER, PREDICTED_CACHED_TOKENS_HEADER}


TOOLS_BODY = json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "y" * 40}],
                         "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}).encode()


@pytest.mark.parametrize("body, answers_all, path", [
    (BODY, False, KVTIDE_PATH),
    (TOOLS_BODY, False, VLLM_LAYER_PATH),  # tools: vLLM's layer renders and answers it
    (BODY, True, VLLM_LAYER_PATH),         # a serving option that makes vLLM's layer answer every request
])
def test_the_peer_decides_the_path_and_sends_token_ids_only_where_that_path_reads_them(body, answers_all, path):
    """route(): the path header says which path serves the request (the one decision, vllm_layer.request_path);
    a request for vLLM's layer carries no token ids or hashes (it renders its own prompt), only the path and the
    router's prediction, all under the signature."""
    prompts = PromptBuilder(CONFIG, FakeTokenizer())

    async def scenario():
        router, replicas = _one_replica_router()
        peer = _stand_in_peer(prompts, router, replicas)
        peer.vllm_answers_all = answers_all
        return await RouterPeer.route(peer, body)

    headers = asyncio.run(scenario())["request_headers"]
    assert headers[PATH_HEADER] == path and ROUTE_SIGNATURE_HEADER in headers
    assert PREDICTED_CACHED_TOKENS_HEADER in headers
    assert (ROUTED_TOKENS_HEADER in headers) == (path == KVTIDE_PATH)
    assert (ROUTED_HASHES_HEADER in headers) == (path == KVTIDE_PATH)


def test_the_peer_sends_no_token_ids_for_a_body_that_fills_haproxys_buffer():
    """route(): a body within HEADER_HEADROOM_BYTES of http.router_buffer_bytes is answered without token ids."""
    prompts = PromptBuilder(CONFIG, FakeTokenizer())

    async def scenario(buffer_bytes):
        router, replicas = _one_replica_router()
        return await RouterPeer.route(_stand_in_peer(prompts, router, replicas, buffer_bytes=buffer_bytes), BODY)

    assert ROUTED_TOKENS_HEADER in asyncio.run(scenario(HEADER_HEADROOM_BYTES + len(BODY) + 1024))["request_headers"]
    assert ROUTED_TOKENS_HEADER not in asyncio.run(scenario(HEADER_HEADROOM_BYTES + len(BODY)))["request_headers"]


def _call_app(app, scope: dict, messages: list[dict]) -> list[dict]:
    """Drive an ASGI app with `messages` to receive; what it sent."""
    sent, pending = [], list(messages)

    async def receive():
        return pending.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_the_peer_app_answers_a_post_of_the_route_with_the_routes_json_and_its_length():
    """POST /internal/route: the body (in chunks) and the session header reach route(); 200 JSON with content-length."""
    seen = []

    async def route(body: bytes, session: str | None, authorization: str | None) -> dict:
        seen.append((body, session, authorization))
        return {"replica_id": "SERVE_REPLICA::app#Engine#a", "request_headers": {"x-k": "v"}}

    scope = {"type": "http", "method": "POST", "path": "/internal/route",
             "headers": [(b"content-type", b"application/json"), (b"x-session-id", b"user-7"),
                         (b"authorization", b"Bearer k1"), (CONSULT_HEADER.encode(), consult_token(SECRET).encode())]}
    start, body = _call_app(route_app(route, SECRET, 1024), scope, [
        {"type": "http.request", "body": b'{"a":', "more_body": True}, {"type": "http.request", "body": b"1}"}])
    assert seen == [(b'{"a":1}', "user-7", "Bearer k1")]
    assert start["status"] == 200 and (b"content-length", str(len(body["body"])).encode()) in start["headers"]
    assert json.loads(body["body"]) == {"replica_id": "SERVE_REPLICA::app#Engine#a", "request_headers": {"x-k": "v"}}


def test_the_peer_app_refuses_other_paths_and_completes_its_lifespan():
    """A GET or another path is a 404 JSON without calling route(); Serve's lifespan startup/shutdown complete."""
    async def route(body: bytes, session: str | None, authorization: str | None) -> dict:
        raise AssertionError("route() must not run")

    app = route_app(route, SECRET, 1024)
    start, body = _call_app(app, {"type": "http", "method": "GET", "path": "/internal/route", "headers": []}, [])
    assert start["status"] == 404 and "POST /internal/route" in json.loads(body["body"])["error"]
    sent = _call_app(app, {"type": "lifespan"}, [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_the_prompt_pool_runs_a_burst_side_by_side_each_call_with_a_builder_of_its_own():
    """Two calls meet inside fn at once (a barrier no single thread could pass), off the loop, on distinct builders."""
    builders = [PromptBuilder(CONFIG, FakeTokenizer()) for _ in range(2)]
    barrier = threading.Barrier(2, timeout=30)

    def fn(builder):
        barrier.wait()  # both calls must be running at the same time to pass
        return builder, threading.get_ident()

    loop_thread, results = asyncio.run(_two_calls(PromptPool(builders), fn))
    assert {id(b) for b, _ in results} == {id(b) for b in builders}
    assert loop_thread not in {t for _, t in results}


async def _two_calls(pool, fn):
    return threading.get_ident(), await asyncio.gather(pool.run(fn), pool.run(fn))


def test_the_prompt_pool_follows_the_config_with_tokenizer_copies_or_none():
    """router_tokenize_threads 0 → no pool (tokenize on the loop); 3 → three builders, each with its own tokenizer."""
    tokenizer = FakeTokenizer()
    assert PromptPool.for_config(CONFIG.model_copy(update={"http": CONFIG.http.model_copy(
        update={"router_tokenize_threads": 0})}), tokenizer) is None
    pool = PromptPool.for_config(CONFIG.model_copy(update={"http": CONFIG.http.model_copy(
        update={"router_tokenize_threads": 3})}), tokenizer)
    tokenizers = [pool._free.get_nowait().tokenizer for _ in range(3)]
    assert len({id(t) for t in tokenizers} | {id(tokenizer)}) == 4


def test_the_peer_deployment_logs_no_access_line_per_consult():
    """The routing peer's Serve options turn its access log off (one line per client POST, flushed on its loop)."""
    from ray import serve

    from kvtide.cluster.app import router_peer_options
    from kvtide.deployments.router_peer import RouterPeer

    deployment = serve.deployment(RouterPeer).options(**router_peer_options(CONFIG))
    assert deployment._deployment_config.logging_config["enable_access_log"] is False


def test_the_peer_still_picks_a_replica_when_its_routing_headers_fail(monkeypatch):
    """route(): headers that cannot be built (a bug on some input) leave the answer without them, with its pick:
    HAProxy would answer the client a bare 503 for a failed consult."""
    import kvtide.deployments.router_peer as router_peer

    def broken(*args, **kwargs):
        raise TypeError("unpackable token id")

    monkeypatch.setattr(router_peer, "route_headers", broken)
    prompts = PromptBuilder(CONFIG, FakeTokenizer())

    async def scenario():
        router, replicas = _one_replica_router()
        return await RouterPeer.route(_stand_in_peer(prompts, router, replicas), BODY)

    answer = asyncio.run(scenario())
    assert answer["replica_id"].endswith("#a") and answer["request_headers"] == {}



def test_a_body_routed_without_a_prompt_keeps_its_session_on_one_replica():
    """A body the peer cannot read a prompt from (a Responses API request) with an x-session-id header: each turn
    goes to the replica of the session's last one; without the header the load-only picks spread. (Four turns:
    with no engine report, each pick counts as a request in flight, and the load guard would move the fifth.)"""
    body = json.dumps({"model": "m", "input": "hello", "max_output_tokens": 4}).encode()
    prompts = PromptBuilder(CONFIG, FakeTokenizer())
    assert prompts.routing_prompt(body) is None

    async def picks(session: str | None) -> set[str]:
        router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(block_size=BS, seed=0)
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router.update_replicas(replicas)
        peer = _stand_in_peer(prompts, router, replicas)
        return {(await RouterPeer.route(peer, body, session))["replica_id"] for _ in range(4)}

    assert len(asyncio.run(picks("conversation-1"))) == 1
    assert len(asyncio.run(picks(None))) == 2


def test_a_keyless_consult_costs_the_peer_under_a_millisecond():
    """With keys on, a keyless request carrying a looping chat template costs the peer one load-only pick: the
    median of 200 consults through the real prefix-aware router stays under 1 ms (nothing parsed or rendered)."""
    import time

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
                       "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}}).encode()
    prompts = PromptBuilder(CONFIG, FakeTokenizer())

    async def scenario():
        router, replicas = _one_replica_router()
        peer = _stand_in_peer(prompts, router, replicas, keys=("sk-a",))
        costs = []
        for _ in range(200):
            started = time.perf_counter()
            answer = await RouterPeer.route(peer, body, None, None)
            costs.append(time.perf_counter() - started)
            assert answer["request_headers"] == {}
        return sorted(costs)[len(costs) // 2]

    assert asyncio.run(scenario()) < 1e-3


def test_a_chat_vllms_renderer_rendered_in_the_peer_travels_as_its_token_ids_to_vllms_layer():
    """With vLLM's renderer in the peer (serving.peer_renders_chat), a tools chat routes on the ids it rendered and
    they go signed to the replica, without hashes (vLLM hashes its own blocks); without it, no ids go."""
    rendered = list(range(10, 50))

    class StandInRender:  # vLLM's renderer itself is tested in test_vllm_render.py
        def prompt_ids(self, data):
            return rendered if data.get("tools") else None

    async def scenario(render):
        prompts = PromptBuilder(CONFIG, FakeTokenizer())
        prompts.vllm_render = render
        router, replicas = _one_replica_router()
        return await RouterPeer.route(_stand_in_peer(prompts, router, replicas), TOOLS_BODY)

    headers = asyncio.run(scenario(StandInRender()))["request_headers"]
    assert headers[PATH_HEADER] == VLLM_LAYER_PATH and ROUTE_SIGNATURE_HEADER in headers
    assert decode_token_ids(headers[ROUTED_TOKENS_HEADER]) == rendered and ROUTED_HASHES_HEADER not in headers
    assert ROUTED_TOKENS_HEADER not in asyncio.run(scenario(None))["request_headers"]
