"""Stored responses (serving.responses_store): ids that name their replica, and every router pinning a
request that names one to that replica (routing/response_pins.py, engine/response_ids.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest

from test_baseline_routers import FakeReplica, new_ray_prefix

from kvtide.deployments.engine.response_ids import tagging_app, with_response_id
from kvtide.deployments.messages import RoutingKey, VllmLayerCall
from kvtide.deployments.routing.ray_baselines import Pow2Router
from kvtide.deployments.routing.ray_router import PrefixAwareRouter, RoundRobinRouter
from kvtide.deployments.routing.response_pins import (owner_of, previous_response_owner, response_owner,
                                                      tagged_response_id)

DEPLOYMENT = DeploymentID(name="Engine", app_name="app")


# ---- ids ----------------------------------------------------------------------------------

def test_a_tagged_id_names_its_replica_and_looks_like_vllms():
    """resp_<replica>-<uuid hex>: the replica is read back; the id keeps vLLM's `resp_` prefix."""
    response_id = tagged_response_id("ab12cd34")
    assert response_id.startswith("resp_ab12cd34-") and len(response_id) == len("resp_ab12cd34-") + 32
    assert owner_of(response_id) == "ab12cd34"
    assert tagged_response_id("ab12cd34") != response_id  # unique per response


@pytest.mark.parametrize("response_id", [
    "resp_b627def8b0a05003",  # vLLM's own id (16 hex)
    "my-conversation-7", "resp_AB12-0123456789abcdef0123456789abcdef", "resp_x-123", "", None, 7, ["resp_a"],
    "resp_ab12cd34-0123456789abcdef0123456789abcdef/../x",
])
def test_ids_kvtide_did_not_make_name_no_replica(response_id):
    """vLLM's ids, a client's, junk of any JSON type: no replica (routed as any other request)."""
    assert owner_of(response_id) is None


def test_the_replica_a_request_must_reach_is_read_from_its_path_or_previous_response_id():
    """GET /v1/responses/{id}, its /cancel, and a POST continuing a response (even cut short, as the routing peer may
    get it) name its replica; nothing else does, a key quoted inside a string included."""
    rid = tagged_response_id("r1")
    assert response_owner(f"/v1/responses/{rid}", b"") == "r1"
    assert response_owner(f"/v1/responses/{rid}/cancel", b"") == "r1"
    assert response_owner("/v1/responses", json.dumps({"input": "hi", "previous_response_id": rid}).encode()) == "r1"
    assert response_owner("/v1/responses", json.dumps({"input": rid}).encode()) is None
    assert response_owner("/v1/responses", b'{"previous_response_id": ') is None  # not JSON: vLLM's 400
    cut = json.dumps({"previous_response_id": rid, "input": "x" * 1000}).encode()[:200]  # the peer's view of a long body
    assert response_owner("/v1/responses", cut) == "r1"
    quoted = json.dumps({"input": json.dumps({"previous_response_id": rid})}).encode()  # the key inside a string
    assert response_owner("/v1/responses", quoted) is None
    assert response_owner("/v1/responses", b'["previous_response_id"]') is None
    assert response_owner("/v1/chat/completions", json.dumps({"previous_response_id": rid}).encode()) is None
    assert response_owner(f"/v1/responses/{rid}/input_items", b"") is None
    assert previous_response_owner(json.dumps({"previous_response_id": rid}).encode()) == "r1"


def test_a_new_response_gets_an_id_naming_the_replica_unless_the_client_named_one():
    """The body's request_id (vLLM's response id) is set when absent; a client's is kept; junk is vLLM's to refuse."""
    tagged = json.loads(with_response_id(b'{"input": "hi", "model": "m"}', "r9"))
    assert owner_of(tagged["request_id"]) == "r9" and tagged["input"] == "hi"
    assert with_response_id(b'{"input": "hi", "request_id": "mine"}', "r9") == b'{"input": "hi", "request_id": "mine"}'
    assert with_response_id(b'{"input": ', "r9") == b'{"input": '
    assert with_response_id(b'[1, 2]', "r9") == b'[1, 2]'


def _run_tagged(method: str, path: str, body: bytes) -> tuple[dict, bytes]:
    seen = {}

    async def app(scope, receive, send):
        message = await receive()
        seen.update(scope=scope, body=message["body"])

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]}
    asyncio.run(tagging_app(app, "r5")(scope, receive, send))
    return seen["scope"], seen["body"]


def test_the_replicas_vllm_layer_sees_new_responses_with_its_id_and_other_requests_unchanged():
    """POST /v1/responses reaches vLLM with a tagged request_id (content-length to match); other calls as sent."""
    scope, body = _run_tagged("POST", "/v1/responses", b'{"input": "hi"}')
    assert owner_of(json.loads(body)["request_id"]) == "r5"
    assert dict(scope["headers"])[b"content-length"] == str(len(body)).encode()
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/responses/resp_x"),
                         ("POST", "/v1/responses/resp_x/cancel")):
        assert _run_tagged(method, path, b'{"input": "hi"}')[1] == b'{"input": "hi"}'


# ---- routers ------------------------------------------------------------------------------

def _prefix_aware():
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=16, seed=0)
    return router


def _round_robin():
    router = RoundRobinRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    return router


def _pow2():
    router = Pow2Router(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    return router


def _first_picks(router, replicas, arg, n: int = 12) -> set[str]:
    async def run():
        router.update_replicas(replicas)
        picked = set()
        for _ in range(n):
            ranks = await router.choose_replicas(replicas, PendingRequest(
                args=[arg], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="r")))
            picked.add(ranks[0][0].replica_id.unique_id)
        return picked
    return asyncio.run(run())


