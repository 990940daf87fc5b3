"""Where one stream's TTFT goes in direct mode: the whole path against its parts, one request at a time.

    python -m kvtide.benchmarks.ttft_paths kvtide [-n 80] [--words 20]   (a running `kvtide serve`, one engine replica)
    python -m kvtide.benchmarks.ttft_paths bare --port 8600     (a bare vLLM server with the same engine flags)
    python -m kvtide.benchmarks.ttft_paths consults [--batches 8] [--per-batch 100] [--words 480]
        (the routing peer alone: batches of consults, each batch's p50 beside a short-prompt batch's,
        to see whether a consult grows as the peer routes more requests)

For kvtide, each round sends three requests with fresh 480-word prompts (~1,100 tokens of the
demo tokenizer; no prefix-cache hits), the full path first in even rounds and last in odd ones,
then one short consult:
    full     client → HAProxy → (Lua: consult the routing peer) → engine replica → first token
    consult  client → routing peer's POST /internal/route alone (a new connection each time, as
             HAProxy's Lua opens one per request)
    replica  client → the engine replica's own port, with the peer's headers (token ids), so the
             replica does what it does behind HAProxy
    consult-short  the consult alone for a 5-word prompt, last in each round: with `consult` it
             splits the consult into its fixed part (HTTP hop, Serve, ranking) and what grows with
             the prompt (tokenizing, hashing, the token-id header)
so full − replica is what HAProxy and the consult add, and replica − bare is what the replica and
its engine add. The ports are read from the HAProxy config Ray Serve wrote last. TTFT is the first
SSE chunk carrying tokens, by the load generator's own test (`chunk_has_tokens`).
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import random
import re
import statistics
import time

from kvtide.benchmarks.loadgen import chunk_has_tokens

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
HAPROXY_DIR_GLOB = "/tmp/haproxy-serve/*/ingress_request_router.lua"
SHORT_CONSULT_WORDS = 5


def direct_mode_ports(lua_text: str, haproxy_cfg: str) -> tuple[int, int]:
    """(routing peer port, first engine replica port) from Ray Serve's HAProxy Lua and config."""
    peer = re.search(r"port = (\d+)", lua_text)
    replica = re.search(r"server SERVE_REPLICA_\S+ [\d.]+:(\d+)", haproxy_cfg)
    if peer is None or replica is None:
        raise ValueError("no routing peer or engine replica in the HAProxy files (is kvtide serving in direct mode?)")
    return int(peer.group(1)), int(replica.group(1))


def latest_haproxy_files() -> tuple[str, str]:
    lua = max(glob.glob(HAPROXY_DIR_GLOB), key=os.path.getmtime)
    with open(lua) as f, open(os.path.join(os.path.dirname(lua), "haproxy.cfg")) as g:
        return f.read(), g.read()


def request_body(rng: random.Random, model: str, serial: int, words: int = 480) -> bytes:
    # A leading serial number makes every prompt's first block unique: no prefix-cache hits.
    prompt = f"{serial} " + " ".join(rng.choice(WORDS) for _ in range(words))
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True,
                       "return_token_ids": True}).encode()


def first_token_s(port: int, body: bytes, headers: dict[str, str] | None = None) -> float | None:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        first = None
        while line := resp.readline():
            if first is None and line.startswith(b"data:") and line[5:].strip() != b"[DONE]" \
                    and chunk_has_tokens(json.loads(line[5:])):
                first = time.perf_counter() - start
        return first
    finally:
        conn.close()


