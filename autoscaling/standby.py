"""Active and standby engine replicas: which replica holds which role, and how many Serve keeps.

Pure: no Ray. The Ray policy adapter (`autoscaling.ray_policy`) calls `reconcile` before the
control law and `assign` after it, each tick; the roles travel to the replicas through Ray's
internal KV (`autoscaling.roles_channel`), and each replica acts on its own role.

    Roles        active ids, standby ids (each with the time it went to standby), retiring ids
    reconcile    drop replicas Serve no longer runs; give a new replica a role
                 (active while the fleet is short of the active count asked, else standby)
    assign       the law asked for `desired_active`:
                   more → wake standbys (oldest first: every standby is alike, asleep and empty)
                   fewer → the active replicas whose cache is worth least go to standby
                           (kvtide chooses, not Ray; `scale_down_chooser: ray` leaves roles out)
                 then retire one standby beyond `standby_replicas` that has waited past
                 `standby_timeout_s`, and size Serve for active + standby (+ the pool's refill)
    worth        of one replica's cache over cache_value_window_s (`cache_worth`):
                   exclusive hit tokens + SHARED_HIT_WEIGHT × the other hit tokens it served
                 exclusive: served from blocks no other replica held when the request was
                 routed (the routing peers' view: engine digests ∪ their own routing); a hit
                 another holder could have served survives this replica leaving

Invariants:
- A replica is in at most one of active, standby, retiring; every id is a running replica
  after `reconcile` (what Serve stopped, for whatever reason, is forgotten).
- The active count only follows the law: `assign` never leaves fewer active replicas than
  asked while a standby could be woken, and never wakes more than asked.
- Retiring: the replica fails its health check on purpose; Serve stops it and, its target not
  yet lowered, launches a replacement in the same control-loop step. The next tick sees the
  retiree gone and lowers the target, and Ray's downscale takes a replica that is not running
  yet first: the replacement. So Ray never chooses among running replicas, and the one kvtide
  chose is the one that stops.
- The Serve target counts what is asked of the fleet: the active replicas the law wants, the
  standbys kept (`standby_replicas`, or more while demoted ones wait out their timeout) and
  the retiring replicas until Serve has stopped them, capped at `max_replicas`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping


@dataclass(frozen=True)
class Roles:
    """The fleet's roles as the policy last assigned them (kept in Ray's policy state)."""

    active: tuple[str, ...] = ()
    standby: Mapping[str, float] = field(default_factory=dict)  # replica id → when it went to standby (s)
    retiring: tuple[str, ...] = ()
    desired_active: int = 0  # what the law last asked for: a new replica fills this first

    def to_dict(self) -> dict:
        return {"active": list(self.active), "standby": dict(self.standby), "retiring": list(self.retiring),
                "desired_active": self.desired_active}

    @classmethod
    def from_dict(cls, data: Mapping | None) -> "Roles":
        if not data:
            return cls()
        return cls(tuple(data.get("active", ())), dict(data.get("standby", {})), tuple(data.get("retiring", ())),
                   int(data.get("desired_active", 0)))

    @property
    def standby_ids(self) -> tuple[str, ...]:
        return tuple(self.standby)


@dataclass(frozen=True)
class RolePlan:
    """What `assign` decided this tick."""

    roles: Roles
    serve_target: int  # the replica count Serve should run
    woken: tuple[str, ...] = ()
    demoted: tuple[str, ...] = ()
    retired: tuple[str, ...] = ()


def reconcile(roles: Roles, running: Iterable[str], now_s: float, standby_replicas: int = 0,
              serve_target: int | None = None) -> Roles:
    """Forget what Serve no longer runs; a new replica becomes active while the fleet is short, else standby.

    New replicas are taken in the order Serve lists them, so two ticks over the same list agree.
    With no roles yet (a first deploy, or a controller that lost its policy state) the fleet
    Serve is asked for (`serve_target`; else what runs) is taken as it is: active, but for the
    standby pool. Replicas still starting count, so a deploy's initial_replicas is not undone.
    """
    running = list(running)
    if not (roles.active or roles.standby or roles.retiring or roles.desired_active):
        fleet = max(len(running), serve_target or 0)
        roles = Roles(desired_active=max(fleet - standby_replicas, 1 if fleet else 0))
    alive = set(running)
    active = [r for r in roles.active if r in alive]
    standby = {r: since for r, since in roles.standby.items() if r in alive}
    retiring = tuple(r for r in roles.retiring if r in alive)
    known = set(active) | set(standby) | set(retiring)
    for replica_id in running:
        if replica_id in known:
            continue
        if len(active) < roles.desired_active:
            active.append(replica_id)
        else:
            standby[replica_id] = now_s
    return Roles(tuple(active), standby, retiring, roles.desired_active)


# What a hit on a prefix other replicas also hold is worth against one only this replica holds.
# Not 0: the other holders take over its traffic on that prefix, and their caches may not keep
# it. Small: losing an exclusive prefix costs every later request of it a prefill until one
# re-caches it, while a shared one costs none as long as another holder keeps it.
SHARED_HIT_WEIGHT = 0.1


def cache_worth(hit_tokens: float, exclusive_hit_tokens: float) -> float:
    """A replica's cache worth from the hit tokens it served recently and those only it held."""
    exclusive = min(max(exclusive_hit_tokens, 0.0), max(hit_tokens, 0.0))
    return exclusive + SHARED_HIT_WEIGHT * (max(hit_tokens, 0.0) - exclusive)


