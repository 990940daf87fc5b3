"""`kvtide simulate`: a fleet of simulated engines behind kvtide's own router, replaying a trace.

    kvtide simulate run --trace ../shared/traces/mooncake-synthetic.jsonl --replicas 8 \\
        --policies prefix_aware,pow2,round_robin --profile llama-8b-h100 --kv-gib 16 \\
        --block-tokens 64 --time-scale 0.5 --out-dir OUT
    kvtide simulate plan --trace FILE --slo-ttft-p90-ms 500 --kv-gib 16 --block-tokens 64 --out-dir OUT
    kvtide simulate autoscale --max-replicas 8 --step-at-s 150 --step-for-s 150 --kv-gib 16 \\
        --block-tokens 64 --utilization 0.15 --copies 4 --out-dir OUT
    kvtide simulate fit --overhead-results benchmarks/results/h100-session-2026-12-06/paired/results.json \\
        --server vllm --name llama-8b-h100 --out simulator/profiles/llama-8b-h100.json

`run` scales the trace as `kvtide bench trace` does (benchmarks/trace_replay.scale_trace: the same
window, block size, truncation, output cap and time scale, so a simulated run and a GPU replay
send the same requests), runs each policy on a fresh fleet, and writes OUT/results.json and
OUT/report.md. `plan` finds the smallest replica count whose simulated TTFT p90 meets the
objective, per policy (simulator/plan.py). `autoscale` runs kvtide's autoscaler on the fleet
through a traffic step (simulator/autoscale.py), once per variant of the autoscaling settings.
`fit` fits a profile's step coefficients to a committed overhead run (simulator/profile.py says how).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtide.benchmarks.protocol import provenance, provenance_markdown

DEFAULT_SLO_TTFT_S = 1.0


def _policies(text: str) -> list[str]:
    from kvtide.simulator.fleet import POLICIES

    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"policies are {', '.join(POLICIES)}; got {text!r}")
    return names


def _add_fleet_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="Mooncake-format JSON lines (default: the shared synthetic trace)")
    p.add_argument("--profile", default="llama-8b-h100", help="a committed profile's name, or a profile JSON")
    p.add_argument("--kv-gib", type=float, required=True, help="KV cache per replica, GiB")
    p.add_argument("--kv-offload-gib", type=float,
                   help="a CPU KV tier per replica, GiB (engine.kv_offload.size_gib; default: none)")
    p.add_argument("--load-gib-per-s", type=float,
                   help="the tier's host→GPU load rate, GiB/s (default: engine.kv_offload.load_gib_per_s's)")
    p.add_argument("--tier-blind", action="store_true",
                   help="replicas keep the CPU tier but do not report it: routing on GPU blocks alone")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--report-delay-s", type=float, default=0.0, help="engine report → router, seconds")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="routing config override, e.g. --set routing.tie_band_tokens=0 (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", required=True)
    g = p.add_argument_group("scaling (as `kvtide bench trace`)")
    g.add_argument("--block-tokens", type=int, required=True)
    g.add_argument("--max-input-tokens", type=int)
    g.add_argument("--over-long", choices=("drop", "truncate"), default="drop")
    g.add_argument("--time-scale", type=float, default=1.0)
    g.add_argument("--utilization", type=float,
                   help="instead of --time-scale: load the fleet's prefill capacity to this share with the "
                        "trace's unavoidable prefill (simulator.fleet.time_scale_for)")
    g.add_argument("--copies", type=int, default=1,
                   help="tenants replaying the trace at once, each with its own hash ids (fleet.tenant_copies)")
    g.add_argument("--output-scale", type=float, default=1.0)
    g.add_argument("--max-output-tokens", type=int)
    g.add_argument("--limit", type=int)
    g.add_argument("--start-s", type=float, default=0.0)
    g.add_argument("--duration-s", type=float)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `simulate run` and `simulate fit` to the kvtide CLI."""
    sim = subparsers.add_parser("simulate", help="simulate a fleet behind kvtide's router on a trace")
    sub = sim.add_subparsers(dest="simulate_command", required=True)
    run = sub.add_parser("run", help="replay a trace on N simulated engines, once per policy")
    run.add_argument("--replicas", type=int, required=True, help="engine replicas")
    run.add_argument("--policies", type=_policies, default=["prefix_aware", "pow2", "round_robin"])
    run.add_argument("--slo-ttft-s", type=float, default=DEFAULT_SLO_TTFT_S, help="TTFT objective for goodput")
    _add_fleet_flags(run)
    run.set_defaults(func=cmd_run)
    plan = sub.add_parser("plan", help="the smallest replica count whose simulated TTFT p90 meets an objective")
    plan.add_argument("--slo-ttft-p90-ms", type=float, required=True)
    plan.add_argument("--policies", type=_policies, default=["prefix_aware", "round_robin"])
    plan.add_argument("--min-replicas", type=int, default=1)
    plan.add_argument("--max-replicas", type=int, default=256)
    _add_fleet_flags(plan)
    plan.set_defaults(func=cmd_plan)
    replay = sub.add_parser("replay", help="one open-loop point of `kvtide bench compare` on simulated engines, "
                                           "beside what a committed GPU run measured")
    from kvtide.benchmarks.cli import _add_workload_flags

    _add_workload_flags(replay)
    replay.add_argument("--rate", type=float, required=True, help="the point's Poisson rate, requests/s")
    replay.add_argument("--duration", type=float, required=True, help="the point's sending window, seconds")
    replay.add_argument("--replicas", type=int, required=True)
    replay.add_argument("--engines-per-gpu", type=int, default=1, help="engines sharing one GPU (fleet.SimConfig)")
    replay.add_argument("--policies", type=_policies, default=["prefix_aware", "pow2", "round_robin"])
    replay.add_argument("--profile", default="llama-8b-h100")
    replay.add_argument("--kv-gib", type=float, required=True)
    replay.add_argument("--max-num-batched-tokens", type=int, default=8192)
    replay.add_argument("--max-num-seqs", type=int, default=256)
    replay.add_argument("--report-delay-s", type=float, default=0.0)
    replay.add_argument("--slo-ttft-s", type=float, default=DEFAULT_SLO_TTFT_S)
    replay.add_argument("--measured", help="the GPU run's results.json (`kvtide bench compare`): compared per policy")
    replay.add_argument("--out-dir", required=True)
    replay.set_defaults(func=cmd_replay)
    scale = sub.add_parser("autoscale", help="kvtide's autoscaler on a simulated fleet: a traffic step and the "
                                             "scale-down after it, once per variant")
    scale.add_argument("--variants", default="kv-standby:standby_replicas=1,kv:standby_replicas=0",
                       help="NAME:KEY=VALUE+KEY=VALUE,... autoscaling settings per variant (default: a standby "
                            "engine vs cold starts)")
    scale.add_argument("--policy", type=_policies, default=["prefix_aware"])
    scale.add_argument("--min-replicas", type=int, default=1)
    scale.add_argument("--max-replicas", type=int, required=True)
    scale.add_argument("--initial-replicas", type=int)
    scale.add_argument("--cold-start-s", type=float, default=99.6)
    scale.add_argument("--wake-s", type=float, default=2.2)
    scale.add_argument("--step-at-s", type=float, required=True, help="the step starts here (trace time, scaled)")
    scale.add_argument("--step-for-s", type=float, required=True)
    scale.add_argument("--step-factor", type=float, default=3.0, help="arrival rate multiplier within the step")
    scale.add_argument("--slo-ttft-s", type=float, default=DEFAULT_SLO_TTFT_S)
    scale.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=[0, 1, 2],
                       help="one run per seed and variant, seeds alternating across variants (default 0,1,2; --seed is unused)")
    _add_fleet_flags(scale)
    scale.set_defaults(func=cmd_autoscale)
    summary = sub.add_parser("summary", help="several `simulate run` results in one table and one figure")
    summary.add_argument("results", nargs="+", help="results.json files of `kvtide simulate run`")
    summary.add_argument("--out", required=True, help="folder for summary.md and fleet.png")
    summary.set_defaults(func=cmd_summary)
    fit = sub.add_parser("fit", help="fit a profile's step coefficients to a committed overhead run")
    fit.add_argument("--overhead-results", required=True, nargs="+",
                     help="overhead runs' results.json (paired or single); runs of other prompt lengths let the "
                          "fit tell KV reads from decodes")
    fit.add_argument("--server", default="vllm", help="whose levels to fit (default: bare vLLM)")
    fit.add_argument("--name", required=True)
    fit.add_argument("--block-size", type=int, default=16)
    fit.add_argument("--kv-bytes-per-token", type=int, required=True,
                     help="2 × layers × KV heads × head dim × dtype bytes (Llama-3.1-8B: 131072)")
    fit.add_argument("--prompt-tokens", type=int, default=512,
                     help="prompt length of a run whose command does not record --input-len")
    fit.add_argument("--output-tokens", type=int, default=128,
                     help="output length of a run whose command does not record --output-len")
    fit.add_argument("--out", required=True)
    fit.set_defaults(func=cmd_fit)


