"""Decision latency of the prefix_aware policy on a large, realistic index, with digests arriving.

Setup (defaults): 32 replicas whose engines together hold 100k blocks; requests of
2,048 tokens (64 blocks of 32) built as shared system prompt + per-user history +
fresh question, so matches are partial and spread over several replicas:

    request = system prompt (Zipf over 256 prompts, 8-40 blocks; the top one ~half the traffic)
            + user history  (0-16 blocks, reused by the same user, who sends a session key)
            + question      (fresh, fills the rest to 64 blocks)

Each engine is an LRU of its share of the blocks. The router state (`RouterState`: the
prefix index, the prefix groups' demand, the session memory) is warmed by routing
requests (200 req/s of simulated time, so ~2,000 requests live in the 10 s routing
history) and by one digest per replica. Then `--decisions` decisions are timed with
`time.perf_counter_ns` around `rank_replicas` alone; every simulated stats period (1 s)
each replica reports a fresh digest, applied between decisions as the Ray adapter does
when stats arrive (`update_replicas`) and timed separately; also timed: the bookkeeping
after a pick (`RouterState.on_routed`) and the request's `block_hashes` (once per request
at the ingress).

    .venv/bin/python -m kvtide.benchmarks.router_microbench --out benchmarks/results/router_microbench.md
    .venv/bin/python -m kvtide.benchmarks.router_microbench --replicas 4 --indexed-blocks 2000 --decisions 500  # smoke
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import random
import sys
import time
from collections import defaultdict

from kvtide.benchmarks.report import percentile
from kvtide.deployments.routing.block_hash import BlockHash, block_hashes
from kvtide.config import RoutingConfig
from kvtide.deployments.routing.policy import RouterState
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot

Request = tuple[list[BlockHash], str | None]  # block hashes, session key


def _request_tokens(rng: random.Random, num_blocks: int, block_size: int, num_prompts: int,
                    num_users: int) -> tuple[list[int], str | None]:
    prompt_id = min(int(rng.paretovariate(1.2)) - 1, num_prompts - 1)  # Zipf-like popularity
    prompt_blocks = 8 + (prompt_id * 7) % 33
    user = rng.randrange(num_users)
    history_blocks = min(user % 17, num_blocks - prompt_blocks)
    fresh_blocks = num_blocks - prompt_blocks - history_blocks
    prompt = [(prompt_id * 9973 + i) % 8192 for i in range(prompt_blocks * block_size)]
    history = [(user * 7919 + i) % 8192 for i in range(history_blocks * block_size)]
    fresh = [rng.randrange(8192) for _ in range(fresh_blocks * block_size)]
    return prompt + history + fresh, (f"user-{user}" if history_blocks else None)


def _loads(rng: random.Random, replicas: list[str]) -> list[ReplicaSnapshot]:
    # Loads around a mean of 8 in flight per replica, spread like a busy but healthy fleet.
    return [ReplicaSnapshot(r, max(0, round(rng.gauss(8, 3)))) for r in replicas]


class _Engines:
    """What each engine holds: an LRU of block hashes (insertion-ordered dict), its share of the total."""

    def __init__(self, replicas: list[str], capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self.held: dict[str, dict[BlockHash, None]] = {r: {} for r in replicas}
        self.sequence = 0

    def store(self, rid: str, hashes: list[BlockHash]) -> None:
        blocks = self.held[rid]
        for h in hashes:
            blocks.pop(h, None)
            blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            del blocks[next(iter(blocks))]

    @property
    def num_held(self) -> int:
        return sum(len(b) for b in self.held.values())

    def digests(self) -> list[CacheDigest]:
        self.sequence += 1
        return [CacheDigest.from_hashes(rid, 1, self.sequence, blocks) for rid, blocks in self.held.items()]


def build_state(args: argparse.Namespace) -> tuple[RouterState, _Engines, list[Request], list[str], float,
                                                   random.Random]:
    """A warmed router state and engines, the request pool, replica ids, the clock, the rng."""
    rng = random.Random(args.seed)
    state = RouterState(RoutingConfig(), args.block_size)
    replicas = [f"replica-{i:02d}" for i in range(args.replicas)]
    # 25 % above an even share, so the fleet reaches the target total before LRU evicts.
    engines = _Engines(replicas, math.ceil(1.25 * args.indexed_blocks / args.replicas))
    step_s = 1.0 / args.rate

    # Warm-up traffic: route, and keep what each engine would hold.
    now_s = 0.0
    requests: list[Request] = []
    for _ in range(args.pool):
        tokens, session = _request_tokens(rng, args.blocks_per_request, args.block_size, 256, 4096)
        requests.append((block_hashes(tokens, args.block_size), session))
    max_warmup = 20 * args.indexed_blocks // max(1, args.blocks_per_request // 2)
    for _ in range(max_warmup):
        if engines.num_held >= args.indexed_blocks:
            break
        hashes, session = requests[rng.randrange(len(requests))]
        rid = state.rank(hashes, _loads(rng, replicas), rng, now_s=now_s, session_key=session).ranked[0]
        state.on_routed(rid, hashes, now_s, session)
        engines.store(rid, hashes)
        now_s += step_s
    for digest in engines.digests():
        state.apply_digest(digest)
    return state, engines, requests, replicas, now_s, rng


def run(args: argparse.Namespace) -> dict:
    state, engines, requests, replicas, now_s, rng = build_state(args)
    step_s = 1.0 / args.rate
    decisions_per_period = max(1, round(args.rate * state.tunables.stats_period_s))

    # Timed decisions, with every replica's digest applied once per simulated stats period.
    rank_ns, routed_ns, hash_ns, digest_ns, outcomes = [], [], [], [], defaultdict(int)
    replicated = sticky = 0
    token_lists = [_request_tokens(rng, args.blocks_per_request, args.block_size, 256, 4096)[0] for _ in range(64)]
    gc.collect()
    for i in range(args.decisions):
        if i and i % decisions_per_period == 0:
            for digest in engines.digests():  # the engine's work, untimed
                t = time.perf_counter_ns()
                state.apply_digest(digest)
                digest_ns.append(time.perf_counter_ns() - t)
        hashes, session = requests[rng.randrange(len(requests))]
        snapshots = _loads(rng, replicas)
        t0 = time.perf_counter_ns()
        decision = state.rank(hashes, snapshots, rng, now_s=now_s, session_key=session)
        t1 = time.perf_counter_ns()
        state.on_routed(decision.ranked[0], hashes, now_s, session)
        t2 = time.perf_counter_ns()
        rank_ns.append(t1 - t0)
        routed_ns.append(t2 - t1)
        outcomes[decision.outcome] += 1
        replicated += decision.prefix_replicas > 1
        sticky += decision.sticky
        engines.store(decision.ranked[0], hashes)
        if i % 16 == 0:
            tokens = token_lists[i % len(token_lists)]
            t3 = time.perf_counter_ns()
            block_hashes(tokens, args.block_size)
            hash_ns.append(time.perf_counter_ns() - t3)
        now_s += step_s

    def us(samples: list[int]) -> dict[str, float]:
        if not samples:
            return {"p50": 0.0, "p99": 0.0}
        return {q: round(percentile(samples, p) / 1000, 1) for q, p in (("p50", 50), ("p99", 99))}

    index = state.index
    return {
        "rank_replicas_us": us(rank_ns),
        "on_routed_us": us(routed_ns),
        "block_hashes_2048_tokens_us": us(hash_ns),
        "apply_digest_us": us(digest_ns),
        "digests_applied": len(digest_ns),
        "digest_us_per_decision": round(sum(digest_ns) / 1000 / args.decisions, 1),
        "outcomes": dict(outcomes),
        "replicated_decisions": replicated,
        "sticky_decisions": sticky,
        "engine_blocks_indexed": index.num_engine_blocks,
        "held_blocks_total": index.num_held_blocks,
        "routed_blocks_indexed": index.num_routed_blocks,
    }


def _markdown(args: argparse.Namespace, result: dict, command: str) -> str:
    rank, routed, hashing = result["rank_replicas_us"], result["on_routed_us"], result["block_hashes_2048_tokens_us"]
    digest = result["apply_digest_us"]
    verdict = "met" if rank["p99"] <= args.target_p99_us else "NOT met"
    return f"""# Router microbenchmark: prefix_aware decision latency

