"""vLLM's own chat renderer in the routing peer (deployments/frontend/vllm_render.py) and the hand-over of its ids."""

from __future__ import annotations

import json
import threading

import pytest

from kvtide.config import parse_config
from kvtide.deployments.engine.vllm_openai import build_chat_renderer
from kvtide.deployments.frontend.pipeline import vllm_layer_body
from kvtide.deployments.frontend.prompts import ROUTED_TOKENS_HEADER, encode_token_ids
from kvtide.deployments.frontend.vllm_layer import PATH_HEADER
from kvtide.deployments.frontend.vllm_render import VllmChatRender, eligible_chat, with_prompt_token_ids
from kvtide.deployments.messages import KVTIDE_PATH, VLLM_LAYER_PATH
from kvtide.deployments.tenancy import salted

CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        "tool_choice": "none"}


@pytest.mark.parametrize("change, eligible", [
    ({}, True),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, False),
    ({"messages": [[{"role": "user", "content": "hi"}]]}, False),  # a batch of conversations
    ({"messages": []}, False),
    ({"echo": True}, False),  # vLLM renders to echo the last message
    ({"kv_transfer_params": {"do_remote_prefill": True}}, False),  # the client's own, for vLLM to honour
])
def test_a_chat_is_handed_over_rendered_only_where_vllm_runs_it_on_the_given_ids(change, eligible):
    """eligible_chat: one conversation of text messages, no echo, no kv_transfer_params of the client's own."""
    assert eligible_chat({**CHAT, **change}) is eligible


def _routed(ids, path=VLLM_LAYER_PATH) -> dict[str, str]:
    return {PATH_HEADER: path, ROUTED_TOKENS_HEADER: encode_token_ids(ids)}


@pytest.mark.parametrize("endpoint, data, routed, tag, reused", [
    ("chat", CHAT, _routed([5, 6, 7]), None, True),
    ("chat", CHAT, _routed([5, 6, 7]), "t1", True),  # scoped to the tenant, ids handed over too
    ("chat", CHAT, _routed([5, 6, 7], KVTIDE_PATH), None, False),  # kvtide-path ids are not vLLM's rendering
    ("chat", CHAT, {PATH_HEADER: VLLM_LAYER_PATH}, None, False),  # the peer sent none
    ("chat", {**CHAT, "echo": True}, _routed([5, 6, 7]), None, False),
    ("completions", {"model": "m", "prompt": "hi"}, _routed([5, 6, 7]), None, False),
])
def test_the_replica_hands_vllm_the_peers_ids_only_for_a_chat_the_peer_rendered_for_its_layer(
        endpoint, data, routed, tag, reused):
    """vllm_layer_body: the body scoped to the tenant as before, plus kv_transfer_params.prompt_token_ids where the
    signed headers carry the peer's vLLM rendering for the vLLM-layer path; otherwise the body as it was scoped."""
    body = json.dumps(data).encode()
    out, did = vllm_layer_body(body, data, tag, True, endpoint, routed)
    sent = json.loads(out)
    assert did is reused
    assert (sent.get("kv_transfer_params") == {"prompt_token_ids": [5, 6, 7]}) is reused
    assert sent.get("cache_salt") == (salted(None, tag, True) if tag else None)
    if not reused and tag is None:
        assert out == body  # nothing to change: the very bytes
    assert {k: v for k, v in sent.items() if k not in ("kv_transfer_params", "cache_salt")} == data
    assert with_prompt_token_ids(data, [1])["kv_transfer_params"] == {"prompt_token_ids": [1]}


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> VllmChatRender:
    from kvtide.deployments.engine.demo_model import DemoModelSpec, build_demo_model

    tiny = DemoModelSpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVTIDE_HOME", str(tmp_path_factory.mktemp("kvtide-home")))
        path = str(build_demo_model(tiny))
    config = parse_config({"model": path, "served_model_name": "m", "engine": {"max_model_len": 256},
                           "serving": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}})
    return VllmChatRender(*build_chat_renderer(config, path))


def test_vllms_renderer_in_the_peer_renders_a_tools_chat_as_the_models_template_does(renderer):
    """The ids are the model's chat template applied to the messages (as vLLM passes them, generation prompt added);
    a body vLLM would refuse or that is not eligible gives none; threads rendering at once agree."""
    tokenizer = renderer.online_renderer.renderer.tokenizer
    ids = renderer.prompt_ids(CHAT)
    text = tokenizer.apply_chat_template(CHAT["messages"], tools=CHAT["tools"], add_generation_prompt=True,
                                         tokenize=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert renderer.prompt_ids({**CHAT, "echo": True}) is None
    assert renderer.prompt_ids({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}) is None  # too long
    results: list[list[int] | None] = []
    threads = [threading.Thread(target=lambda: results.append(renderer.prompt_ids(CHAT))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [ids] * 3