def _setup(args: argparse.Namespace, num_replicas: int) -> tuple[Any, list[Any], Any, str]:
    """(SimConfig, trace items, profile, trace path) from the shared flags; ValueError/ConfigError name a bad one."""
    from kvtide.benchmarks.trace_replay import ScaleOptions, default_trace_path, read_trace, scale_trace
    from kvtide.config import default_config_path, load_config
    from kvtide.simulator.fleet import SimConfig, TraceItem, tenant_copies, time_scale_for
    from kvtide.simulator.profile import load_profile

    routing = load_config(default_config_path(), args.overrides).routing
    profile = load_profile(args.profile)
    trace = args.trace or default_trace_path()
    scaled = scale_trace(read_trace(trace), ScaleOptions(
        block_tokens=args.block_tokens, time_scale=1.0, output_scale=args.output_scale,
        max_input_tokens=args.max_input_tokens, over_long=args.over_long,
        max_output_tokens=args.max_output_tokens, limit=args.limit, start_s=args.start_s,
        duration_s=args.duration_s))
    limits = profile.limits(int(args.kv_gib * 2**30), args.max_num_batched_tokens, args.max_num_seqs)
    if getattr(args, "kv_offload_gib", None):
        from kvtide.simulator.plan import with_cpu_tier

        limits = with_cpu_tier(limits, profile.kv_bytes_per_token, args.kv_offload_gib, args.load_gib_per_s)
    items = tenant_copies([TraceItem(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids)
                           for r in scaled.requests], args.copies)
    if args.utilization is not None:
        args.time_scale = time_scale_for(items, args.utilization, num_replicas, profile.step, limits,
                                         args.block_tokens)
    items = [replace(i, timestamp_ms=i.timestamp_ms * args.time_scale) for i in items]
    config = SimConfig(num_replicas=num_replicas, limits=limits, profile=profile.step, routing=routing,
                       report_delay_s=args.report_delay_s, seed=args.seed,
                       router_sees_cpu_tier=not getattr(args, "tier_blind", False))
    return config, items, profile, str(trace)


