"""Decision latency of the prefix_aware policy on a large, realistic index.

Setup (defaults): 32 replicas whose engines together hold 100k blocks; requests of
2,048 tokens (64 blocks of 32) built as shared system prompt + per-user history +
fresh question, so matches are partial and spread over several replicas:

    request = system prompt (Zipf over 256 prompts, 8-40 blocks)
            + user history  (0-16 blocks, reused by the same user)
            + question      (fresh, fills the rest to 64 blocks)

The router state is warmed by routing requests (on_routed, 200 req/s of simulated
time, so ~2,000 requests live in the 10 s routing history) and by one digest per
replica holding the blocks routed there. Then `--decisions` decisions are timed with
`time.perf_counter_ns` around `rank_replicas` alone, and separately the bookkeeping
(`on_routed`) and the request's `block_hashes` (done once per request at the ingress).

    .venv/bin/python -m kvtide.benchmarks.router_microbench --out benchmarks/results/router_microbench.md
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections import defaultdict

from kvtide.benchmarks.report import percentile
from kvtide.deployments.routing.block_hash import BlockHash, block_hashes
from kvtide.config import RoutingConfig
from kvtide.deployments.routing.policy import rank_replicas
from kvtide.deployments.routing.prefix_index import PrefixIndex
from kvtide.deployments.routing.snapshot import CacheDigest, ReplicaSnapshot


def _request_tokens(rng: random.Random, num_blocks: int, block_size: int, num_prompts: int,
                    num_users: int) -> list[int]:
    prompt_id = min(int(rng.paretovariate(1.2)) - 1, num_prompts - 1)  # Zipf-like popularity
    prompt_blocks = 8 + (prompt_id * 7) % 33
    user = rng.randrange(num_users)
    history_blocks = min(user % 17, num_blocks - prompt_blocks)
    fresh_blocks = num_blocks - prompt_blocks - history_blocks
    prompt = [(prompt_id * 9973 + i) % 8192 for i in range(prompt_blocks * block_size)]
    history = [(user * 7919 + i) % 8192 for i in range(history_blocks * block_size)]
    fresh = [rng.randrange(8192) for _ in range(fresh_blocks * block_size)]
    return prompt + history + fresh


def _loads(rng: random.Random, replicas: list[str]) -> list[ReplicaSnapshot]:
    # Loads around a mean of 8 in flight per replica, spread like a busy but healthy fleet.
    return [ReplicaSnapshot(r, max(0, round(rng.gauss(8, 3)))) for r in replicas]


def build_state(args: argparse.Namespace) -> tuple[PrefixIndex, list[list[BlockHash]], list[str], float, random.Random]:
    """A warmed index (engine digests + routing history), the request pool, replica ids, the clock, the rng."""
    rng = random.Random(args.seed)
    tunables = RoutingConfig()
    index = PrefixIndex(tunables.history_ttl_s)
    replicas = [f"replica-{i:02d}" for i in range(args.replicas)]
    step_s = 1.0 / args.rate

    # Warm-up traffic: route, and keep what each engine would hold.
    held: dict[str, dict[BlockHash, None]] = defaultdict(dict)  # insertion-ordered sets
    now_s = 0.0
    requests = [block_hashes(_request_tokens(rng, args.blocks_per_request, args.block_size, 256, 4096),
                             args.block_size) for _ in range(args.pool)]
    num_held = 0
    while num_held < args.indexed_blocks:
        hashes = requests[rng.randrange(len(requests))]
        snapshots = _loads(rng, replicas)
        rid = rank_replicas(hashes, args.block_size, snapshots, index, tunables, rng, now_s=now_s).ranked[0]
        index.on_routed(rid, hashes, now_s)
        before = len(held[rid])
        held[rid].update(dict.fromkeys(hashes))
        num_held += len(held[rid]) - before
        now_s += step_s
    for seq, rid in enumerate(replicas):
        index.apply_digest(CacheDigest.from_hashes(rid, 1, seq + 1, held[rid]))
    return index, requests, replicas, now_s, rng


def run(args: argparse.Namespace) -> dict:
    index, requests, replicas, now_s, rng = build_state(args)
    tunables = RoutingConfig()
    step_s = 1.0 / args.rate

    # Timed decisions.
    rank_ns, routed_ns, hash_ns, outcomes = [], [], [], defaultdict(int)
    token_lists = [_request_tokens(rng, args.blocks_per_request, args.block_size, 256, 4096) for _ in range(64)]
    gc.collect()
    for i in range(args.decisions):
        hashes = requests[rng.randrange(len(requests))]
        snapshots = _loads(rng, replicas)
        t0 = time.perf_counter_ns()
        decision = rank_replicas(hashes, args.block_size, snapshots, index, tunables, rng, now_s=now_s)
        t1 = time.perf_counter_ns()
        index.on_routed(decision.ranked[0], hashes, now_s)
        t2 = time.perf_counter_ns()
        rank_ns.append(t1 - t0)
        routed_ns.append(t2 - t1)
        outcomes[decision.outcome] += 1
        if i % 16 == 0:
            tokens = token_lists[i % len(token_lists)]
            t3 = time.perf_counter_ns()
            block_hashes(tokens, args.block_size)
            hash_ns.append(time.perf_counter_ns() - t3)
        now_s += step_s

    def us(samples: list[int]) -> dict[str, float]:
        return {q: round(percentile(samples, p) / 1000, 1) for q, p in (("p50", 50), ("p99", 99))}

    return {
        "rank_replicas_us": us(rank_ns),
        "on_routed_us": us(routed_ns),
        "block_hashes_2048_tokens_us": us(hash_ns),
        "outcomes": dict(outcomes),
        "engine_blocks_indexed": index.num_engine_blocks,
        "held_blocks_total": index.num_held_blocks,
        "routed_blocks_indexed": index.num_routed_blocks,
    }


def _markdown(args: argparse.Namespace, result: dict, command: str) -> str:
    rank, routed, hashing = result["rank_replicas_us"], result["on_routed_us"], result["block_hashes_2048_tokens_us"]
    verdict = "met" if rank["p99"] <= args.target_p99_us else "NOT met"
    return f"""# Router microbenchmark: prefix_aware decision latency

Command:

    {command}

Setup: {args.replicas} replicas, {result['held_blocks_total']:,} blocks held by engines
({result['engine_blocks_indexed']:,} distinct hashes in the index), {result['routed_blocks_indexed']:,} hashes in
the routing history, requests of {args.blocks_per_request * args.block_size:,} tokens
({args.blocks_per_request} blocks of {args.block_size}), {args.decisions:,} timed decisions, seed {args.seed}.
Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}.

| step | p50 (µs) | p99 (µs) |
|---|---:|---:|
| `rank_replicas` (match + score + sort) | {rank['p50']} | {rank['p99']} |
| `PrefixIndex.on_routed` (bookkeeping after the pick) | {routed['p50']} | {routed['p99']} |
| `block_hashes` of 2,048 tokens (once per request, ingress) | {hashing['p50']} | {hashing['p99']} |

Target: `rank_replicas` p99 ≤ {args.target_p99_us:.0f} µs — **{verdict}**.

Outcomes over the timed decisions: {', '.join(f'{k}={v}' for k, v in sorted(result['outcomes'].items()))}.
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
    parser.add_argument("--target-p99-us", type=float, default=200.0)
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