@pytest.mark.parametrize("new_router", [_prefix_aware, _round_robin, _pow2], ids=["prefix_aware", "round_robin", "pow2"])
@pytest.mark.parametrize("arg", [RoutingKey(pinned_replica="b"), VllmLayerCall("/v1/responses", (), b"", pinned_replica="b")],
                         ids=["pick_only", "vllm_layer_call"])
def test_every_router_sends_a_pinned_request_to_the_replica_holding_its_response(new_router, arg):
    """Whatever the policy (and however loaded the replica), a request naming a stored response goes to its replica."""
    replicas = [FakeReplica("a"), FakeReplica("b", running=50), FakeReplica("c")]
    assert _first_picks(new_router(), replicas, arg) == {"b"}


@pytest.mark.parametrize("new_router", [_prefix_aware, _round_robin, _pow2], ids=["prefix_aware", "round_robin", "pow2"])
def test_a_pin_to_a_replica_that_is_gone_is_routed_by_the_policy(new_router):
    """The replica (and its store) went away: the request is routed as any other, never dropped."""
    replicas = [FakeReplica("a"), FakeReplica("c")]
    assert _first_picks(new_router(), replicas, RoutingKey(pinned_replica="gone")) <= {"a", "c"}


@pytest.mark.parametrize("new_router", [_prefix_aware, _round_robin, _pow2], ids=["prefix_aware", "round_robin", "pow2"])
def test_a_pin_to_a_standby_is_routed_by_the_policy_among_the_serving_replicas(new_router):
    """A replica set aside as a standby serves nothing (a sleeping engine answers no request): the pin lapses."""
    standby = FakeReplica("b")
    standby.routing_stats["standby"] = True
    replicas = [FakeReplica("a"), standby, FakeReplica("c")]
    assert _first_picks(new_router(), replicas, RoutingKey(pinned_replica="b")) <= {"a", "c"}


def test_the_ray_prefix_baseline_honours_pins_too(monkeypatch):
    """Ray Serve LLM's prefix router, as kvtide runs it, keeps the pin as well."""
    replicas = [FakeReplica("a"), FakeReplica("b", running=50)]
    assert _first_picks(new_ray_prefix(monkeypatch), replicas, RoutingKey(pinned_replica="b")) == {"b"}


# ---- where a request naming a response is answered ----------------------------------------

def _recording_layer(name: str, log: list):
    """A stand-in vLLM layer that records which one answered, with the path and body it was handed."""
    async def app(scope, receive, send):
        body = (await receive())["body"]
        log.append((name, scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})
    return app


def test_direct_mode_answers_a_request_naming_another_replicas_response_there():
    """A GET, cancel or continuation naming a response of replica r2 goes on to it (owner_vllm_app); one of
    this replica's, vLLM's own id, or a plain request is answered here."""
    from fakes import FakeTokenizer
    from fastapi.testclient import TestClient
    from test_frontend import CONFIG, FakeMetrics, _local_engine

    from kvtide.deployments.frontend.app import build_openai_app
    from kvtide.deployments.frontend.auth import ApiKeys
    from kvtide.deployments.frontend.pipeline import OpenAIFrontend
    from kvtide.deployments.frontend.prompts import PromptBuilder

    log: list = []
    frontend = OpenAIFrontend(CONFIG, PromptBuilder(CONFIG, FakeTokenizer()), _local_engine(), FakeMetrics(), None)
    frontend.replica_id = "r1"
    frontend.vllm_app, frontend.owner_vllm_app = _recording_layer("here", log), _recording_layer("owner", log)

    async def ready() -> bool:
        return True

    client = TestClient(build_openai_app(frontend, ApiKeys([]), ready))
    theirs, mine = tagged_response_id("r2"), tagged_response_id("r1")
    assert client.get(f"/v1/responses/{theirs}").status_code == 200
    assert client.post(f"/v1/responses/{theirs}/cancel").status_code == 200
    assert client.post("/v1/responses", json={"model": "m", "input": "hi", "previous_response_id": theirs}).status_code == 200
    client.get(f"/v1/responses/{mine}")
    client.get("/v1/responses/resp_0123456789abcdef0123456789abcdef")
    client.post("/v1/responses", json={"model": "m", "input": "hi"})
    assert [name for name, _, _ in log] == ["owner", "owner", "owner", "here", "here", "here"]
    assert log[0][1] == f"/v1/responses/{theirs}"


def test_ingress_mode_pins_a_vllm_layer_call_naming_a_response_to_its_replica():
    """The call an ingress sends an engine carries the replica of the response its path or body names."""
    from fakes import DEFAULT_LIMITS, RecordingEngineHandle

    from kvtide.deployments.frontend.vllm_layer import HandleVllmApp

    handle = RecordingEngineHandle()

    async def send(message):
        pass

    rid = tagged_response_id("r7")
    for method, path, body in (("GET", f"/v1/responses/{rid}", b""), ("POST", f"/v1/responses/{rid}/cancel", b""),
                               ("POST", "/v1/responses", json.dumps({"previous_response_id": rid}).encode()),
                               ("POST", "/v1/responses", b'{"input": "hi"}')):
        async def receive(body=body):
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": []}
        asyncio.run(HandleVllmApp(handle, lambda body: {}, DEFAULT_LIMITS)(scope, receive, send))
    assert [c.pinned_replica for c in handle.calls] == ["r7", "r7", "r7", None]
