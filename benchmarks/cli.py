"""`kvtide bench`: run a workload against a server, or compare routing policies side by side.

    kvtide bench run     --url URL --workload NAME (--rate R | --concurrency C) --duration S --out FILE.json
    kvtide bench compare --config FILE --policies bare,pow2,ray_prefix,prefix_aware ... --out DIR
    kvtide bench readme  [--check]   README.md's results block from the committed result files
    kvtide bench trace   --base-url URL --metrics-url URL --model M --tokenizer DIR --block-tokens B --out-dir DIR
                                     a Mooncake-format trace replayed at its arrival times by aiperf
                                     (benchmarks/trace_replay.py)
    kvtide bench agentic --base-url URL [--metrics-url URL] --model M --out-dir DIR
                                     agent sessions with tools through chat, Messages and Responses
                                     (benchmarks/agentic.py)
    kvtide bench router  [--baseline-rev REV --repeats N --out-dir DIR]
                                     the router's decision latency on a simulated index; with
                                     --baseline-rev, before (REV) / after (the working tree)
                                     (benchmarks/router_microbench.py)

`run` measures any OpenAI-compatible server on loopback. `compare` runs the same
workload with the same seed once per entry of --policies, each on a fresh server.
`compare` also sweeps: --workload and --rate / --concurrency take comma-separated lists,
and each server runs every workload at every load in turn (one start per policy, as
engines take minutes to start on a GPU). Each point's seed is --seed plus an offset derived
from the point itself (workload and load, `point_seed_offset`), so a point's prompts are new to
caches the previous point filled, equal across policies, and the same whatever the order
of the lists or whichever subset of them a later run repeats. `--repeats N` runs the whole
comparison N times, rotating the policy order (none always runs first, on a cold machine)
and drawing new prompts each time; results.json holds each policy's median repeat, runs.json
every repeat, and report.md adds their spread. The policies:

    bare          no kvtide: N independent bare vLLM OpenAI servers with kvtide's engine
                  flags (N = replicas.num_replicas, or max_replicas when autoscaling),
                  each on its own cores / GPUs, behind a round-robin HAProxy (Ray's
                  bundled binary; a small Python proxy if there is none) — what a
                  platform team runs without kvtide (benchmarks/bare_fleet.py)
    ray_kv        no kvtide: Ray Serve LLM 2.60's own app (LLMServer replicas, KVAwareRouter,
                  direct streaming), same engine flags and replica count; needs the `bench`
                  extra (ai-dynamo-runtime); on the H200 it needs the vLLM 0.29 stack
                  (benchmarks/h200/stage-vllm029.sh; benchmarks/ray_llm_fleet.py)
    pow2          kvtide's cluster with Ray Serve's power-of-two-choices router (load only)
    round_robin   kvtide's cluster, round robin
    ray_prefix    kvtide's cluster with Ray Serve LLM's prefix-aware router
    prefix_aware  kvtide's cluster with kvtide's prefix-cache-aware router

For a kvtide policy the local cluster starts with `routing.policy=<p>` as a config
override (so the config model rejects an unknown policy before anything starts) and
stops after the run. Ratios in the report are against `bare` if it ran, else `pow2`,
else the first policy. Every run reports goodput: successful requests per second whose
TTFT met --slo-ttft-s. Writes DIR/results.json, DIR/report.md,
DIR/<policy>.requests.jsonl, PNG plots, and for `bare` its logs under DIR/bare/.

`register(subparsers)` adds the `bench` command to the kvtide CLI's subparsers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Union

import httpx

from kvtide.benchmarks import readme_results
from kvtide.benchmarks import agentic, router_microbench, trace_replay
from kvtide.benchmarks.loadgen import DEFAULT_REQUEST_TIMEOUT_S, LoadResult, run_load
from kvtide.benchmarks.report import (
    DEFAULT_SLO_TTFT_S,
    MetricsSample,
    build_run_report,
    merge_server_samples,
    metrics_delta,
    parse_metrics,
)
from kvtide.benchmarks.workloads import (
    DEFAULT_TOKENS_PER_WORD,
    WORKLOAD_PARAMS,
    Workload,
    build_workload,
    calibrate_tokens_per_word,
    make_params,
    oracle_hit_rate,
)

if TYPE_CHECKING:
    from kvtide.config import KvtideConfig

METRICS_POLL_S = 1.0
BARE_POLICY = "bare"  # = bare_fleet.BARE_POLICY; not imported here, so `bench run` stays light
RAY_KV_POLICY = "ray_kv"  # = ray_llm_fleet.RAY_KV_POLICY
NOT_KVTIDE = (BARE_POLICY, RAY_KV_POLICY)  # baselines that run without kvtide's cluster
DEFAULT_POLICIES = "pow2,ray_prefix,prefix_aware"

# Where a run's counters come from: one endpoint whose series name their replica (kvtide
# through Ray's metrics agent), or {server name: endpoint} of independent servers (bare).
MetricsSource = Union[str, Mapping[str, str], None]


# ---- flags ------------------------------------------------------------------------------------

def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOAD_PARAMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"workloads are {', '.join(WORKLOAD_PARAMS)}; got {text!r}")
    return names


def _numbers(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
        return values
    return parse


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


def _add_workload_flags(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    g = p.add_argument_group("workload (defaults: SGLang generated-shared-prefix 64×16, 2048/128/256)")
    if sweep:
        g.add_argument("--workload", required=True, type=_names,
                       help=f"comma-separated, run in turn on each server: {', '.join(WORKLOAD_PARAMS)}")
    else:
        g.add_argument("--workload", required=True, choices=list(WORKLOAD_PARAMS))
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    g.add_argument("--num-groups", type=int, help="shared-prefix: groups (distinct system prompts)")
    g.add_argument("--prompts-per-group", type=int, help="shared-prefix: requests per group")
    g.add_argument("--zipf-s", type=float,
                   help="shared-prefix: Zipf exponent of group popularity (0, the default: equal groups)")
    g.add_argument("--system-prompt-len", type=int, help="shared-prefix, multi-turn: system prompt tokens")
    g.add_argument("--question-len", type=int, help="shared-prefix, multi-turn: question tokens")
    g.add_argument("--output-len", type=int, help="output tokens (max_tokens)")
    g.add_argument("--num-users", type=int, help="multi-turn: users")
    g.add_argument("--num-rounds", type=int, help="multi-turn: rounds per user")
    g.add_argument("--num-requests", type=int, help="random: requests")
    g.add_argument("--input-len", type=int, help="random: prompt tokens")
    g.add_argument("--max-requests", type=int, help="send at most this many of the workload's requests")
    g.add_argument("--tokens-per-word", type=float, default=None,
                   help=f"token estimate per generated word (default {DEFAULT_TOKENS_PER_WORD}, the demo tokenizer)")
    g.add_argument("--tokenizer", help="local HF tokenizer dir to calibrate tokens per word (e.g. the served model)")


def _add_load_flags(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    g = p.add_argument_group("load")
    mode = g.add_mutually_exclusive_group(required=True)
    if sweep:
        mode.add_argument("--rate", type=_numbers(float), help="open loop: Poisson arrivals, requests/s (a list sweeps)")
        mode.add_argument("--concurrency", type=_numbers(int), help="closed loop: requests in flight (a list sweeps)")
    else:
        mode.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
        mode.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    g.add_argument("--duration", type=float, default=60.0, help="stop sending after this many seconds")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, help="per request, seconds")
    g.add_argument("--drain-timeout", type=float, default=None,
                   help="open loop: after the last send, await requests in flight at most this long; the rest "
                        "count as errors (default: await them all, each up to --request-timeout)")
    g.add_argument("--warmup", type=int, default=4, help="short unmeasured requests sent first (0: none)")
    g.add_argument("--metrics-settle", type=float, default=30.0,
                   help="seconds to wait for the server's request counters to include the run")
    g.add_argument("--slo-ttft-s", type=float, default=DEFAULT_SLO_TTFT_S,
                   help=f"TTFT objective for goodput: successful requests/s with TTFT <= this "
                        f"(default {DEFAULT_SLO_TTFT_S})")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench run`, `bench compare`, `bench readme` and `bench trace` to the kvtide CLI."""
    bench = subparsers.add_parser("bench", help="benchmark a server, or compare routing policies side by side")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    run_p = sub.add_parser("run", help="run one workload against an OpenAI-compatible server; write a run JSON")
    run_p.add_argument("--url", required=True, help="server base URL on loopback, e.g. http://127.0.0.1:8000")
    run_p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    run_p.add_argument("--metrics-url", help="Prometheus text endpoint, e.g. http://127.0.0.1:8080/metrics")
    run_p.add_argument("--policy", help="routing policy label for the report (null if not given)")
    run_p.add_argument("--out", required=True, help="run JSON path")
    run_p.add_argument("--samples", help="also write per-request results as JSON lines here")
    _add_workload_flags(run_p)
    _add_load_flags(run_p)
    run_p.set_defaults(func=cmd_run)

    cmp_p = sub.add_parser("compare", help="start the local cluster once per policy and compare them")
    cmp_p.add_argument("--config", "-c", help="cluster config YAML (default: the embedded CPU demo config)")
    cmp_p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="config override for every run, e.g. --set http.port=8200 (repeatable)")
    cmp_p.add_argument("--policies", default=DEFAULT_POLICIES,
                       help=f"comma-separated: routing.policy values, `{BARE_POLICY}` (bare vLLM servers behind "
                            f"a round-robin balancer, no kvtide) and `{RAY_KV_POLICY}` (Ray Serve LLM's KV-aware app); "
                            "the baseline is bare, else pow2, else the first. A kvtide policy takes overrides of "
                            "its own after +: prefix_aware+routing.tie_band_tokens=0")
    cmp_p.add_argument("--bare-balancer", choices=("auto", "haproxy", "python"), default="auto",
                       help="bare's balancer: HAProxy if a binary is found (auto), or the Python round-robin proxy")
    cmp_p.add_argument("--repeats", type=_at_least_one, default=1,
                       help="run every policy this many times (order rotated, prompts drawn anew each time); "
                            "the report shows the median repeat and the spread")
    cmp_p.add_argument("--out", required=True, help="output directory")
    cmp_p.add_argument("--hardware", help="what it ran on, for the report (e.g. '2 × NVIDIA H200')")
    cmp_p.add_argument("--workload-set", dest="workload_sets", action="append", default=[],
                       metavar="WORKLOAD.KEY=VALUE",
                       help="a setting for one workload of --workload only, over the shared flags: a parameter "
                            "(e.g. multi-turn.system_prompt_len=1024), its rates (multi-turn.rate=16 or 8,16) or "
                            "its duration (multi-turn.duration=30); repeatable. Several workloads then run on "
                            "one cluster start per policy")
    _add_workload_flags(cmp_p, sweep=True)
    _add_load_flags(cmp_p, sweep=True)
    cmp_p.set_defaults(func=cmd_compare)

    readme_results.add_parser(sub)
    servers = agentic.Servers(serving, policy_config, repeat_order, scrape, _settled_after)
    trace_replay.add_parser(sub, servers)
    agentic.add_parser(sub, servers)
    router_microbench.add_parser(sub)


