"""A scale-down episode on a Zipf shared-prefix load: which replica leaves, kvtide's choice or Ray's.

    python -m kvtide.benchmarks.scale_down --config config/presets/gpu-demo.yaml --set ... \\
        --choosers cache_aware,ray --out-dir benchmarks/results/<dir>

Per chooser (`autoscaling.scale_down_chooser`), one local cluster: three active engine replicas
(`replicas.initial_replicas`, min 2, max 3: exactly one scale-down), then a steady open-loop load of
requests over `--groups` system prompts (the first `--groups` requests take each once, so every prompt
is cached somewhere; then Zipf(`--zipf-s`)), each with a question of its own and one output token (the
latency of a non-streamed one-token request is its TTFT). The load keeps the KV cache cool, so the KV
law scales down after `autoscaling.downscale_delay_s`:
- cache_aware: the replica whose cache is worth least (recent hit tokens only it held, the rest at a
  tenth) goes to standby (kvtide's choice, autoscaling/standby.py);
- ray: Serve's count drops and Ray stops a replica of its choosing (Ray 2.60: the newest on the
  node with fewest replicas).

With `--shift-at-s S` the load shifts at S seconds to the prompts that the replica Ray would stop
served last (the Serve controller's newest RUNNING replica): the case where the replica Ray removes
holds the cache still in use, as after a scale-up for a tenant that stays while the older tenants
leave. After the shift the kept prompts keep their Zipf weights (`--shift-draw zipf`), or are drawn
alike (`uniform`: each is in demand in the window). Without a shift, prefix-aware routing spreads
the Zipf load so every replica's cache is worth about the same.

Reported per chooser (autoscale.json → "scale_down", merged into the file autoscale.py writes):
- decision_s: trace start → the first sample with one active replica fewer
- hit_rate / ttft_p90_ms: over the requests sent within `--window-s` after the decision
  (hit rate: cached prompt tokens / prompt tokens, from each response's usage)
- hit_rate_before / ttft_p90_before_ms: the same over the window before the decision
- removed_replica, removed_share_of_hits_before: the replica that left routing and its share
  of the hit tokens served in the window before (what the choice threw away)
- requests, errors; reprefills_after (requests in the window that found under half their prompt
  cached) and groups_after (the groups the window drew): what the hit rate after is made of
- shift (with --shift-at-s): when, Ray's would-be victim then, the groups kept
Per request ("scale_down_details" → "requests"): sent_s, ok, latency_s, replica, prompt_tokens,
cached_tokens, group.
Bounded: the trace ends `--window-s` after the decision or at `--max-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx

from kvtide.benchmarks.autoscale import WORDS, _poll_replicas, _poll_standby
from kvtide.benchmarks.report import percentile

CHOOSERS = ("cache_aware", "ray")
# One scale-down, 3 → 2, after the caches formed; the second would come a downscale delay later.
EPISODE_OVERRIDES = [
    "replicas.num_replicas=null", "replicas.min_replicas=2", "replicas.max_replicas=3",
    "replicas.initial_replicas=3", "autoscaling.policy=kv", "autoscaling.standby_replicas=0",
    "autoscaling.standby_timeout_s=3600", "autoscaling.max_step=1", "autoscaling.scale_down_cooldown_s=0",
    "autoscaling.look_back_s=10", "autoscaling.metrics_push_interval_s=1", "autoscaling.downscale_delay_s=60",
]


@dataclass
class Request:
    sent_s: float
    ok: bool
    latency_s: float | None
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    group: int = -1


@dataclass
class Episode:
    chooser: str
    requests: list[Request] = field(default_factory=list)
    samples: list[tuple[float, int, tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)  # t, target, live, standby
    shift: dict[str, Any] = field(default_factory=dict)  # at_s, ray_victim, kept_groups (with --shift-at-s)


def zipf_weights(num_groups: int, s: float) -> list[float]:
    """P(group g) ∝ 1 / (g + 1)^s."""
    raw = [1.0 / (g + 1) ** s for g in range(num_groups)]
    total = sum(raw)
    return [w / total for w in raw]


def groups_last_served_by(requests: Sequence[Request], replica: str) -> list[int]:
    """The groups whose latest successful request (by send time) the replica served."""
    last: dict[int, str] = {}
    for r in sorted((r for r in requests if r.ok and r.group >= 0), key=lambda r: r.sent_s):
        last[r.group] = r.replica
    return sorted(g for g, served_by in last.items() if served_by == replica)


def next_group(i: int, rng: random.Random, weights: Sequence[float], kept: Sequence[int] | None,
               kept_uniform: bool = False) -> int:
    """Request i's group: each group once in order first, then Zipf over all, or over `kept` after a shift.

    After a shift the kept groups keep their Zipf weights (the hottest takes most draws, so few of
    the others come in a window), or with `kept_uniform` are drawn alike (every kept prompt in demand).
    """
    if kept is not None:
        return rng.choices(kept, None if kept_uniform else [weights[g] for g in kept])[0]
    if i < len(weights):
        return i
    return rng.choices(range(len(weights)), weights)[0]


def ray_victim(app: str) -> str:
    """The engine replica Ray 2.60 stops first on a one-node cluster: the newest RUNNING one
    (DeploymentScheduler._get_replicas_to_stop orders running replicas newest first; the controller's
    replica container keeps the same insertion order). A private controller call: benchmarks only."""
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaState
    from ray.serve.context import _get_global_client

    from kvtide.deployments.names import ENGINE_DEPLOYMENT

    controller = _get_global_client()._controller
    container = ray.get(controller._dump_replica_states_for_testing.remote(
        DeploymentID(name=ENGINE_DEPLOYMENT, app_name=app)))
    running = container.get([ReplicaState.RUNNING])
    return running[-1].replica_id.unique_id if running else ""


def decision_time(samples: Sequence[tuple[float, int, tuple[str, ...], tuple[str, ...]]]) -> float | None:
    """The first sample whose active count (target less standbys) is below the first sample's."""
    if not samples:
        return None
    first = samples[0][1] - len(samples[0][3])
    return next((t for t, target, _, standby in samples if target - len(standby) < first), None)


