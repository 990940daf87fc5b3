"""FleetView: routing stats applied when they arrive (digests, load, pick counts), snapshots read at decision time."""

from __future__ import annotations

import random

from kvtide.config import RoutingConfig
from kvtide.deployments.routing.block_hash import block_hashes
from kvtide.deployments.routing.fleet import FleetView, rekey
from kvtide.deployments.routing.policy import RouterState
from kvtide.deployments.routing.snapshot import CacheDigest

BS = 4
PROMPT = block_hashes(list(range(32)), BS)  # 8 blocks


def fleet() -> FleetView:
    return FleetView(RouterState(RoutingConfig(), BS))


def stats(seq: int, hashes=PROMPT, engine_id: str = "engine-a", **load) -> dict:
    return {"digest": CacheDigest.from_hashes(engine_id, 1, seq, hashes), "reported_s": float(seq), **load}


def test_sync_applies_digests_under_the_routers_replica_id():
    """A digest named by the engine is applied under the id the router knows the replica by."""
    view = fleet()
    view.sync({"a": stats(1)})
    assert view.state.index.match(PROMPT, 0.0) == {"a": 8}


def test_sync_replaces_with_newer_digests_and_ignores_replays():
    """The next report replaces the replica's blocks; the same report delivered again changes nothing."""
    view = fleet()
    view.sync({"a": stats(1)})
    view.sync({"a": stats(2, PROMPT[:3])})
    view.sync({"a": stats(1)})  # a late copy of an older report
    assert view.state.index.match(PROMPT, 0.0) == {"a": 3}


def test_snapshots_carry_the_reported_load():
    """Engine-reported running/waiting/KV usage reach the decision's snapshots without re-parsing stats."""
    view = fleet()
    view.sync({"a": stats(1, num_running=3, num_waiting=2, kv_usage_perc=0.5), "b": {}})
    a, b = view.snapshots([("a", 1), ("b", None)])
    assert (a.num_running, a.num_waiting, a.kv_usage_perc, a.num_queued_requests) == (3, 2, 0.5, 5)
    assert (b.replica_id, b.num_queued_requests) == ("b", 0)


def test_pick_only_choices_count_as_load_until_the_next_report():
    """Picks this router made count as in-flight until the engine's next report (which includes them)."""
    view = fleet()
    view.sync({"a": stats(1)})
    view.book_pick("a")
    view.book_pick("a")
    assert view.snapshots([("a", None)])[0].num_ongoing_requests == 2
    assert view.snapshots([("a", None)])[0].num_confirmed_requests == 0  # guesses: replication does not count them
    assert view.snapshots([("a", 5)])[0].num_ongoing_requests == 5  # Ray's own count when it is larger
    assert view.snapshots([("a", 5)])[0].num_confirmed_requests == 5
    view.sync({"a": stats(1)})  # the same report again: still counted
    assert view.snapshots([("a", None)])[0].num_ongoing_requests == 2
    view.sync({"a": stats(2)})
    assert view.snapshots([("a", None)])[0].num_ongoing_requests == 0


def test_pending_prefill_comes_from_the_latest_report():
    """Snapshots carry the engine's reported pending prefill tokens, replaced by each new report."""
    view = fleet()
    view.sync({"a": stats(1, pending_prefill_tokens=500)})
    assert view.snapshots([("a", 0)])[0].pending_prefill_tokens == 500
    view.sync({"a": stats(2, pending_prefill_tokens=6100)})
    assert view.snapshots([("a", 0)])[0].pending_prefill_tokens == 6100


def test_pick_only_choices_book_their_uncached_prefill_until_the_next_report():
    """A pick books the prompt tokens it must prefill beyond one queued request's worth, as pending, until a new report."""
    view = fleet()
    per_request = view.state.tunables.tokens_per_queued_request
    view.sync({"a": stats(1, pending_prefill_tokens=100)})
    before = view.snapshots([("a", None)])[0]
    view.book_pick("a", 6000)  # a cold 6,000-token prompt
    view.book_pick("a", 64)  # a hit: one queued request's worth, no more
    snap = view.snapshots([("a", None)])[0]
    assert snap is not before
    assert (snap.pending_prefill_tokens, snap.num_ongoing_requests) == (100 + 6000 - per_request, 2)
    view.sync({"a": stats(2, pending_prefill_tokens=5000)})  # the engine's numbers include them now
    assert view.snapshots([("a", None)])[0].pending_prefill_tokens == 5000