def cache_worth_order(active: Iterable[str], worth: Mapping[str, float]) -> list[str]:
    """Active replicas from the least valuable cache to the most; ties (and no report) by replica id."""
    return sorted(active, key=lambda r: (worth.get(r, 0.0), r))


def assign(roles: Roles, desired_active: int, *, worth: Mapping[str, float], now_s: float,
           standby_replicas: int, standby_timeout_s: float, max_replicas: int) -> RolePlan:
    """Move replicas between active and standby toward `desired_active`; size Serve's target.

    `worth`: each active replica's cache value (`cache_worth` of the hits it served recently).
    """
    active = list(roles.active)
    standby = dict(roles.standby)
    retiring = list(roles.retiring)
    woken: list[str] = []
    demoted: list[str] = []
    # Scale up: wake standbys, oldest first.
    while len(active) < desired_active and standby:
        replica_id = min(standby, key=lambda r: (standby[r], r))
        del standby[replica_id]
        active.append(replica_id)
        woken.append(replica_id)
    # Scale down: the least valuable caches go to standby.
    if len(active) > desired_active:
        for replica_id in cache_worth_order(active, worth)[:len(active) - desired_active]:
            active.remove(replica_id)
            standby[replica_id] = now_s
            demoted.append(replica_id)
    # Retire one standby beyond the pool that waited out its timeout (one at a time: each
    # retirement is a health-check failure Serve must see before the target drops).
    retired: list[str] = []
    if not retiring and len(standby) > standby_replicas:
        expired = [r for r, since in standby.items() if now_s - since >= standby_timeout_s]
        if expired:
            replica_id = min(expired, key=lambda r: (standby[r], r))
            del standby[replica_id]
            retiring.append(replica_id)
            retired.append(replica_id)
    # Short of active replicas with no standby left: cold starts (`desired_active` counts them).
    # The pool refills to `standby_replicas` below the cap only: active replicas come first.
    num_standby = max(len(standby), standby_replicas)
    serve_target = min(max(desired_active, len(active)) + num_standby + len(retiring), max_replicas)
    serve_target = max(serve_target, min(desired_active, max_replicas))
    new_roles = Roles(tuple(active), standby, tuple(retiring), desired_active)
    return RolePlan(new_roles, serve_target, tuple(woken), tuple(demoted), tuple(retired))