def cmd_run(args: argparse.Namespace) -> int:
    from kvtide.config import ConfigError
    from kvtide.simulator.fleet import FleetSim, sim_requests
    from kvtide.simulator.report import report_markdown, summarize

    try:
        config, items, profile, trace = _setup(args, args.replicas)
    except (ConfigError, ValueError) as exc:
        print(f"kvtide simulate: {exc}", file=sys.stderr)
        return 2
    limits = config.limits
    results: dict[str, Any] = {
        "kind": "simulated_fleet", "command": shlex.join(["kvtide", *sys.argv[1:]]),
        "provenance": provenance(["kvtide", *sys.argv[1:]]),
        "description": (f"{args.replicas} simulated replicas ({profile.name}: {limits.num_blocks} blocks of "
                        f"{limits.block_size} tokens each"
                        + (f", a CPU tier of {limits.cpu_tier_blocks} blocks loading "
                           f"{1 / limits.cpu_onload_s_per_token:,.0f} tokens/s"
                           + (", not reported to the router" if args.tier_blind else "")
                           if limits.cpu_tier_blocks else "")
                        + f"), {len(items)} requests of `{trace}` "
                        f"(block tokens {args.block_tokens}, {args.copies} tenant cop{'y' if args.copies == 1 else 'ies'}, time "
                        f"scale {args.time_scale:.4g}" + (f": {args.utilization:g} of the fleet's prefill capacity"
                                                          if args.utilization is not None else "") + ")."),
        "profile": dict(profile.raw), "limits": limits.__dict__, "slo_ttft_s": args.slo_ttft_s,
        "time_scale": args.time_scale, "utilization": args.utilization, "copies": args.copies, "policies": {},
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for policy in args.policies:
        requests = sim_requests(items, args.block_tokens, limits.block_size)
        result = FleetSim(config, policy).run(requests)
        results["policies"][policy] = summarize(result, args.slo_ttft_s)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"kvtide simulate: {policy}: {json.dumps(results['policies'][policy])}", flush=True)
    (out / "report.md").write_text(report_markdown(results))
    print(report_markdown(results))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kvtide.config import ConfigError
    from kvtide.simulator.plan import smallest_fleet

    if args.utilization is not None:
        print("kvtide simulate plan: the load is the trace's (--time-scale, --copies); --utilization would move it "
              "with each fleet size", file=sys.stderr)
        return 2
    try:
        config, items, profile, trace = _setup(args, args.min_replicas)
    except (ConfigError, ValueError) as exc:
        print(f"kvtide simulate plan: {exc}", file=sys.stderr)
        return 2
    slo_s = args.slo_ttft_p90_ms / 1000.0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"kind": "fleet_plan", "command": shlex.join(["kvtide", *sys.argv[1:]]),
                               "provenance": provenance(["kvtide", *sys.argv[1:]]),
                               "trace": trace, "num_requests": len(items), "profile": dict(profile.raw),
                               "limits": config.limits.__dict__, "slo_ttft_p90_s": slo_s, "policies": {}}
    for policy in args.policies:
        plan = smallest_fleet(config, policy, items, args.block_tokens, slo_s, min_replicas=args.min_replicas,
                              max_replicas=args.max_replicas)
        results["policies"][policy] = {"replicas": plan.replicas, "tried": plan.tried}
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        curve = ", ".join(f"{n}: {s['ttft_s']['p90'] * 1000:.0f} ms" if s["ttft_s"]["p90"] is not None else f"{n}: –"
                          for n, s in plan.tried.items())
        answer = f"{plan.replicas} replicas" if plan.replicas else f"more than {args.max_replicas} replicas"
        print(f"kvtide simulate plan: {policy}: {answer} for TTFT p90 <= {args.slo_ttft_p90_ms:g} ms "
              f"(simulated TTFT p90 by size: {curve})", flush=True)
    return 0 if all(p["replicas"] for p in results["policies"].values()) else 1