def consult_s(port: int, body: bytes) -> tuple[float, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    try:
        start = time.perf_counter()
        conn.request("POST", "/internal/route", body, {"Content-Type": "application/json"})
        answer = json.loads(conn.getresponse().read())
        return time.perf_counter() - start, answer.get("request_headers") or {}
    finally:
        conn.close()


def describe(samples_s: list[float]) -> str:
    ms = sorted(1000 * s for s in samples_s)
    return (f"n={len(ms)} p50 {statistics.median(ms):.1f} ms, p25 {ms[len(ms) // 4]:.1f}, "
            f"p75 {ms[3 * len(ms) // 4]:.1f}, min {ms[0]:.1f}")


def round_order(round_index: int) -> tuple[str, ...]:
    """The order of kvtide's three paths in a round: the full path first, then last, in turn.

    A request sent straight after another meets the engine and the processes still busy with
    the last one (seen on CPU: whichever path went second read up to ~10 ms slower), so neither
    the full path nor the replica alone may always pay it. The consult precedes the replica
    request: it supplies that request's headers.
    """
    return ("full", "consult", "replica") if round_index % 2 == 0 else ("consult", "replica", "full")


def measure_paths(server: str, port: int, model: str, rounds: int, seed: int = 1,
                  words: int = 480) -> dict[str, list[float]]:
    """Path name → first-token seconds over `rounds` rounds (after 5 unmeasured ones), one request at a time.

    `server` is "kvtide" (a kvtide serve in direct mode on `port`: full / consult / replica) or
    "bare" (a vLLM server on `port`). `benchmarks.overhead --ttft-paths` calls it on each server.
    """
    rng = random.Random(seed)
    paths: dict[str, list[float]] = {}
    if server == "kvtide":
        peer_port, replica_port = direct_mode_ports(*latest_haproxy_files())
    for i in range(-5, rounds):
        if server == "bare":
            got = {"bare": first_token_s(port, request_body(rng, model, 3 * i, words))}
        else:
            got = {}
            for path in round_order(i):
                if path == "full":
                    got["full"] = first_token_s(port, request_body(rng, model, 3 * i, words))
                elif path == "consult":
                    body = request_body(rng, model, 3 * i + 1, words)
                    got["consult"], headers = consult_s(peer_port, body)
                else:
                    got["replica"] = first_token_s(replica_port, body, headers)
            got["consult-short"], _ = consult_s(peer_port, request_body(rng, model, 3 * i + 2, SHORT_CONSULT_WORDS))
        if i >= 0:
            for path, seconds in got.items():
                if seconds is not None:
                    paths.setdefault(path, []).append(seconds)
            if got.get("full") is not None and got.get("replica") is not None:
                # Paired by round: the engine's drift between rounds cancels.
                paths.setdefault("full - replica", []).append(got["full"] - got["replica"])
    return paths


def consult_batches(model: str, batches: int, per_batch: int, words: int,
                    seed: int = 1) -> list[dict[str, list[float]]]:
    """Per batch: consult seconds for `per_batch` fresh `words`-word prompts, then as many 5-word ones.

    Against a running `kvtide serve` in direct mode (the peer's port from HAProxy's files).
    Every prompt is new, as in `measure_paths`, so the peer's routing state grows as it would.
    """
    rng = random.Random(seed)
    peer_port, _ = direct_mode_ports(*latest_haproxy_files())
    out = []
    for batch in range(batches):
        got: dict[str, list[float]] = {"long": [], "short": []}
        for kind, n_words in (("long", words), ("short", SHORT_CONSULT_WORDS)):
            for i in range(per_batch):
                seconds, _ = consult_s(peer_port, request_body(rng, model, (2 * batch + (kind == "short")) * per_batch + i,
                                                               n_words))
                got[kind].append(seconds)
        out.append(got)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("server", choices=("kvtide", "bare", "consults"))
    parser.add_argument("--port", type=int, default=8000, help="kvtide's HTTP port, or the bare server's")
    parser.add_argument("--model", default="kvtide-demo")
    parser.add_argument("-n", type=int, default=80, help="rounds (after 5 unmeasured ones)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--words", type=int, default=480,
                        help="prompt words; a short prompt keeps the engine's spread from hiding the path's")
    parser.add_argument("--batches", type=int, default=8, help="consults: batches")
    parser.add_argument("--per-batch", type=int, default=100, help="consults: consults of each length per batch")
    args = parser.parse_args(argv)
    if args.server == "consults":
        for batch, got in enumerate(consult_batches(args.model, args.batches, args.per_batch, args.words, args.seed)):
            print(f"batch {batch}: {args.words} words {describe(got['long'])}; "
                  f"{SHORT_CONSULT_WORDS} words {describe(got['short'])}", flush=True)
        return 0
    for path, samples in measure_paths(args.server, args.port, args.model, args.n, args.seed, args.words).items():
        print(f"{path:8s} {describe(samples)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
