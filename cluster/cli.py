"""`kvtide` command line: serve, demo-model, config checks, drain-node.

Subcommands stay thin: they parse flags, load the one config model, and call the
module that owns the work. Commands of the layers below (plan, dashboards) are imported;
commands of packages above cluster (`kvtide bench`, from kvtide.benchmarks) are found
through the `kvtide.commands` entry-point group, so cluster never imports them.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from importlib.metadata import entry_points

from kvtide.config import ConfigError, KvtideConfig, default_config_path, load_config

# Entry points of this group are `register(subparsers)` functions that add subcommands;
# kvtide's own pyproject.toml declares `bench` there, for the benchmarks package.
COMMANDS_GROUP = "kvtide.commands"


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="cluster config YAML (default: the embedded CPU demo config)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set engine.max_model_len=2048 (repeatable)")
    parser.add_argument("--model", help="'demo', a local HF-format directory or a hub id")
    parser.add_argument("--replicas", type=int, help="fixed number of engine replicas")
    parser.add_argument("--port", type=int, help="HTTP port of the OpenAI API")


def _config_from_args(args: argparse.Namespace) -> KvtideConfig:
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model={args.model}")
    if args.replicas is not None:
        overrides += [f"replicas.num_replicas={args.replicas}", "replicas.min_replicas=null",
                      "replicas.max_replicas=null"]
    if args.port is not None:
        overrides.append(f"http.port={args.port}")
    return load_config(args.config or default_config_path(), overrides)


# How often the idle main thread checks whether a stop signal has arrived.
STOP_POLL_S = 0.25


def cmd_serve(args: argparse.Namespace) -> int:
    from kvtide.cluster import local

    config = _config_from_args(args)
    # Signals received, appended by the handler. Not a threading.Event: a second signal
    # arriving while the handler is inside Event.set() (Ctrl-C reaches both `make` and
    # kvtide; `timeout` forwards its own) re-enters it and deadlocks on the Event's lock.
    received: list[int] = []
    serving = False

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if not serving:  # still starting: abandon the start; `finally` stops what it began
            raise KeyboardInterrupt

    def install_handlers() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    # Before start (a signal while starting stops right after) and again after it: ray.init
    # replaces SIGTERM's handler with one that exits with a stack dump.
    install_handlers()
    nodes = f" on {args.nodes} Ray nodes" if args.nodes > 1 else ""
    print(f"kvtide: starting {config.replicas.replicas_at_start} engine replica(s) of {config.model}{nodes} ...",
          flush=True)
    try:
        cluster = local.start(config, nodes=args.nodes)
        serving = True
        install_handlers()
        print(f"kvtide: ready. OpenAI API at {cluster.base_url}/v1 (model '{cluster.model_name}'), "
              f"metrics at {cluster.metrics_url}. Ctrl-C stops everything.", flush=True)
        for node in (cluster.nodes.nodes[1:] if cluster.nodes else []):
            print(f"kvtide: node {node.plan.index}: OpenAI API at {node.plan.base_url}/v1, "
                  f"metrics at {node.plan.metrics_url}", flush=True)
        if cluster.nodes:
            print("kvtide: the nodes listen on every interface (a node's proxy reaches the other nodes' replicas "
                  "at their addresses): set API keys (frontend.auth) where the machine is reachable.", flush=True)
        while not received:
            time.sleep(STOP_POLL_S)
    finally:
        print(f"kvtide: shutting down (requests in flight get up to {local.STOP_DRAIN_TIMEOUT_S:.0f} s) ...",
              flush=True)
        local.stop()
        print("kvtide: stopped.", flush=True)
    return 0


def cmd_demo_model(args: argparse.Namespace) -> int:
    from kvtide.deployments.engine.demo_model import build_demo_model

    print(build_demo_model(force=args.force))
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    import yaml

    from kvtide.config import config_to_dict

    print(yaml.safe_dump(config_to_dict(_config_from_args(args)), sort_keys=False), end="")
    return 0


def cmd_serve_config(args: argparse.Namespace) -> int:
    from kvtide.cluster.serve_config import ray_env_exports, serve_config_yaml

    config = _config_from_args(args)
    print(ray_env_exports(config) if args.env else serve_config_yaml(config), end="")
    return 0


def cmd_drain_node(args: argparse.Namespace) -> int:
    from kvtide.cluster.drain import main as drain_main

    return drain_main(args.timeout_s, address=args.address, node_id=args.node_id,
                      node_ip_address=args.node_ip_address, app=args.app)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtide", description="LLM serving cluster on Ray Serve + vLLM")
    sub = parser.add_subparsers(dest="command", required=True)

    serve_p = sub.add_parser("serve", help="start local Ray and serve the OpenAI API until Ctrl-C")
    _add_config_flags(serve_p)
    serve_p.add_argument("--nodes", type=int, default=1,
                         help="start this many Ray nodes on this machine (`ray start`), each with its own "
                              "proxy (node i on --port + i) and metrics port: a local multi-node demo")
    serve_p.set_defaults(func=cmd_serve)

    demo_p = sub.add_parser("demo-model", help="build (or find) the local demo checkpoint; prints its path")
    demo_p.add_argument("--force", action="store_true", help="rebuild even if cached")
    demo_p.set_defaults(func=cmd_demo_model)

    check_p = sub.add_parser("check-config", help="validate a config and print it with defaults filled in")
    _add_config_flags(check_p)
    check_p.set_defaults(func=cmd_check_config)

    sc_p = sub.add_parser("serve-config", help="print the Ray Serve config YAML (for `serve deploy`)")
    _add_config_flags(sc_p)
    sc_p.add_argument("--env", action="store_true",
                      help="print the process-level Ray settings instead, as `export` lines for every node's "
                           "`ray start` (eval \"$(kvtide serve-config --env)\")")
    sc_p.set_defaults(func=cmd_serve_config)

    drain_p = sub.add_parser(
        "drain-node", help="before this Ray node stops (a pod's preStop): have Serve move the app's replicas off it "
                           "and let its streams finish; exits 0 within --timeout-s")
    drain_p.add_argument("--timeout-s", type=float, required=True,
                         help="longest to wait, and the drain deadline Ray is given: at least the request deadline "
                              "(frontend.admission.request_timeout_s) for no stream to be cut, more for the "
                              "replacements to start before this node's replicas stop")
    drain_p.add_argument("--address",
                         help="Ray's GCS address (default: RAY_ADDRESS, else the Ray started on this machine)")
    drain_p.add_argument("--node-id",
                         help="hex id of the Ray node to drain (default: the one at this machine's address)")
    drain_p.add_argument("--node-ip-address",
                         help="this node's address as Ray knows it (default: Ray's own detection)")
    drain_p.add_argument("--app",
                         help="the Serve application (default: kvtide's, as serve-config and the chart name it)")
    drain_p.set_defaults(func=cmd_drain_node)

    from kvtide.autoscaling.cli import register as register_plan

    register_plan(sub)

    from kvtide.dashboards.cli import register as register_dashboards

    register_dashboards(sub)

    for command in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        command.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvtide: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # interrupted while starting: what had started is stopped already
        print("kvtide: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
