"""Session affinity memory: which replica served a session's last turn, for `session_ttl_s`.

A multi-turn conversation's next prompt extends the previous one (the history plus the
reply plus a new message), so the replica that served the last turn holds most of it in
its KV cache, including the reply's blocks that no digest has reported yet. The policy
ranks that replica first while it is under the load guard (policy.py, "sticky").

One router's memory only: a turn routed by another router instance is not here, and then
the policy falls back to the cost model (the digests show the history on that replica)
with the session key's rendezvous weight as tiebreak, which every router computes alike.

    session key ──► (replica id, expires_s)     refreshed by every routed turn

Bounded and time-ordered: a refreshed entry is re-inserted at the end, so with one TTL the
dict's insertion order is expiry order; expired entries are dropped from the front and the
oldest goes first when `max_sessions` is reached. O(1) amortized per call. Time is a parameter.
"""

from __future__ import annotations


class SessionTable:
    """Last replica per session key, expiring after `ttl_s` without a new turn."""

    def __init__(self, ttl_s: float, max_sessions: int = 65_536):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be positive, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._last: dict[str, tuple[str, float]] = {}  # session key → (replica id, expires_s)

    def remember(self, session_key: str, replica_id: str, now_s: float) -> None:
        """Record that `session_key`'s turn went to `replica_id` at `now_s`."""
        last = self._last
        last.pop(session_key, None)
        last[session_key] = (replica_id, now_s + self.ttl_s)
        while last:
            oldest = next(iter(last))
            if len(last) <= self.max_sessions and last[oldest][1] > now_s:
                break
            del last[oldest]

    def last_replica(self, session_key: str, now_s: float) -> str | None:
        """The replica of the session's last turn, or None if unknown or expired."""
        entry = self._last.get(session_key)
        if entry is None or entry[1] <= now_s:
            return None
        return entry[0]

    def forget_replica(self, replica_id: str) -> None:
        """Drop the sessions pinned to a replica that went away (rare, so O(sessions) is fine)."""
        for key in [k for k, (rid, _) in self._last.items() if rid == replica_id]:
            del self._last[key]

    def __len__(self) -> int:
        return len(self._last)
