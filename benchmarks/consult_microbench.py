"""The routing peer's own work per consult, in-process and by part, as consults accumulate.

HAProxy consults the peer before it forwards every POST, so this work is on every request's
TTFT. Each consult here does what `RouterPeer.route` does between the HTTP body and the JSON
answer, without Ray or HTTP: read + validate + tokenize the body and hash its blocks
(`routing_prompt_and_hashes`), count it in the hot-prefix tracker, rank the one replica and
book the pick (`RouterState`, `FleetView`), and build the token-id header. Prompts are fresh
(a leading serial number: every first block unique, as in `benchmarks.ttft_paths`), so after
`HotPrefixTracker.max_entries` of them every consult meets a full tracker.

    .venv/bin/python -m kvtide.benchmarks.consult_microbench [--batches 10] [--per-batch 300] [--words 480]

Prints one line per batch: the median ms of each part and of the whole consult.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

PARTS = ("tokenize", "hot_prefixes", "rank_and_book", "header", "consult")


def demo_prompts() -> tuple[Any, Any]:
    """The embedded demo config (served as 'kvtide-demo') and a PromptBuilder over its tokenizer."""
    from kvtide.config import default_config_path, load_config
    from kvtide.deployments.engine.demo_model import resolve_model
    from kvtide.deployments.frontend.prompts import PromptBuilder, load_tokenizer

    config = load_config(default_config_path(), [f"model={resolve_model('demo')}", "served_model_name=kvtide-demo"])
    return config, PromptBuilder(config, load_tokenizer(config))


def run(batches: int, per_batch: int, words: int, seed: int = 1, config: Any = None,
        prompts: Any = None) -> list[dict[str, float]]:
    """Per batch, the median ms of each part of a consult (PARTS), over `per_batch` fresh prompts.

    `config`, `prompts`: a KvtideConfig serving model name "kvtide-demo" and its PromptBuilder
    (default: the demo model's, `demo_prompts`).
    """
    from kvtide.benchmarks.ttft_paths import request_body
    from kvtide.deployments.frontend.hot_prefixes import HotPrefixTracker
    from kvtide.deployments.messages import RoutingKey
    from kvtide.deployments.router_peer import route_headers, routing_prompt_and_hashes
    from kvtide.deployments.routing.fleet import DIGEST_SLICE_BLOCKS, FleetView
    from kvtide.deployments.routing.policy import RouterState

    if config is None or prompts is None:
        config, prompts = demo_prompts()
    block_size = config.engine.block_size
    state = RouterState(config.routing, block_size)
    fleet = FleetView(state, slice_blocks=DIGEST_SLICE_BLOCKS)
    fleet.sync({"replica-1": {}})
    tracker = HotPrefixTracker(block_size)
    rng = random.Random(seed)
    out = []
    for batch in range(batches):
        times: dict[str, list[float]] = {part: [] for part in PARTS}
        for i in range(per_batch):
            body = request_body(rng, "kvtide-demo", batch * per_batch + i, words)
            t0 = time.perf_counter()
            prompt, hashes, _ = routing_prompt_and_hashes(prompts, body, block_size)
            t1 = time.perf_counter()
            tracker.observe(prompt.token_ids, hashes, time.monotonic())
            t2 = time.perf_counter()
            now_s = time.monotonic()
            decision = state.rank(hashes, fleet.snapshots([("replica-1", 0)]), rng, now_s=now_s)
            fleet.book_pick("replica-1", len(hashes) * block_size - decision.matched_tokens)
            state.on_routed("replica-1", hashes, now_s)
            t3 = time.perf_counter()
            route_headers(prompts, prompt.token_ids, RoutingKey(block_hashes=hashes, session_key=None, prompt=None),
                          1 << 20)
            t4 = time.perf_counter()
            for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                times[part].append(seconds * 1e3)
        out.append({part: statistics.median(values) for part, values in times.items()})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--per-batch", type=int, default=300)
    parser.add_argument("--words", type=int, default=480)
    args = parser.parse_args(argv)
    for batch, row in enumerate(run(args.batches, args.per_batch, args.words)):
        print(f"batch {batch}: " + ", ".join(f"{part} {ms:.3f}" for part, ms in row.items()) + " (ms, medians)",
              flush=True)


if __name__ == "__main__":
    main()