def removed_replica(samples: Sequence[tuple[float, int, tuple[str, ...], tuple[str, ...]]], at_s: float) -> str:
    """The replica that left routing at the decision: gone from the live set, or new among standbys."""
    before = [s for s in samples if s[0] < at_s]
    after = [s for s in samples if s[0] >= at_s]
    if not before or not after:
        return ""
    serving_before = set(before[-1][2]) - set(before[-1][3])
    for _, _, live, standby in after:
        left = serving_before - (set(live) - set(standby))
        if left:
            return sorted(left)[0]
    return ""


def window_stats(requests: Sequence[Request], start_s: float, end_s: float) -> dict[str, Any]:
    inside = [r for r in requests if start_s <= r.sent_s < end_s]
    ok = [r for r in inside if r.ok and r.latency_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {"hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
            "ttft_p90_ms": percentile([r.latency_s for r in ok], 90) * 1000 if ok else None,
            "requests": len(inside), "errors": len(inside) - len(ok),
            # What the hit rate is made of: requests that found under half their prompt cached
            # (their group prefilled anew), and how many groups the window drew at all.
            "reprefills": sum(1 for r in ok if r.cached_tokens * 2 < r.prompt_tokens),
            "groups": len({r.group for r in inside if r.group >= 0})}


def summarize(episode: Episode, window_s: float) -> dict[str, Any]:
    decided = decision_time(episode.samples)
    row: dict[str, Any] = {"decision_s": decided}
    if decided is None:
        return {**row, **window_stats(episode.requests, 0.0, float("inf")), "hit_rate_before": None,
                "ttft_p90_before_ms": None, "removed_replica": "", "removed_share_of_hits_before": None}
    after = window_stats(episode.requests, decided, decided + window_s)
    before = window_stats(episode.requests, decided - window_s, decided)
    removed = removed_replica(episode.samples, decided)
    hits_before = [r for r in episode.requests if decided - window_s <= r.sent_s < decided and r.ok]
    total_hits = sum(r.cached_tokens for r in hits_before)
    removed_hits = sum(r.cached_tokens for r in hits_before if r.replica == removed)
    return {**row, "hit_rate": after["hit_rate"], "ttft_p90_ms": after["ttft_p90_ms"],
            "hit_rate_before": before["hit_rate"], "ttft_p90_before_ms": before["ttft_p90_ms"],
            "removed_replica": removed,
            "removed_share_of_hits_before": removed_hits / total_hits if total_hits else None,
            "requests": after["requests"], "errors": after["errors"],
            "reprefills_after": after["reprefills"], "groups_after": after["groups"],
            **({"shift": episode.shift} if episode.shift else {})}


async def _drive(base_url: str, model: str, app: str, episode: Episode, *, groups: int, zipf_s: float,
                 prefix_words: int, question_words: int, rate: float, window_s: float, max_s: float,
                 seed: int, shift_at_s: float | None = None, kept_uniform: bool = False) -> None:
    rng = random.Random(seed)
    prefixes = [" ".join(random.Random(seed * 131 + g).choice(WORDS) for _ in range(prefix_words))
                for g in range(groups)]
    weights = zipf_weights(groups, zipf_s)
    from kvtide.benchmarks.loadgen import client_limits

    limits = client_limits(None)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        start = time.monotonic()
        tasks: list[asyncio.Task] = []
        end_s = [max_s]
        kept: list[list[int] | None] = [None]

        async def one(i: int) -> None:
            group = next_group(i, rng, weights, kept[0], kept_uniform)
            question = " ".join(rng.choice(WORDS) for _ in range(question_words))
            sent = time.monotonic() - start
            t1 = time.perf_counter()
            try:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": f"{prefixes[group]} question {i}: {question}?", "max_tokens": 1})
                if r.status_code != 200:
                    episode.requests.append(Request(sent, False, None, group=group))
                    return
                usage = r.json().get("usage", {})
                episode.requests.append(Request(
                    sent, True, time.perf_counter() - t1, r.headers.get("x-kvtide-replica", ""),
                    int(usage.get("prompt_tokens", 0)),
                    int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0), group))
            except httpx.HTTPError:
                episode.requests.append(Request(sent, False, None, group=group))

        async def arrivals() -> None:
            i = 0
            while time.monotonic() - start < end_s[0]:
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals: pacing, not synchronisation
                tasks.append(asyncio.create_task(one(i)))
                i += 1

        async def shift() -> None:
            await asyncio.sleep(shift_at_s)  # the trace's shift time: a schedule, not synchronisation
            try:
                victim = await asyncio.to_thread(ray_victim, app)
            except Exception as exc:  # without the victim the load stays as it was, and says why
                episode.shift = {"at_s": shift_at_s, "ray_victim": "", "kept_groups": [],
                                 "error": f"{type(exc).__name__}: {exc}"[:200]}
                return
            chosen = groups_last_served_by(episode.requests, victim)
            episode.shift = {"at_s": shift_at_s, "ray_victim": victim, "kept_groups": chosen}
            kept[0] = chosen or None

        async def watch() -> None:
            while (t := time.monotonic() - start) < end_s[0]:
                _, target, live = await asyncio.to_thread(_poll_replicas, app)
                standby = await asyncio.to_thread(_poll_standby, app)
                episode.samples.append((t, target, live, standby))
                decided = decision_time(episode.samples)
                if decided is not None:
                    end_s[0] = min(end_s[0], decided + window_s + 1.0)
                await asyncio.sleep(1.0)  # a sampling period, not synchronisation

        await asyncio.gather(arrivals(), watch(), *([shift()] if shift_at_s is not None else []))
        await asyncio.gather(*tasks)