def test_a_new_report_with_unchanged_numbers_still_drops_the_booked_prefill():
    """The booking ends at the next report even when its numbers repeat the last one's and Ray's count hides the picks."""
    view = fleet()
    view.sync({"a": stats(1, pending_prefill_tokens=100)})
    view.snapshots([("a", 5)])
    view.book_pick("a", 6000)
    assert view.snapshots([("a", 5)])[0].pending_prefill_tokens > 100
    view.sync({"a": stats(2, pending_prefill_tokens=100)})
    assert view.snapshots([("a", 5)])[0].pending_prefill_tokens == 100


def test_replicas_no_longer_listed_are_forgotten():
    """A replica missing from the next list leaves the index, the session memory and the load tables."""
    view = fleet()
    view.sync({"a": stats(1), "b": stats(1, engine_id="engine-b")})
    view.state.on_routed("a", PROMPT, 0.0, session_key="chat")
    view.sync({"b": stats(2, engine_id="engine-b")})
    assert view.state.index.match(PROMPT, 0.0) == {"b": 8}
    assert view.state.sessions.last_replica("chat", 0.0) is None


def test_snapshots_are_reused_while_unchanged():
    """The same snapshot object comes back while the replica's numbers stay the same (no per-decision rebuild)."""
    view = fleet()
    view.sync({"a": stats(1, num_running=1)})
    first = view.snapshots([("a", 2)])[0]
    assert view.snapshots([("a", 2)])[0] is first
    assert view.snapshots([("a", 3)])[0] is not first
    view.sync({"a": stats(2, num_running=4)})
    assert view.snapshots([("a", 3)])[0].num_running == 4


def test_rekey_keeps_everything_but_the_id():
    """rekey renames a digest and leaves its epoch, sequence, blocks and flags alone."""
    digest = CacheDigest.from_hashes("engine-a", 3, 7, PROMPT, all_cleared=True, timestamp_s=1.5)
    renamed = rekey(digest, "a")
    assert (renamed.replica_id, renamed.epoch, renamed.sequence, renamed.blocks, renamed.all_cleared,
            renamed.timestamp_s) == ("a", 3, 7, digest.blocks, True, 1.5)
    assert rekey(renamed, "a") is renamed


def stamped(seq: int, stamp_s: float, engine_id: str = "engine-a") -> dict:
    return {"digest": CacheDigest.from_hashes(engine_id, 1, seq, PROMPT, timestamp_s=stamp_s), "reported_s": stamp_s}


def test_digest_age_is_that_of_the_newest_applied_digest_per_replica():
    """Age = now − the stamp of the newest applied digest; a replayed older report does not make it younger or older."""
    view = fleet()
    view.sync({"a": stamped(1, 100.0), "b": stamped(1, 103.0, "engine-b")})
    assert view.digest_ages_s(104.0) == {"a": 4.0, "b": 1.0}
    view.sync({"a": stamped(2, 103.5), "b": stamped(1, 103.0, "engine-b")})
    view.sync({"a": stamped(1, 100.0), "b": stamped(1, 103.0, "engine-b")})  # a's late older report: not applied
    assert view.digest_ages_s(104.0) == {"a": 0.5, "b": 1.0}
    # b's stats keep arriving without a newer digest: its view keeps ageing.
    assert view.digest_ages_s(110.0)["b"] == 7.0


def test_digest_age_skips_unstamped_digests_clamps_skew_and_forgets_gone_replicas():
    """An unstamped digest (0.0) has no age; a clock ahead reads 0, not negative; a replica that left has none."""
    view = fleet()
    view.sync({"a": stats(1), "b": stamped(1, 200.0, "engine-b")})
    assert view.digest_ages_s(150.0) == {"b": 0.0}
    view.sync({"a": stats(2)})
    assert view.digest_ages_s(250.0) == {}


def test_sliced_fleet_queues_digests_and_applies_them_a_slice_per_call():
    """With slice_blocks, sync only queues (new reports once); apply_digests does one slice per call until False."""
    view = FleetView(RouterState(RoutingConfig(), BS), slice_blocks=3)
    view.sync({"a": stats(1)})
    view.sync({"a": stats(1)})  # Ray re-sends the latest stats at every push: not queued twice
    assert view.num_queued_digests == 1 and view.state.index.match(PROMPT, 0.0) == {}
    calls = 1
    while view.apply_digests(3):
        calls += 1
    assert calls == 4  # 8 blocks in slices of 3, then the call that finishes the report (moves `applied`)
    assert view.state.index.match(PROMPT, 0.0) == {"a": 8} and view.num_queued_digests == 0


