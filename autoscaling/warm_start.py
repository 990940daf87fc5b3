"""Cache-warm scale-up: which hot prefixes a new replica prefills before it takes traffic.

A replica added under load starts with an empty prefix cache, so the first requests the
router sends it pay full prefill for system prompts every other replica already holds.
Prefilling the hottest shared prefixes first turns that cold start into a warm one.

The router knows the hot prefixes as `(prefix_token_ids, hits)`; this module picks
which to prefill. The engine replica runs the prefills (sequentially, so a prefix's
stem cached by one prefill is reused by the next).

Choice, greedy by hits (each hit on a prefix saves that prefix's prefill, so hits are
the benefit per prefilled token):

    hot prefixes ──► merge duplicates, cut to whole KV blocks ──► sort by hits desc
        ──► for each: cost = tokens not already cached by a chosen prefix
                      (the longest common prefix with the chosen ones is free:
                       vLLM's prefix cache shares those blocks)
                      take it if cost fits the remaining budget, and drop chosen
                      prefixes it extends (prefilling it caches them too)

    budget = min(token_budget, kv_capacity_tokens × max_kv_fraction)

Tokens are counted once per distinct cached token (a trie's node count), which is both
what the prefills compute and what the KV cache holds. Warm prefixes never fill more
than `max_kv_fraction` of the cache, so the first real requests have room.

A hot prefix may carry a cache salt (a tenant's, deployments/tenancy.py): its blocks are
cached under that salt only, so it shares no blocks with a prefix of another salt (or none)
and is prefilled with its salt. An entry is (tokens, hits) or (tokens, hits, salt).
"""

from __future__ import annotations

from typing import Iterable, Sequence


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def fleet_view(views: Iterable[object]) -> list[tuple[Sequence[int], float]]:
    """One hot-prefix list from every router's own (a broadcast's results; failures skipped).

    Each routing peer (one per node) or ingress replica sees only the traffic it routes, so a
    new replica asks all of them; `plan_warmup` sums the hits of a prefix several report.
    """
    merged: list[tuple[Sequence[int], float]] = []
    for view in views:
        if isinstance(view, list):
            merged.extend(view)
    return merged


# A prefix as planned: its cache salt ("" for none) and its tokens; prefixes of different salts share no block.
_Prefix = tuple[str, tuple[int, ...]]


def _merge(hot_prefixes: Iterable[Sequence], block_size: int) -> dict[_Prefix, int]:
    """Duplicates summed; cut to whole blocks (vLLM caches only full blocks); empty or hitless dropped."""
    merged: dict[_Prefix, int] = {}
    for entry in hot_prefixes:
        token_ids, hits = entry[0], entry[1]
        salt = entry[2] if len(entry) > 2 and entry[2] else ""
        cut = len(token_ids) - len(token_ids) % block_size
        if cut <= 0 or hits <= 0:
            continue
        key = (salt, tuple(token_ids[:cut]))
        merged[key] = merged.get(key, 0) + hits
    return merged


def _shared_len(a: _Prefix, b: _Prefix) -> int:
    """Tokens `a` and `b` share in the cache: their common prefix, under one salt only."""
    return _common_prefix_len(a[1], b[1]) if a[0] == b[0] else 0


def plan_warmup(hot_prefixes: Sequence[Sequence], token_budget: int, kv_capacity_tokens: int, max_prefixes: int,
                *, max_kv_fraction: float = 0.5, block_size: int = 1) -> list[list[int]]:
    """The token ids of plan_prefills' prefixes (for a view without salts)."""
    return [tokens for tokens, _ in plan_prefills(hot_prefixes, token_budget, kv_capacity_tokens, max_prefixes,
                                                  max_kv_fraction=max_kv_fraction, block_size=block_size)]


def plan_prefills(
    hot_prefixes: Sequence[Sequence],
    token_budget: int,
    kv_capacity_tokens: int,
    max_prefixes: int,
    *,
    max_kv_fraction: float = 0.5,
    block_size: int = 1,
) -> list[tuple[list[int], str | None]]:
    """Prefixes a new replica should prefill, hottest first, each with its cache salt (None: none); none is a
    prefix of another under the same salt.

    `hot_prefixes`: the router's view, (prefix token ids, hits[, salt]). `token_budget`: most
    tokens to prefill. `kv_capacity_tokens`: the replica's KV cache size in tokens.
    `max_prefixes`: most prompts to prefill. `block_size`: the engine's KV block size.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    budget_tokens = min(token_budget, int(kv_capacity_tokens * max_kv_fraction))
    if budget_tokens <= 0 or max_prefixes <= 0:
        return []
    candidates = sorted(_merge(hot_prefixes, block_size).items(),
                        key=lambda item: (-item[1], len(item[0][1]), item[0]))

    chosen: list[_Prefix] = []
    used_tokens = 0
    for prefix, _hits in candidates:
        cached = max((_shared_len(prefix, c) for c in chosen), default=0)
        cost = len(prefix[1]) - cached
        if cost == 0:
            continue  # already cached by a longer chosen prefix
        if used_tokens + cost > budget_tokens:
            continue  # a shorter, less hot prefix may still fit
        extended = [c for c in chosen if c[0] == prefix[0] and len(c[1]) <= len(prefix[1])
                    and prefix[1][: len(c[1])] == c[1]]
        if len(chosen) - len(extended) + 1 > max_prefixes:
            continue
        # An extension takes the place of the hottest prefix it covers, keeping hottest-first order.
        slot = chosen.index(extended[0]) if extended else len(chosen)
        chosen.insert(slot, prefix)
        chosen = [c for c in chosen if c not in extended]
        used_tokens += cost
    return [(list(tokens), salt or None) for salt, tokens in chosen]