# ---- per-workload settings (compare) ---------------------------------------------------------

def per_workload_args(args: argparse.Namespace) -> dict[str, argparse.Namespace]:
    """{workload: the flags it runs with}: the shared flags, then its own --workload-set entries.

    A key is a field of the workload's parameters (named like its flag: system_prompt_len),
    `rate` (a list like --rate's) or `duration`. Raises ValueError naming a bad entry.
    """
    overrides: dict[str, dict[str, Any]] = {name: {} for name in args.workload}
    for entry in getattr(args, "workload_sets", None) or []:
        target, sep, value = entry.partition("=")
        name, dot, key = target.rpartition(".")
        if not (sep and dot and name and key and value):
            raise ValueError(f"--workload-set {entry!r}: expected WORKLOAD.KEY=VALUE")
        if name not in overrides:
            raise ValueError(f"--workload-set {entry!r}: {name!r} is not one of --workload ({', '.join(args.workload)})")
        overrides[name][key] = _workload_value(name, key, value, entry)
    return {name: argparse.Namespace(**{**vars(args), **own}) for name, own in overrides.items()}


def _workload_value(name: str, key: str, value: str, entry: str) -> Any:
    if key == "rate":
        try:
            return _numbers(float)(value)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--workload-set {entry!r}: {exc}") from None
    if key == "duration":
        kind: type = float
    else:
        defaults = {f.name: f.default for f in fields(WORKLOAD_PARAMS[name])}
        if key not in defaults:
            raise ValueError(f"--workload-set {entry!r}: {name} has no {key!r}; it takes "
                             f"{', '.join(sorted(defaults))}, rate, duration")
        kind = type(defaults[key])
    try:
        parsed = kind(value)
    except ValueError:
        raise ValueError(f"--workload-set {entry!r}: {value!r} is not {'a whole number' if kind is int else 'a number'}"
                         ) from None
    if parsed < 0 or (parsed == 0 and key != "zipf_s"):
        raise ValueError(f"--workload-set {entry!r}: must be positive")
    return parsed


