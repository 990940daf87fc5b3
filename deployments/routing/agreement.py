"""Would a router on another node make this pick? A sampled check of how far independent routers agree.

Routers share no state (one per node in direct mode, one per ingress replica): they agree
because they read the same engine digests and snapshots and break ties by rendezvous
weights (policy.py, "Routers agree"). Each also keeps inputs of its own, and a pick they
move is one another router would not reproduce:

    shared (every router alike)              private (this router's own)
    snapshots: the engines' reports          routing history: blocks it routed, no digest yet
    engine truth in PrefixIndex              session memory: the replica of a session's last turn
    rendezvous weights of group / session    group demand: what makes a hot group replicate (k ≥ 2)

One check, on a decision already made: rank again on the same snapshots with the shared
inputs alone (the prefix match from engine truth, no session memory, no demand) and compare
the first choices. The snapshots are taken as given, though part of them is this router's
own (its in-flight counts, direct mode's pick-only bookings, `FleetView.book_pick`): that is
load, which the guard bounds, not affinity, and it is not what this check is after.

    agrees     the real first choice is the shared-state one
    reason     (disagreements) which private input moved the pick, the first that applies:
      session      the pick is the session's last replica (stickiness overrides cost)
      history      the pick's matched prefix is longer than its engine truth
      replication  neither: only a hot group's credit can have lowered the pick's cost
      other        none of these (not expected: kept so that a miss shows, not hides)

Why the reason needs no third ranking: without stickiness, private inputs only add cached
blocks (history on the replicas this router routed to, a hot group's credit on its members),
so the pick can overtake the shared choice only by gaining itself: history on another
replica helps that one, and the shared choice's own gains only keep it ahead. So the pick's
real match against its engine-truth match (both at hand) names history, and what is left is
the credit: replication. Both can apply at once; the check then names history (it did move
the pick, the credit may have too).

Requests with no full block (no prefix to agree on) and decisions with a single candidate
are not checked and not counted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, Sequence

from kvtide.deployments.routing.block_hash import BlockHash
from kvtide.deployments.routing.policy import RouterState, RoutingDecision, rank_replicas
from kvtide.deployments.routing.snapshot import ReplicaSnapshot

# Check one checkable decision in 8. A check is a second ranking on a decision already made
# (a match on engine truth alone, then the policy's scoring without sessions or replication),
# about two thirds of a decision's own cost: 1 in 8 adds under a tenth to the mean cost of a
# decision and nothing to 7 in 8 of them, on a path where tokenizing and the hop to the
# router cost far more. A router taking ten requests a second still checks about one a
# second, tens per Grafana rate window. Counted, not drawn: the router's rng is left alone
# and the cadence is exact (tests pin it).
AGREEMENT_SAMPLE_EVERY = 8

Reason = Literal["session", "history", "replication", "other"]
# rank_replicas draws from its rng only for a request with no block and no session key,
# which is never checked: this one is never drawn from.
_NO_DRAW = random.Random(0)


@dataclass(frozen=True, slots=True)
class Agreement:
    """One checked decision: whether its first choice is the one shared state alone gives.

    Why a type: the pure check and the Ray adapter's counter meet here (tags from fields).
    """

    agrees: bool
    shared_choice: str  # the first choice from the shared inputs alone
    reason: Reason | None = None  # the private input that moved the pick; None when it agrees


def is_checkable(request_hashes: Sequence[BlockHash], snapshots: Sequence[ReplicaSnapshot]) -> bool:
    """A request with at least one full block, and a choice between two replicas or more."""
    return bool(request_hashes) and len(snapshots) >= 2


def check_agreement(state: RouterState, decision: RoutingDecision, request_hashes: Sequence[BlockHash],
                    snapshots: Sequence[ReplicaSnapshot], *, now_s: float,
                    session_key: str | None = None) -> Agreement | None:
    """Compare `decision` (made by `state` on these inputs) with the ranking of shared state alone.

    None when the decision is not checkable (`is_checkable`). Reads `state`, changes nothing.
    """
    if not is_checkable(request_hashes, snapshots) or not decision.ranked:
        return None
    engine_match = state.index.match(request_hashes, now_s, engine_only=True)
    shared = rank_replicas(request_hashes, state.block_size, snapshots, state.index, state.tunables, _NO_DRAW,
                           now_s=now_s, session_key=session_key, prefix_match=engine_match,
                           cpu_index=state.cpu_index if state.tunables.cpu_tier_aware else None)
    picked, shared_choice = decision.ranked[0], shared.ranked[0]
    if picked == shared_choice:
        return Agreement(True, shared_choice)
    return Agreement(False, shared_choice, _reason(decision, engine_match.get(picked, 0) * state.block_size))


def _reason(decision: RoutingDecision, engine_tokens_of_pick: int) -> Reason:
    """Which private input moved `decision`'s pick (module docstring: why this order suffices)."""
    if decision.sticky:
        return "session"
    if decision.matched_tokens > engine_tokens_of_pick:
        return "history"
    if decision.prefix_replicas >= 2:
        return "replication"
    return "other"


class AgreementSampler:
    """Which decisions get the check: the first checkable one, then every `every`-th after it.

    The first so that a router with little traffic reports one soon; only checkable
    decisions count towards the cadence, so a mix of short prompts does not thin it.
    """

    def __init__(self, every: int = AGREEMENT_SAMPLE_EVERY):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every = every
        self._checkable = 0  # checkable decisions seen

    def check(self, state: RouterState, decision: RoutingDecision, request_hashes: Sequence[BlockHash],
              snapshots: Sequence[ReplicaSnapshot], *, now_s: float,
              session_key: str | None = None) -> Agreement | None:
        """`check_agreement` on a due decision; None for the others and for any not checkable."""
        if not is_checkable(request_hashes, snapshots):
            return None
        due = self._checkable % self.every == 0
        self._checkable += 1
        if not due:
            return None
        return check_agreement(state, decision, request_hashes, snapshots, now_s=now_s, session_key=session_key)
