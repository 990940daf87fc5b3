"""Post-response stage: booking a sent request, and the prediction left for the frontend's trust compare."""

from __future__ import annotations

from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.replication import PrefixDemand, group_key
from kvtide.deployments.routing.sessions import SessionTable
from kvtide.deployments.routing.stages.post_response import book_routed, record_prediction
from kvtide.deployments.routing.trust import compare, read_prediction

BS = 16
HASHES = block_hashes(list(range(8 * BS)), BS)


def test_a_booked_request_counts_as_cached_there_grows_its_groups_demand_and_remembers_its_session():
    """book_routed: routing history (until history_ttl_s), group demand and the session's replica."""
    index, demand, sessions = PrefixIndex(10.0), PrefixDemand(half_life_s=10.0), SessionTable(ttl_s=60.0)
    book_routed(index, demand, sessions, 4, "b", HASHES, 0.0, "s1")
    assert index.match(HASHES, 1.0) == {"b": 8}
    assert index.match(HASHES, 11.0) == {}
    assert demand.share(group_key(HASHES, 4)) == 1.0
    assert sessions.last_replica("s1", 1.0) == "b"


def test_the_prediction_names_the_first_choice_and_the_frontends_compare_reads_it_back():
    """record_prediction writes what the router counted on ranked[0]; compare classifies it against the engine."""
    slot: dict = {}
    record_prediction(slot, ["b", "a"], 96, 32)
    prediction = read_prediction(slot)
    assert (prediction.replica_id, prediction.cached_tokens, prediction.exclusive_tokens) == ("b", 96, 32)
    assert compare(prediction, "b", 96, 128, BS).direction == "exact"
    assert compare(prediction, "a", 96, 128, BS) is None  # another replica served: nothing to compare
    empty: dict = {}
    record_prediction(empty, [], 96, 32)
    record_prediction(None, ["a"], 96, 32)
    assert empty == {}