def run_episode(chooser: str, config: Any, args: argparse.Namespace) -> Episode:
    from kvtide.cluster import local

    print(f"scale_down: {chooser}: starting ...", flush=True)
    cluster = local.start(config, metrics_report_interval_ms=args.metrics_interval_ms)
    try:
        episode = Episode(chooser)
        asyncio.run(_drive(cluster.base_url, cluster.model_name, local.APP_NAME, episode, groups=args.groups,
                           zipf_s=args.zipf_s, prefix_words=args.prefix_words, question_words=args.question_words,
                           rate=args.rate, window_s=args.window_s, max_s=args.max_s, seed=args.seed,
                           shift_at_s=args.shift_at_s, kept_uniform=args.shift_draw == "uniform"))
    finally:
        local.stop()
    return episode


def merge_into(out_dir: Path, hardware: str, scale_down: dict[str, Any], extras: dict[str, Any]) -> Path:
    """autoscale.json gains "scale_down" (the file autoscale.py writes keeps it when it rewrites)."""
    path = out_dir / "autoscale.json"
    data = json.loads(path.read_text()) if path.exists() else {"hardware": hardware, "variants": []}
    from kvtide.benchmarks.protocol import provenance

    data["scale_down"] = scale_down
    data["scale_down_details"] = extras
    data["scale_down_provenance"] = provenance(["kvtide", *sys.argv[1:]])
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def markdown(rows: dict[str, Any], command: str, window_s: float) -> str:
    def f(v: Any, scale: float = 1.0, digits: int = 0) -> str:
        return "–" if v is None else f"{v * scale:.{digits}f}"

    lines = ["## Scale-down episode: which replica leaves", "", "Command:", "", f"    {command}", "",
             f"Hit rate and TTFT p90 over the requests sent in the {window_s:.0f} s after the scale-down decision "
             "(and, for reference, the window before it).", "",
             "| chooser | decision (s) | hit rate after | TTFT p90 after (ms) | hit rate before | TTFT p90 before (ms) "
             "| removed replica's share of hits before | requests after (re-prefills, groups) | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for chooser, r in rows.items():
        mix = f" ({r['reprefills_after']}, {r['groups_after']})" if "reprefills_after" in r else ""
        lines.append(f"| {chooser} | {f(r['decision_s'], digits=1)} | {f(r['hit_rate'], digits=3)} "
                     f"| {f(r['ttft_p90_ms'])} | {f(r['hit_rate_before'], digits=3)} | {f(r['ttft_p90_before_ms'])} "
                     f"| {f(r['removed_share_of_hits_before'], digits=3)} | {r['requests']}{mix} | {r['errors']} |")
    shifted = [(chooser, r["shift"]) for chooser, r in rows.items() if r.get("shift")]
    if shifted:
        lines.append("")
    for chooser, shift in shifted:
        lines.append(f"- {chooser}: at {shift['at_s']:.0f} s the load narrowed to groups {shift['kept_groups']}, last "
                     f"served by `{shift['ray_victim'] or '?'}` (the replica Ray would stop then; removed: "
                     f"`{rows[chooser]['removed_replica'] or '–'}`){' — ' + shift['error'] if shift.get('error') else ''}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", "-c", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--choosers", default=",".join(CHOOSERS))
    parser.add_argument("--hardware", default="unknown")
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--prefix-words", type=int, default=2000)
    parser.add_argument("--question-words", type=int, default=30)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    parser.add_argument("--window-s", type=float, default=55.0)
    parser.add_argument("--max-s", type=float, default=240.0)
    parser.add_argument("--metrics-interval-ms", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shift-at-s", type=float, default=None,
                        help="at this time the load narrows to the prompts last served by the replica Ray would stop")
    parser.add_argument("--shift-draw", choices=("zipf", "uniform"), default="zipf",
                        help="after the shift, draw the kept prompts by their Zipf weight or alike")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    from kvtide.config import load_config

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m kvtide.benchmarks.scale_down " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows: dict[str, Any] = {}
    extras: dict[str, Any] = {"command": command, "overrides": [*EPISODE_OVERRIDES, *args.overrides],
                              "trace": {k: getattr(args, k) for k in ("groups", "zipf_s", "prefix_words",
                                                                       "question_words", "rate", "window_s", "shift_at_s",
                                                                       "shift_draw")},
                              "samples": {}, "requests": {}, "failed": {}}
    for chooser in [c.strip() for c in args.choosers.split(",") if c.strip()]:
        try:
            config = load_config(args.config, [*EPISODE_OVERRIDES, *args.overrides,
                                               f"autoscaling.scale_down_chooser={chooser}"])
            episode = run_episode(chooser, config, args)
        except Exception as exc:  # one chooser failing must not lose the other's numbers
            print(f"scale_down: {chooser} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            extras["failed"][chooser] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        rows[chooser] = summarize(episode, args.window_s)
        extras["samples"][chooser] = [list(s) for s in episode.samples]
        extras["requests"][chooser] = [astuple(r) for r in episode.requests]
        print(f"scale_down: {chooser}: {rows[chooser]}", flush=True)
        merge_into(out_dir, args.hardware, rows, extras)
        (out_dir / "scale_down.md").write_text(markdown(rows, command, args.window_s))
    return 1 if extras["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