# ---- shared steps -----------------------------------------------------------------------------

def workload_from_args(args: argparse.Namespace, name: str | None = None, seed_offset: int = 0) -> Workload:
    """The workload the flags describe (`name` for one of a sweep's), seeded --seed + seed_offset."""
    name = name or args.workload
    tokens_per_word = args.tokens_per_word
    if tokens_per_word is None:
        tokens_per_word = calibrate_tokens_per_word(args.tokenizer) if args.tokenizer else DEFAULT_TOKENS_PER_WORD
    params = make_params(name, **vars(args))
    workload = build_workload(name, params, seed=args.seed + seed_offset, tokens_per_word=tokens_per_word)
    if args.max_requests is not None:
        workload = Workload(workload.name, workload.params, workload.seed, workload.requests[: args.max_requests])
    return workload


async def _metrics_text(client: httpx.AsyncClient, url: str) -> str:
    resp = await client.get(url)
    resp.raise_for_status()
    return resp.text


async def scrape(client: httpx.AsyncClient, metrics: MetricsSource) -> MetricsSample | None:
    """One sample of the run's counters; independent servers are scraped together and merged per server."""
    if not metrics:
        return None
    if isinstance(metrics, str):
        return parse_metrics(await _metrics_text(client, metrics))
    texts = await asyncio.gather(*(_metrics_text(client, url) for url in metrics.values()))
    return merge_server_samples({name: parse_metrics(text) for name, text in zip(metrics, texts)})


