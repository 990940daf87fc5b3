"""Active and standby roles: who is woken, who goes to standby, who retires, and how many Serve runs."""

from __future__ import annotations

import pytest

from kvtide.autoscaling.standby import SHARED_HIT_WEIGHT, Roles, assign, cache_worth, cache_worth_order, reconcile

POOL = {"standby_replicas": 1, "standby_timeout_s": 60.0, "max_replicas": 8}


@pytest.mark.parametrize("roles, running, active, standby", [
    # No roles yet (first deploy, lost state): the fleet as Serve runs it is active but for the pool.
    (Roles(), ["a", "b", "c"], ("a", "b"), {"c": 5.0}),
    (Roles(), ["a"], ("a",), {}),
    # The fleet is short of what the law asked: a new replica is active; past that, standby.
    (Roles(("a",), {}, (), 2), ["a", "b", "c"], ("a", "b"), {"c": 5.0}),
    # A replica Serve stopped (any role) is forgotten; the others keep theirs and their times.
    (Roles(("a", "b"), {"c": 1.0}, ("d",), 2), ["a", "c"], ("a",), {"c": 1.0}),
])
def test_reconcile_forgets_stopped_replicas_and_places_new_ones_active_first(roles, running, active, standby):
    """reconcile keeps only running replicas and fills the asked active count before the standby pool."""
    after = reconcile(roles, running, now_s=5.0, standby_replicas=1)
    assert after.active == active and dict(after.standby) == standby
    assert not set(after.retiring) - set(running)


@pytest.mark.parametrize("roles, desired, woken, active, standby, target", [
    # Scale-up with a standby: the oldest standby wakes; Serve starts a new standby behind it.
    (Roles(("a",), {"s1": 3.0, "s2": 1.0}), 2, ("s2",), ("a", "s2"), {"s1": 3.0}, 3),
    (Roles(("a",), {"s1": 1.0}), 2, ("s1",), ("a", "s1"), {}, 3),
    # Asked for more than the standbys: all wake, the rest start cold (target covers them), pool refills.
    (Roles(("a",), {"s1": 1.0}), 4, ("s1",), ("a", "s1"), {}, 5),
    # Steady: nothing moves, the pool is kept.
    (Roles(("a", "b"), {"s1": 1.0}), 2, (), ("a", "b"), {"s1": 1.0}, 3),
])
def test_scale_up_wakes_standbys_oldest_first_and_refills_the_pool(roles, desired, woken, active, standby, target):
    """Woken replicas move to active, the Serve target is active + the standby pool."""
    plan = assign(roles, desired, worth={}, now_s=10.0, **POOL)
    assert plan.woken == woken and plan.roles.active == active and dict(plan.roles.standby) == standby
    assert plan.serve_target == target and plan.demoted == () and plan.retired == ()


@pytest.mark.parametrize("worth, demoted", [
    ({"a": 900.0, "b": 10.0, "c": 500.0}, ("b",)),  # fewest hit tokens served recently
    ({"a": 0.0, "b": 0.0, "c": 0.0}, ("a",)),  # all alike: by replica id, as every tick would
    ({"a": 50.0, "c": 60.0}, ("b",)),  # no report yet counts as worth nothing
])
def test_scale_down_puts_the_least_valuable_cache_to_standby(worth, demoted):
    """cache_aware: the active replica with the least recent hit worth becomes a standby; Serve's count holds."""
    roles = Roles(("a", "b", "c"), {}, (), 3)
    plan = assign(roles, 2, worth=worth, now_s=10.0, standby_replicas=0, standby_timeout_s=60.0, max_replicas=8)
    assert plan.demoted == demoted and set(plan.roles.active) == {"a", "b", "c"} - set(demoted)
    assert dict(plan.roles.standby) == {demoted[0]: 10.0}
    assert plan.serve_target == 3  # the demoted replica stays until its timeout


def test_a_first_deploy_keeps_its_initial_replicas_while_they_start():
    """No roles and nothing running yet: the replicas Serve is starting count as the active ones asked for."""
    roles = reconcile(Roles(), [], now_s=0.0, standby_replicas=1, serve_target=4)
    assert roles.desired_active == 3 and roles.active == ()
    # The law then sees 3 starting, holds; the target stays 3 active + the pool.
    assert assign(roles, 3, worth={}, now_s=0.0, **POOL).serve_target == 4
    assert reconcile(roles, ["a", "b", "c", "d"], now_s=1.0).active == ("a", "b", "c")


@pytest.mark.parametrize("hits, exclusive, worth", [
    (1000.0, 1000.0, 1000.0),                        # only it held what it served
    (1000.0, 0.0, SHARED_HIT_WEIGHT * 1000.0),       # every hit another holder could have served
    (1000.0, 400.0, 400.0 + SHARED_HIT_WEIGHT * 600.0),
    (100.0, 400.0, 100.0),                           # exclusive capped at the hits (reports of two windows)
    (0.0, 0.0, 0.0),
])
def test_cache_worth_weighs_hits_only_this_replica_held_above_shared_ones(hits, exclusive, worth):
    """worth = exclusive hit tokens + SHARED_HIT_WEIGHT × the rest of the hits."""
    assert cache_worth(hits, exclusive) == pytest.approx(worth)