def test_forgetting_a_replica_mid_slice_leaves_nothing_of_it():
    """A replica that leaves while its digest is half applied: queued and half-applied blocks are all dropped."""
    view = FleetView(RouterState(RoutingConfig(), BS), slice_blocks=3)
    view.sync({"a": stats(1), "b": stats(1, engine_id="engine-b")})
    assert view.apply_digests(3)  # "a" part-way
    view.forget("a")
    while view.apply_digests(3):
        pass
    assert view.state.index.match(PROMPT, 0.0) == {"b": 8} and view.state.index.held_by("a") == frozenset()


def _pick_only(view: FleetView, hashes, now_s: float = 0.0) -> str:
    """What the router does for a pick-only call: rank, then book the pick (load, prefill, history)."""
    decision = view.state.rank(hashes, view.snapshots([("a", None), ("b", None)]), random.Random(0), now_s=now_s)
    picked = decision.ranked[0]
    view.book_pick(picked, len(hashes) * BS - decision.matched_tokens)
    view.state.on_routed(picked, hashes, now_s)
    return picked


def test_a_second_new_prefix_within_a_report_period_avoids_the_prefill_just_sent():
    """Two cold 6k prompts between reports: the second goes to the replica with cheap queued hits, not behind the first."""
    view = fleet()
    view.sync({"a": stats(1, (), num_running=3), "b": stats(1, (), engine_id="engine-b")})
    first = block_hashes([1] + list(range(6000)), BS)
    second = block_hashes([2] + list(range(6000)), BS)
    assert _pick_only(view, first) == "b"  # idle
    assert _pick_only(view, second) == "a"  # 3 queued hits (768 tokens) < b's 6,000 pending


def test_a_short_cold_prompt_keeps_its_next_request_before_the_report():
    """A 200-token prompt just sent books no more than one queued request: the same prefix follows it there."""
    view = fleet()
    view.sync({"a": stats(1, ()), "b": stats(1, (), engine_id="engine-b")})
    prompt = block_hashes(list(range(200)), BS)
    first = _pick_only(view, prompt)
    assert _pick_only(view, prompt) == first


def _spread_of_cold_picks(rate_tokens_per_s: float) -> dict[str, int]:
    """8 cold 2k-token prompts over one report period (every 1/8 s) on 4 replicas reported equally busy,
    two of them caught mid-prefill (2,048 tokens pending) at the report: picks per replica."""
    view = FleetView(RouterState(RoutingConfig(), 16))
    ids = ("a", "b", "c", "d")
    view.sync({rid: {"reported_s": 100.0, "num_running": 4, "pending_prefill_tokens": 2048 if rid in "ad" else 0,
                     "prefill_tokens_per_s": rate_tokens_per_s} for rid in ids}, now_s=100.0)
    counts = dict.fromkeys(ids, 0)
    for i in range(8):
        now_s = 100.0 + (i + 1) / 8
        hashes = block_hashes([10_000 + i] + list(range(2047)), 16)
        decision = view.state.rank(hashes, view.snapshots([(rid, None) for rid in ids], now_s=now_s),
                                   random.Random(i), now_s=now_s)
        picked = decision.ranked[0]
        view.book_pick(picked, len(hashes) * 16 - decision.matched_tokens, now_s=now_s)
        view.state.on_routed(picked, hashes, now_s)
        counts[picked] += 1
    return counts


def test_cold_prompts_between_reports_spread_evenly_when_the_backlog_drains_at_the_engines_rate():
    """With the engine's drain rate, a stale mid-prefill report stops repelling picks once drained: 2 picks each."""
    assert _spread_of_cold_picks(20_000.0) == {"a": 2, "b": 2, "c": 2, "d": 2}
    undrained = _spread_of_cold_picks(0.0)  # no rate reported: the stale 2,048 tokens count all period
    assert undrained["a"] + undrained["d"] < 4


def test_pick_only_choices_queue_on_top_of_the_reported_load():
    """Picks since the report are not in its running + waiting: the load is their sum (Ray's own count if larger)."""
    view = fleet()
    view.sync({"a": stats(1, num_running=4)})
    view.book_pick("a")
    assert view.snapshots([("a", None)])[0].num_queued_requests == 5
    assert view.snapshots([("a", 9)])[0].num_queued_requests == 9
    view.sync({"a": stats(2, num_running=5)})  # the report that includes the pick
    assert view.snapshots([("a", None)])[0].num_queued_requests == 5