# A simulated policy → the name `kvtide bench compare` gives the same routing (bare vLLM behind round robin).
MEASURED_NAME = {"round_robin": "bare"}
# The tolerances for a replay to count as matching the GPU run (simulator/validate: hit rate absolute,
# latency relative).
HIT_RATE_TOLERANCE = 0.03
LATENCY_TOLERANCE = 0.20


def compare_to_measured(simulated: dict[str, Any], measured: dict[str, Any] | None) -> dict[str, Any] | None:
    """Simulated vs measured per metric: both values, the difference, and whether it is within tolerance."""
    if measured is None:
        return None
    pairs = {"hit_rate": (simulated["hit_rate"], measured.get("prefix_cache_hit_rate"), "abs"),
             "ttft_p50_s": (simulated["ttft_s"]["p50"], (measured.get("ttft_s") or {}).get("p50"), "rel"),
             "ttft_p90_s": (simulated["ttft_s"]["p90"], (measured.get("ttft_s") or {}).get("p90"), "rel"),
             "e2e_p90_s": (simulated["e2e_s"]["p90"], (measured.get("e2e_s") or {}).get("p90"), "rel")}
    out = {}
    for key, (sim, real, kind) in pairs.items():
        if sim is None or real is None:
            out[key] = {"simulated": sim, "measured": real, "within": None}
            continue
        diff = sim - real if kind == "abs" else (sim - real) / real if real else None
        tolerance = HIT_RATE_TOLERANCE if kind == "abs" else LATENCY_TOLERANCE
        out[key] = {"simulated": sim, "measured": real, kind + "_difference": diff,
                    "within": diff is not None and abs(diff) <= tolerance}
    return out