def test_a_replica_serving_many_shared_hits_goes_before_one_serving_fewer_it_alone_holds():
    """Scale-down: 5,000 hit tokens on a prefix two replicas hold are worth less than 1,000 only one holds."""
    worth = {"busy-shared": cache_worth(5000.0, 0.0), "alone": cache_worth(1000.0, 1000.0)}
    plan = assign(Roles(("alone", "busy-shared"), {}, (), 2), 1, worth=worth, now_s=0.0, standby_replicas=0,
                  standby_timeout_s=60.0, max_replicas=8)
    assert plan.demoted == ("busy-shared",)


def test_worth_order_is_least_first_then_by_id():
    """The scale-down order: least worth first, ties by replica id."""
    assert cache_worth_order(["c", "a", "b"], {"a": 5.0, "b": 5.0, "c": 1.0}) == ["c", "a", "b"]


@pytest.mark.parametrize("standby, retiring, now_s, retired, target", [
    # A demoted standby beyond the pool retires after its timeout, not before.
    ({"s1": 50.0, "d": 60.0}, (), 100.0, (), 4),
    ({"s1": 0.0, "d": 30.0}, (), 100.0, ("s1",), 4),  # both expired: the one waiting longest
    # Only the pool: nobody retires however long they waited.
    ({"s1": 0.0}, (), 1000.0, (), 3),
    # One retirement at a time: the next waits until Serve has stopped the first.
    ({"s1": 0.0, "s2": 0.0, "s3": 0.0}, ("r",), 1000.0, (), 6),
])
def test_standbys_beyond_the_pool_retire_one_at_a_time_after_the_timeout(standby, retiring, now_s, retired, target):
    """Retiring keeps Serve's count until the retiree is gone; then reconcile drops it and the target falls."""
    roles = Roles(("a", "b"), standby, retiring, 2)
    plan = assign(roles, 2, worth={}, now_s=now_s, **POOL)
    assert plan.retired == retired and plan.serve_target == target
    assert set(plan.roles.retiring) == set(retiring) | set(retired)


def test_a_retiree_gone_lowers_the_target_by_one():
    """After Serve stops the retiring replica, the next tick's target no longer counts it."""
    roles = Roles(("a",), {}, ("r",), 1)
    assert assign(roles, 1, worth={}, now_s=0.0, **POOL).serve_target == 3  # a + pool refill + r
    after = reconcile(roles, ["a"], now_s=1.0)
    assert assign(after, 1, worth={}, now_s=1.0, **POOL).serve_target == 2


def test_timeout_zero_demotes_and_retires_in_one_tick():
    """standby_timeout_s=0 and no pool: a scale-down removes exactly the least valuable replica."""
    roles = Roles(("a", "b"), {}, (), 2)
    plan = assign(roles, 1, worth={"a": 1.0, "b": 9.0}, now_s=5.0, standby_replicas=0, standby_timeout_s=0.0,
                  max_replicas=4)
    assert plan.demoted == ("a",) and plan.retired == ("a",) and plan.roles.active == ("b",)
    assert plan.serve_target == 2  # until Serve has stopped "a"
    assert assign(reconcile(plan.roles, ["b"], 6.0), 1, worth={}, now_s=6.0, standby_replicas=0,
                  standby_timeout_s=0.0, max_replicas=4).serve_target == 1


def test_the_cap_keeps_active_replicas_before_the_pool():
    """At max_replicas the standby pool is not refilled; the active count asked is still honoured."""
    plan = assign(Roles(("a", "b"), {"s": 1.0}), 3, worth={}, now_s=2.0, standby_replicas=1, standby_timeout_s=60.0,
                  max_replicas=3)
    assert plan.woken == ("s",) and plan.serve_target == 3


def test_roles_round_trip_through_policy_state():
    """Roles survive Ray's policy-state dict unchanged."""
    roles = Roles(("a",), {"s": 1.5}, ("r",), 2)
    assert Roles.from_dict(roles.to_dict()) == roles and Roles.from_dict(None) == Roles()


def test_the_published_document_names_only_the_replicas_kept_aside():
    """A replica not named is active; the document round-trips through encode/decode."""
    from kvtide.autoscaling.roles_channel import decode, encode, role_of

    document = encode(Roles(("a",), {"s": 1.0}, ("r",), 1))
    assert decode(document) == {"standby": {"s"}, "retiring": {"r"}} and decode(None) == {"standby": set(), "retiring": set()}
    assert [role_of(document, r) for r in ("a", "s", "r", "new")] == ["active", "standby", "retiring", "active"]
