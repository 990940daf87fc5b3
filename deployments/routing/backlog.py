"""Prefill tokens ahead of a new request on each replica, drained between reports at the engine's rate.

Why: a replica's report (pending prefill tokens, `deployments.engine.pending_prefill`) is up to a
stats period (~1 s) old when the router reads it, plus the picks this router booked since.
Read as is, a replica caught mid-prefill at its report looks loaded for the whole period,
though a GPU finishes a prefill of a few thousand tokens in a fraction of it; the picks of
that period then herd onto the others, and on prompts with no shared prefix (no cache
affinity to win) the load-aware router's TTFT tail would fall behind round robin's.

A fluid queue per replica, in wall-clock seconds (the engines stamp reports with theirs):

    report       backlog = reported tokens − rate × (now − reported_s)   (age clamped to [0, max_age_s])
    book(t)      backlog = drained(now) + t                               (a pick-only choice's prefill)
    drained(now) max(0, backlog − rate × (now − last update))

with `rate` the engine's own measured drain rate (`prefill_tokens_per_s` in its report). An
engine that reports no rate (0, older builds) is not drained: backlog = reported + booked,
exactly the undrained view. A drained value is rounded up to `quantum_tokens` (256: a few ms
of a GPU's prefill of an 8B model, below what a routing choice can tell apart), so the
router's per-replica snapshot (rebuilt only when a number changes) is not rebuilt at every
decision as the value slides (building the snapshots is a large share of a decision;
benchmarks/router_microbench.py measures it).
"""

from __future__ import annotations

import math


class PrefillBacklog:
    """replica → (tokens, as of when, drain rate tokens/s, when it is empty).

    `tokens` runs for every replica of every routing decision (FleetView.snapshots): the time
    the backlog empties is kept with it, so a drained replica (most of them, most of the time)
    costs one lookup and one comparison.
    """

    def __init__(self, quantum_tokens: int = 256, max_age_s: float = 5.0) -> None:
        self._state: dict[str, tuple[float, float, float, float]] = {}
        self._quantum = quantum_tokens
        self._max_age_s = max_age_s

    def on_report(self, replica_id: str, tokens: int, rate_tokens_per_s: float, reported_s: float,
                  now_s: float) -> None:
        """A new report: the engine's backlog at `reported_s`, drained to `now_s` (its booked picks are in it)."""
        rate = max(0.0, rate_tokens_per_s)
        age_s = min(max(0.0, now_s - reported_s), self._max_age_s)  # clock skew between hosts: clamp
        self._set(replica_id, max(0.0, tokens - rate * age_s), now_s, rate)

    def book(self, replica_id: str, tokens: int, now_s: float) -> None:
        """This router sent `tokens` of prefill there (pick-only): on top of what is left."""
        left, rate = self._left(replica_id, now_s)
        self._set(replica_id, left + tokens, now_s, rate)

    def tokens(self, replica_id: str, now_s: float) -> int:
        """The backlog now, rounded up to the quantum once drained (exact when the engine reports no rate)."""
        entry = self._state.get(replica_id)
        if entry is None or now_s >= entry[3]:
            return 0
        tokens, since_s, rate, _ = entry
        if not rate:
            return int(tokens)
        left = tokens - rate * max(0.0, now_s - since_s)
        return math.ceil(left / self._quantum) * self._quantum

    def _set(self, replica_id: str, tokens: float, now_s: float, rate: float) -> None:
        empty_s = now_s + tokens / rate if rate else (now_s if tokens <= 0 else math.inf)
        self._state[replica_id] = (tokens, now_s, rate, empty_s)

    def _left(self, replica_id: str, now_s: float) -> tuple[float, float]:
        """(tokens left at `now_s`, drain rate): the last value drained for the time since it was set."""
        tokens, since_s, rate, _ = self._state.get(replica_id, (0.0, now_s, 0.0, now_s))
        return max(0.0, tokens - rate * max(0.0, now_s - since_s)), rate

    def forget(self, replica_id: str) -> None:
        self._state.pop(replica_id, None)