async def _settled_after(client: httpx.AsyncClient, metrics: MetricsSource, before: MetricsSample | None,
                         num_ok: int, settle_s: float) -> MetricsSample | None:
    """Scrape until the request counters include the run's successes (metrics export lags), or give up."""
    after = await scrape(client, metrics)
    deadline = time.monotonic() + settle_s
    while after is not None and before is not None and time.monotonic() < deadline:
        delta = metrics_delta(before, after)
        if delta is not None and sum(delta.requests_by_replica.values()) >= num_ok:
            break
        await asyncio.sleep(METRICS_POLL_S)
        after = await scrape(client, metrics)
    return after


async def _warmup(base_url: str, model: str | None, endpoint: str, count: int) -> int:
    """Send `count` short unrelated requests (first-request costs stay out of the run); returns the successes."""
    if count <= 0:
        return 0
    warm = build_workload("random", make_params("random", num_requests=count, input_len=64, output_len=8), seed=-1)
    load = await run_load(base_url, warm.requests, concurrency=min(count, 4), duration_s=120.0, model=model,
                          endpoint=endpoint, progress=False)
    return sum(r.ok for r in load.results)


@dataclass(frozen=True)
class Load:
    """One load level: open loop at `rate` requests/s, or closed loop with `concurrency` in flight."""

    rate: float | None = None
    concurrency: int | None = None

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}" if self.rate is not None else f"concurrency {self.concurrency}"