Command:

    {command}

Setup: {args.replicas} replicas, {result['held_blocks_total']:,} blocks held by engines
({result['engine_blocks_indexed']:,} distinct hashes in the index), {result['routed_blocks_indexed']:,} hashes in
the routing history, requests of {args.blocks_per_request * args.block_size:,} tokens
({args.blocks_per_request} blocks of {args.block_size}), {args.decisions:,} timed decisions, seed {args.seed};
every replica reported a fresh digest each simulated second ({result['digests_applied']:,} digests applied
between decisions, as the router does when stats arrive).
Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}.

| step | p50 (µs) | p99 (µs) |
|---|---:|---:|
| `rank_replicas` (match + replicate + score + sort) | {rank['p50']} | {rank['p99']} |
| `RouterState.on_routed` (bookkeeping after the pick) | {routed['p50']} | {routed['p99']} |
| `block_hashes` of 2,048 tokens (once per request, ingress) | {hashing['p50']} | {hashing['p99']} |
| `apply_digest` of one replica's report (when stats arrive, off the decision path) | {digest['p50']} | {digest['p99']} |

Digest application amortized over the decisions: {result['digest_us_per_decision']} µs per decision
(event-loop time, not decision latency).

Target: `rank_replicas` p99 ≤ {args.target_p99_us:.0f} µs — **{verdict}**.

Outcomes over the timed decisions: {', '.join(f'{k}={v}' for k, v in sorted(result['outcomes'].items()))};
{result['replicated_decisions']:,} decisions for a hot prefix group (k ≥ 2),
{result['sticky_decisions']:,} sticky session picks.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--indexed-blocks", type=int, default=100_000, help="blocks held by all engines together")
    parser.add_argument("--blocks-per-request", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--pool", type=int, default=4000, help="distinct requests to draw from")
    parser.add_argument("--rate", type=float, default=200.0, help="simulated requests/s (sets history size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-p99-us", type=float, default=100.0)
    parser.add_argument("--out", help="write the Markdown report here")
    args = parser.parse_args(argv)
    result = run(args)
    print(result)
    if args.out:
        command = ".venv/bin/python -m kvtide.benchmarks.router_microbench " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "w") as f:
            f.write(_markdown(args, result, command))
    return 0 if result["rank_replicas_us"]["p99"] <= args.target_p99_us else 1


if __name__ == "__main__":
    sys.exit(main())