def cmd_replay(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from kvtide.benchmarks.cli import Load, point_seed_offset
    from kvtide.benchmarks.workloads import DEFAULT_TOKENS_PER_WORD, calibrate_tokens_per_word, make_params
    from kvtide.config import default_config_path, load_config
    from kvtide.simulator.fleet import FleetSim, SimConfig
    from kvtide.simulator.profile import load_profile
    from kvtide.simulator.report import summarize
    from kvtide.simulator.workload import workload_requests

    if not args.tokenizer:
        print("kvtide simulate replay: --tokenizer (the served model's folder) renders the prompts", file=sys.stderr)
        return 2
    profile = load_profile(args.profile)
    limits = profile.limits(int(args.kv_gib * 2**30), args.max_num_batched_tokens, args.max_num_seqs)
    config = SimConfig(num_replicas=args.replicas, limits=limits, profile=profile.step,
                       routing=load_config(default_config_path(), []).routing, report_delay_s=args.report_delay_s,
                       engines_per_gpu=args.engines_per_gpu)
    tpw = args.tokens_per_word or calibrate_tokens_per_word(args.tokenizer) or DEFAULT_TOKENS_PER_WORD
    load = Load(rate=args.rate)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    point = f"{args.workload} @ {load.label}"
    measured = json.loads(Path(args.measured).read_text()).get(point, {}) if args.measured else {}
    results: dict[str, Any] = {"kind": "simulated_replay", "command": shlex.join(["kvtide", *sys.argv[1:]]),
                               "provenance": provenance(["kvtide", *sys.argv[1:]]),
                               "point": point, "profile": dict(profile.raw), "limits": limits.__dict__,
                               "engines_per_gpu": args.engines_per_gpu, "measured_from": args.measured,
                               "tolerances": {"hit_rate_abs": HIT_RATE_TOLERANCE, "latency_rel": LATENCY_TOLERANCE},
                               "policies": {}}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for policy in args.policies:
        requests = workload_requests(args.workload, make_params(args.workload, **vars(args)),
                                     seed=args.seed + point_seed_offset(args.workload, load), rate=args.rate,
                                     duration_s=args.duration, tokenizer=tokenizer, tokens_per_word=tpw,
                                     block_size=limits.block_size)
        simulated = summarize(FleetSim(config, policy).run(requests), args.slo_ttft_s)
        results["policies"][policy] = {"simulated": simulated,
                                       "vs_measured": compare_to_measured(
                                           simulated, measured.get(MEASURED_NAME.get(policy, policy)))}
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(replay_markdown(results))
    print(replay_markdown(results))
    return 0


def _variants(text: str) -> dict[str, list[str]]:
    """'name:key=value+key=value,...' → {name: ['autoscaling.key=value', ...]}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, sets = part.partition(":")
        out[name] = [f"autoscaling.{kv}" for kv in sets.split("+") if kv]
    return out


def cmd_autoscale(args: argparse.Namespace) -> int:
    from kvtide.config import ConfigError, default_config_path, load_config
    from kvtide.simulator.autoscale import AutoscaleConfig, Autoscaler, episode_summary, step_items
    from kvtide.simulator.fleet import FleetSim, sim_requests

    initial = args.initial_replicas or args.min_replicas
    try:
        config, items, profile, trace = _setup(args, initial)
        items = step_items(items, args.step_at_s, args.step_for_s, args.step_factor)
        variants = {name: AutoscaleConfig(
            settings=load_config(default_config_path(), [*args.overrides, *sets]).autoscaling,
            min_replicas=args.min_replicas, max_replicas=args.max_replicas, initial_replicas=initial,
            cold_start_s=args.cold_start_s, wake_s=args.wake_s) for name, sets in _variants(args.variants).items()}
    except (ConfigError, ValueError) as exc:
        print(f"kvtide simulate autoscale: {exc}", file=sys.stderr)
        return 2
    end_s = max(i.timestamp_ms for i in items) / 1000.0
    step_end_s = args.step_at_s + args.step_for_s
    windows = {"before": (0.0, args.step_at_s), "step": (args.step_at_s, step_end_s), "after": (step_end_s, end_s + 1)}
    results: dict[str, Any] = {
        "kind": "simulated_autoscale", "command": shlex.join(["kvtide", *sys.argv[1:]]),
        "provenance": provenance(["kvtide", *sys.argv[1:]]), "profile": dict(profile.raw),
        "limits": config.limits.__dict__, "policy": args.policy[0], "slo_ttft_s": args.slo_ttft_s,
        "seeds": args.seeds,
        "description": (f"{len(items)} requests of `{trace}` (block tokens {args.block_tokens}, time scale "
                        f"{args.time_scale:.4g}), {args.step_factor:g}× the arrival rate from {args.step_at_s:g} s "
                        f"for {args.step_for_s:g} s; {args.min_replicas}–{args.max_replicas} replicas from "
                        f"{initial}; cold start {args.cold_start_s:g} s, wake {args.wake_s:g} s; {profile.name}: "
                        f"{config.limits.num_blocks} blocks of {config.limits.block_size} tokens each; routing "
                        f"{args.policy[0]}; seeds {', '.join(map(str, args.seeds))} (the router's and the "
                        f"policy's random draws)."),
        "windows_s": windows, "variants": {}}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Seeds alternate across variants, as servers alternate across repeats on a GPU.
    for seed in args.seeds:
        for name, autoscale in variants.items():
            sim = FleetSim(replace(config, seed=seed), args.policy[0], Autoscaler(autoscale))
            summary = episode_summary(sim.run(sim_requests(items, args.block_tokens, config.limits.block_size)),
                                      windows, args.slo_ttft_s, autoscale.tick_s)
            entry = results["variants"].setdefault(name, {"settings": autoscale.settings.model_dump(mode="json"),
                                                          "runs": []})
            entry["runs"].append({"seed": seed, **summary})
            (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    from kvtide.simulator.summary import write_timeline

    write_timeline(results, out / "timeline.png")
    (out / "report.md").write_text(autoscale_markdown(results))
    print(autoscale_markdown(results))
    return 0


def autoscale_markdown(results: dict[str, Any]) -> str:
    """The variants' medians (min–max over the seeds) of an autoscale run."""
    from kvtide.benchmarks.protocol import format_spread, summarize_repeats
    from kvtide.simulator.autoscale import SCALE_DOWN_WINDOW_S

    def spread(values: list[float | None], fmt: str, scale: float = 1.0) -> str:
        return format_spread(summarize_repeats(values), scale=scale, fmt=fmt)

    step_at_s, step_end_s = results["windows_s"]["step"]
    lines = ["# Simulated autoscaling: a traffic step and the scale-down after it", "", results["description"], "",
             "Command:", "", f"    {results['command']}", "", "Median (min–max) over the seeds.",
             "[timeline.png](timeline.png): replicas over time per variant (the first seed's run; the step shaded).", "",
             f"| variant | replica-seconds | max replicas | SLO violations (TTFT > {results['slo_ttft_s']:g} s) | "
             "TTFT p90 before / step / after (ms) | hit rate | first replica added serving (s after the step) |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for name, v in results["variants"].items():
        runs = v["runs"]
        ttft = " / ".join(spread([r["windows"][w]["ttft_p90_s"] for r in runs], "{:.0f}", 1e3)
                          for w in ("before", "step", "after"))
        serving = [next((t - step_at_s for t, verb, _ in r["events"] if verb == "serving" and t >= step_at_s), None)
                   for r in runs]
        lines.append(f"| {name} | {spread([r['replica_seconds'] for r in runs], '{:.0f}')} | "
                     f"{spread([r['max_replicas'] for r in runs], '{:.0f}')} | "
                     f"{spread([r['slo_violations'] for r in runs], '{:.0f}')} / {runs[0]['num_requests']} | {ttft} | "
                     f"{spread([r['hit_rate'] for r in runs], '{:.3f}')} | {spread(serving, '{:.1f}')} |")
    downs = {name: [r["scale_down"] for r in v["runs"] if r.get("scale_down")] for name, v in results["variants"].items()}
    if any(downs.values()):
        lines += ["", "The first scale-down: the replica that left routing, and the requests sent in the "
                      f"{SCALE_DOWN_WINDOW_S:g} s before and after it.", "",
                  "| variant | at (s) | left (per seed) | its share of the hits before | hit rate before → after | "
                  "TTFT p90 before → after (ms) |", "|---|---:|---|---:|---|---|"]
        for name, d in downs.items():
            if not d:
                continue
            lines.append(f"| {name} | {spread([x['at_s'] for x in d], '{:.0f}')} | {', '.join(x['left'] for x in d)} | "
                         f"{spread([x['left_share_of_hits_before'] for x in d], '{:.3f}')} | "
                         f"{spread([x['before']['hit_rate'] for x in d], '{:.3f}')} → "
                         f"{spread([x['after']['hit_rate'] for x in d], '{:.3f}')} | "
                         f"{spread([x['before']['ttft_p90_s'] for x in d], '{:.0f}', 1e3)} → "
                         f"{spread([x['after']['ttft_p90_s'] for x in d], '{:.0f}', 1e3)} |")
    lines += ["", provenance_markdown(results["provenance"])]
    return "\n".join(lines) + "\n"


def replay_markdown(results: dict[str, Any]) -> str:
    def f(value: Any, fmt: str) -> str:
        return "–" if value is None else fmt.format(value)

    lines = ["# Simulated replay of a GPU run's point", "", f"Point `{results['point']}`, measured in "
             f"`{results['measured_from']}`; profile `{results['profile']['name']}`, "
             f"{results['engines_per_gpu']} engine(s) per GPU. Within: hit rate ±{HIT_RATE_TOLERANCE:g} absolute, "
             f"latencies ±{LATENCY_TOLERANCE:.0%} relative.", "",
             "| policy | metric | simulated | measured | difference | within |", "|---|---|---:|---:|---:|---|"]
    for policy, entry in results["policies"].items():
        for metric, cell in (entry["vs_measured"] or {}).items():
            diff = cell.get("abs_difference", cell.get("rel_difference"))
            shown = f(diff, "{:+.3f}") if "abs_difference" in cell else f(diff if diff is None else diff * 100, "{:+.0f} %")
            lines.append(f"| {policy} | {metric} | {f(cell['simulated'], '{:.3f}')} | {f(cell['measured'], '{:.3f}')} "
                         f"| {shown} | {'yes' if cell['within'] else 'no' if cell['within'] is False else '–'} |")
    lines += ["", f"Command: `{results['command']}`", ""]
    return "\n".join(lines) + ("\n" + provenance_markdown(results["provenance"]) if "provenance" in results else "")


def cmd_summary(args: argparse.Namespace) -> int:
    from kvtide.simulator.summary import write_summary

    md, png = write_summary(args.results, args.out)
    print(md.read_text())
    print(f"kvtide simulate summary: wrote {md} and {png}")
    return 0


def _recorded_flag(command: str, flag: str) -> int | None:
    parts = shlex.split(command or "")
    return int(parts[parts.index(flag) + 1]) if flag in parts[:-1] else None


def cmd_fit(args: argparse.Namespace) -> int:
    from kvtide.simulator.profile import ClosedLoopRun, Level, fit_runs

    runs, configs = [], {}
    for path in args.overhead_results:
        data = json.loads(Path(path).read_text())
        server = (data.get("servers") or {}).get(args.server)
        if server is None:
            print(f"kvtide simulate fit: no server {args.server!r} in {path}", file=sys.stderr)
            return 2
        command = data.get("command") or ""
        levels = tuple(Level(int(c), lv["metrics"]["output_tokens_per_s"]["median"], lv["metrics"]["ttft_p50_s"]["median"])
                       for c, lv in sorted(server["levels"].items(), key=lambda kv: int(kv[0])))
        runs.append(ClosedLoopRun(levels, _recorded_flag(command, "--input-len") or args.prompt_tokens,
                                  _recorded_flag(command, "--output-len") or args.output_tokens, path))
        configs[path] = server.get("engine_config")
    fitted = fit_runs(runs)
    profile = {"name": args.name, "model": json.loads(Path(args.overhead_results[0]).read_text()).get("hardware"),
               "block_size": args.block_size, "kv_bytes_per_token": args.kv_bytes_per_token, "step": fitted["step"],
               "fit": {"sources": [{"path": r.source, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                                    "engine_config": configs[r.source]} for r in runs],
                       "server": args.server, "kv_read_fitted": fitted["kv_read_fitted"],
                       "equations": fitted["equations"], "command": shlex.join(["kvtide", *sys.argv[1:]])}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps(profile["step"], indent=2))
    return 0