def loads_from_args(args: argparse.Namespace) -> list[Load]:
    """The load levels of --rate / --concurrency (one number, or a sweep's list)."""
    if args.rate is not None:
        return [Load(rate=r) for r in (args.rate if isinstance(args.rate, list) else [args.rate])]
    return [Load(concurrency=c) for c in (args.concurrency if isinstance(args.concurrency, list) else [args.concurrency])]


# A repeat's prompts and arrivals are drawn anew: its seeds are shifted by this per repeat.
REPEAT_SEED_STRIDE = 7919


def repeat_order(policies: list[str], repeat: int) -> list[str]:
    """The order policies run in during a repeat: rotated by one each time, so none always runs first
    (on a fresh machine the first cluster also pays cold compile caches)."""
    shift = repeat % len(policies) if policies else 0
    return policies[shift:] + policies[:shift]


def point_seed_offset(workload: str, level: Load) -> int:
    """A sweep point's seed offset, from the point alone: "rate 8" gets the same prompts in any list.

    (Offsets by list position gave `--rate 8,4` the prompts `--rate 4,8` used at rate 4, so a
    policy repeated in another order ran other prompts than the rest of the comparison.)
    """
    return zlib.crc32(f"{workload} @ {level.label}".encode()) % 1_000_000


async def bench_once(base_url: str, metrics: MetricsSource, workload: Workload, policy: str | None,
                     args: argparse.Namespace, model: str | None = None, load_level: Load | None = None,
                     warmup: int | None = None, num_replicas: int | None = None) -> tuple[dict[str, Any], LoadResult]:
    """Warm up, scrape, run the workload, scrape again after the counters settle; the run JSON and raw results."""
    level = load_level or loads_from_args(args)[0]
    async with httpx.AsyncClient(timeout=10.0) as client:
        # The export lags: "before" must already include the warm-up, or it counts in the run.
        initial = await scrape(client, metrics)
        num_warm_ok = await _warmup(base_url, model, args.endpoint, args.warmup if warmup is None else warmup)
        before = await _settled_after(client, metrics, initial, num_warm_ok, args.metrics_settle)
        load = await run_load(base_url, workload.requests, duration_s=args.duration, rate=level.rate,
                              concurrency=level.concurrency, model=model, endpoint=args.endpoint, seed=workload.seed,
                              request_timeout_s=args.request_timeout, progress=not args.no_progress,
                              drain_timeout_s=args.drain_timeout)
        num_ok = sum(r.ok for r in load.results)
        after = await _settled_after(client, metrics, before, num_ok, args.metrics_settle)
    sent = workload.requests[: len(load.results)]  # both loops send a prefix of the list, in order
    report = build_run_report(workload=workload.name, policy=policy, results=load.results,
                              duration_s=load.duration_s, metrics=metrics_delta(before, after),
                              slo_ttft_s=args.slo_ttft_s, offered_rate_per_s=level.rate,
                              concurrency=level.concurrency, oracle_hit_rate=oracle_hit_rate(sent),
                              num_replicas=num_replicas)
    return report, load


