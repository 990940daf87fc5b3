"""Index trust, pure: the outcome table, the error's sign, the engine's cacheable cap, the slot and the header."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from ray.serve._private.constants import SERVE_INGRESS_ROUTER_HEADER_PREFIX

from kvtide.deployments.messages import GenerateRequest, RoutingKey, SamplingSpec
from kvtide.deployments.routing.trust import (
    OUTCOMES,
    PREDICTED_CACHED_TOKENS_HEADER,
    Comparison,
    Prediction,
    classify,
    compare,
    decode_prediction_header,
    engine_cacheable_tokens,
    exclusive_hit_tokens,
    prediction_header,
    read_prediction,
    write_prediction,
)

BS = 16
LONG_PROMPT = 10 * BS + 5  # cacheable: all 10 full blocks


@pytest.mark.parametrize(("predicted", "engine", "outcome"), [
    (64, 64, "true_hit"),
    (64, 16, "true_hit"),  # a partial hit is still a hit; the error histogram tells how partial
    (16, 64, "true_hit"),
    (64, 0, "false_hit"),
    (0, 64, "missed_hit"),
    (0, 0, "true_miss"),
])
def test_outcome_table(predicted, engine, outcome):
    """Hit/miss on each side: predicted > 0 vs engine > 0 gives exactly one of the four outcomes."""
    assert classify(predicted, engine) == outcome
    assert outcome in OUTCOMES


@pytest.mark.parametrize(("predicted", "engine", "error", "direction"), [
    (64, 64, 0, "exact"),
    (64, 16, -48, "over"),
    (16, 64, 48, "under"),
    (64, 0, -64, "over"),
])
def test_error_is_engine_minus_predicted(predicted, engine, error, direction):
    """The signed error is engine cached − predicted: negative means the router expected more (over)."""
    comparison = compare(Prediction("r1", predicted), "r1", engine, LONG_PROMPT, BS)
    assert comparison == Comparison(classify(predicted, engine), error)
    assert comparison.direction == direction


@pytest.mark.parametrize(("prompt_tokens", "cacheable"), [(0, 0), (1, 0), (16, 0), (17, 16), (32, 16), (33, 32)])
def test_engine_never_caches_the_last_prompt_token(prompt_tokens, cacheable):
    """vLLM's cap: whole blocks of all but the last token (a prompt of exactly 2 blocks can hit 1)."""
    assert engine_cacheable_tokens(prompt_tokens, BS) == cacheable


def test_a_full_block_prompt_fully_cached_is_exact_not_over_by_a_block():
    """The router counts both full blocks of a 32-token prompt; the engine can serve 16: that is exact."""
    assert compare(Prediction("r1", 32), "r1", 16, 32, BS) == Comparison("true_hit", 0)
    # A one-block prompt can never hit: a prediction of it is a true miss, not a false hit.
    assert compare(Prediction("r1", 16), "r1", 0, 16, BS) == Comparison("true_miss", 0)


def test_a_prediction_for_another_replica_is_not_compared():
    """Served by another replica than predicted (a rejection, a redispatch): no comparison at all."""
    assert compare(Prediction("r1", 64), "r2", 64, LONG_PROMPT, BS) is None
    assert compare(Prediction("r1", 64), "", 64, LONG_PROMPT, BS) is None


def test_slot_round_trip_and_empty_slots():
    """What the router writes the caller reads back; an empty or foreign slot is no prediction."""
    slot: dict = {}
    assert read_prediction(slot) is None and read_prediction(None) is None
    write_prediction(slot, "r1", 48)
    assert read_prediction(slot) == Prediction("r1", 48)
    assert read_prediction({"replica_id": "", "predicted_cached_tokens": 1}) is None
    assert read_prediction({"replica_id": "r1", "predicted_cached_tokens": -1}) is None
    assert read_prediction({"something": "else"}) is None


def test_header_round_trip_in_the_namespace_haproxy_strips():
    """The peer's header decodes to the slot's prediction; its name is router-owned (clients cannot send it)."""
    slot: dict = {}
    assert prediction_header(slot) == {}
    write_prediction(slot, "abc123", 2048, 512)
    (name, value), = prediction_header(slot).items()
    assert name == PREDICTED_CACHED_TOKENS_HEADER and name.startswith(SERVE_INGRESS_ROUTER_HEADER_PREFIX)
    assert decode_prediction_header(value) == Prediction("abc123", 2048, 512)
    assert decode_prediction_header("2048;abc123") == Prediction("abc123", 2048, 0)  # no exclusive field: 0
    # HAProxy's Lua reads the peer's JSON with a pattern: no quotes, braces or escapes in the value.
    assert not set(value) & set('"{}\\')


@pytest.mark.parametrize("value", [None, "", "32", "32;", ";r1", "x;r1", "-1;r1", "3.5;r1", "²;r1", "9" * 10 + ";r1",
                                   "32;r1;x", "32;r1;-1", "32;r1;64"])
def test_a_missing_or_malformed_header_is_no_prediction(value):
    """Absent, no replica, not a small non-negative integer, more exclusive than cached tokens: nothing is recorded."""
    assert decode_prediction_header(value) is None


def test_the_slot_rides_along_without_changing_equality_or_pickling():
    """decision is out of eq/hash, a retry's replace shares it, and a request still pickles to the engine."""
    key = RoutingKey(block_hashes=(1, 2))
    write_prediction(key.decision, "r1", 32)
    assert key == RoutingKey(block_hashes=(1, 2)) and hash(key) == hash(RoutingKey(block_hashes=(1, 2)))
    request = GenerateRequest("req", [1, 2], SamplingSpec(max_tokens=1))
    retry = dataclasses.replace(request, request_id="req-1")
    write_prediction(retry.decision, "r2", 16)
    assert read_prediction(request.decision) == Prediction("r2", 16)
    assert pickle.loads(pickle.dumps(retry)).decision == retry.decision


@pytest.mark.parametrize("prediction, served, engine_cached, expected", [
    (Prediction("r1", 2048, 512), "r1", 2048, 512),   # the engine hit all it was routed for: the exclusive part
    (Prediction("r1", 2048, 512), "r1", 300, 300),    # it held less than predicted: at most what it served
    (Prediction("r1", 2048, 512), "r2", 2048, 0),     # another replica served it: the prediction says nothing
    (Prediction("r1", 2048, 0), "r1", 2048, 0),       # others held the same prefix: nothing exclusive
    (None, "r1", 2048, 0),                            # no prediction (another policy): nothing exclusive
])
def test_exclusive_hit_tokens_are_the_served_hits_only_this_replica_held(prediction, served, engine_cached, expected):
    """A finished request adds min(engine cached, exclusive) to its replica's cache worth, if it served the pick."""
    assert exclusive_hit_tokens(prediction, served, engine_cached) == expected