def _write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _write_samples(path: str | Path, load: LoadResult) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in load.results:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def _one_line(report: dict[str, Any]) -> str:
    ttft = report["ttft_s"]["p50"]
    rate = report["prefix_cache_hit_rate"]
    return (f"{report['policy'] or '-'}: {report['num_requests']} requests ({report['num_errors']} errors), "
            f"{report['requests_per_s']:.2f} req/s, goodput {report['goodput_requests_per_s']:.2f} req/s "
            f"(TTFT <= {report['slo_ttft_s']:g} s), {report['output_tokens_per_s']:.1f} tok/s, "
            f"TTFT p50 {'-' if ttft is None else f'{ttft:.3f}'} s, hit rate {'-' if rate is None else f'{rate:.2f}'}, "
            f"imbalance {report['imbalance']}")


# ---- commands -----------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    from kvtide.benchmarks.protocol import provenance

    report, load = asyncio.run(bench_once(args.url, args.metrics_url, workload, args.policy, args, args.model))
    _write_json(args.out, {**report, "provenance": provenance(["kvtide", *sys.argv[1:]])})
    if args.samples:
        _write_samples(args.samples, load)
    print(_one_line(report))
    print(f"kvtide bench: wrote {args.out}")
    return 0 if report["num_errors"] == 0 else 1


@dataclass(frozen=True)
class Target:
    """A running server for one policy: where to send, where to scrape, what to ask for, what to note."""

    base_url: str
    metrics: MetricsSource
    model_name: str
    note: str | None = None
    num_replicas: int | None = None  # the fleet's size, for the imbalance (None: unknown)


def policy_config(config_path: str, overrides: list[str], policy: str) -> KvtideConfig:
    """The config one policy runs with (validated now: a typo fails in a second, not after a run).

    A kvtide policy may carry config overrides of its own after `+`, so that variants of one
    policy compare side by side: `prefix_aware+routing.tie_band_tokens=0+http.router_replicas_per_node=2`.
    """
    from kvtide.config import load_config

    if policy in NOT_KVTIDE:
        from kvtide.benchmarks.bare_fleet import fleet_size

        config = load_config(config_path, overrides)
        fleet_size(config)  # raises if the config has no engine replica to mirror
        return config
    base, *variant = policy.split("+")
    return load_config(config_path, [*overrides, *variant, f"routing.policy={base}"])


@contextlib.contextmanager
def serving(policy: str, config: KvtideConfig, out: Path, args: argparse.Namespace) -> Iterator[Target]:
    """The bare fleet or the local kvtide cluster for `policy`, stopped (every process) on exit."""
    from kvtide.benchmarks.bare_fleet import fleet_size

    try:
        n: int | None = fleet_size(config)
    except ValueError:  # no fixed size to mirror (bare and ray_kv then failed in policy_config already)
        n = None
    if policy == BARE_POLICY:
        from kvtide.benchmarks import bare_fleet

        with bare_fleet.running(config, out / BARE_POLICY, request_timeout_s=args.request_timeout,
                                balancer=args.bare_balancer) as fleet:
            yield Target(fleet.base_url, fleet.metrics_urls, fleet.model_name, fleet.note, n)
    elif policy == RAY_KV_POLICY:
        from kvtide.benchmarks import ray_llm_fleet

        with ray_llm_fleet.running(config, out / RAY_KV_POLICY) as ray_kv:
            yield Target(ray_kv.base_url, ray_kv.metrics_url, ray_kv.model_name, ray_kv.note, n)
    else:
        from kvtide.cluster import local

        with local.running(config) as cluster:
            yield Target(cluster.base_url, cluster.metrics_url, cluster.model_name, num_replicas=n)


def cmd_compare(args: argparse.Namespace) -> int:
    from kvtide.benchmarks.plots import write_plots, write_sweep_plots
    from kvtide.benchmarks.processes import stop_servers_on_sigterm
    from kvtide.benchmarks.report import (RequestResult, aggregate_repeats, compare_markdown, spread_markdown,
                                          sweep_markdown)
    from kvtide.config import default_config_path

    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))
    if not policies:
        print("kvtide bench compare: --policies is empty; give e.g. bare,pow2,prefix_aware", file=sys.stderr)
        return 2
    from kvtide.benchmarks.protocol import provenance

    stop_servers_on_sigterm()  # a stopped run must not leave servers behind
    # What ran (commit, versions, GPU, the command), in every run JSON: results.json's top level is its policies.
    prov = provenance(["kvtide", *sys.argv[1:]])
    try:
        workload_args = per_workload_args(args)
    except ValueError as exc:
        print(f"kvtide bench compare: {exc}", file=sys.stderr)
        return 2
    config_path = args.config or default_config_path()
    configs = {p: policy_config(config_path, args.overrides, p) for p in policies}
    points = [(name, level) for name in args.workload for level in loads_from_args(workload_args[name])]
    sweep = len(points) > 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # {point label: {policy: [run JSON per repeat]}} → results.json: {point label: {policy: run JSON}}
    # (the median repeat, `aggregate_repeats`); a single point keeps the flat {policy: run JSON}.
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    results: dict[str, dict[str, dict[str, Any]]] = {}
    samples: dict[str, list[RequestResult]] = {}
    notes: list[str] = []
    failed: list[str] = []
    for repeat in range(args.repeats):
        workloads = [workload_from_args(workload_args[name], name,
                                        seed_offset=point_seed_offset(name, level) + REPEAT_SEED_STRIDE * repeat)
                     for name, level in points]
        for policy in repeat_order(list(configs), repeat):
            if policy in failed:
                continue
            print(f"kvtide bench compare: starting {policy}{f' (repeat {repeat + 1})' if args.repeats > 1 else ''} ...",
                  flush=True)
            try:
                with serving(policy, configs[policy], out, args) as target:
                    for i, ((name, level), workload) in enumerate(zip(points, workloads)):
                        report, load = asyncio.run(bench_once(target.base_url, target.metrics, workload, policy,
                                                              workload_args[name], target.model_name, level,
                                                              args.warmup if i == 0 else 0, target.num_replicas))
                        label = f"{name} @ {level.label}"
                        runs.setdefault(label, {}).setdefault(policy, []).append(
                            {**report, "repeat": repeat, "provenance": prov})
                        results.setdefault(label, {})[policy] = aggregate_repeats(runs[label][policy])
                        stem = f"{policy}.{name}.{level.label.replace(' ', '')}" if sweep else policy
                        _write_samples(out / f"{stem}{f'.r{repeat}' if args.repeats > 1 else ''}.requests.jsonl", load)
                        samples[policy] = load.results
                        # After each point: a crash keeps finished runs.
                        _write_json(out / "results.json", results if sweep else results[label])
                        if args.repeats > 1:
                            _write_json(out / "runs.json", runs)
                        print(f"{label}: {_one_line(report)}", flush=True)
                notes += [target.note] if target.note and target.note not in notes else []
            except Exception as exc:  # one policy failing to start must not lose the others' runs
                print(f"kvtide bench compare: {policy} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                failed.append(policy)
                notes.append(f"`{policy}` failed: {type(exc).__name__}: {str(exc)[:500]}")
    if not results:
        print("kvtide bench compare: no policy produced a run", file=sys.stderr)
        return 1
    if args.repeats > 1:
        notes.append(f"{args.repeats} repeats, the policy order rotated each time and each repeat's prompts drawn "
                     "anew; tables show the repeat with the median goodput, the spread section every repeat.")
    command = "kvtide " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    if sweep:
        text = sweep_markdown(results, command=command, notes=notes, hardware=args.hardware)
        write_sweep_plots(results, out)
    else:
        flat = next(iter(results.values()))
        samples = {p: samples[p] for p in flat}
        text = compare_markdown(flat, command=command, notes=notes, hardware=args.hardware)
        write_plots(flat, samples, out)
    (out / "report.md").write_text(text + spread_markdown(results))
    print(f"kvtide bench compare: wrote {out}/results.json, report.md and plots")
    return 1 if failed else 0
