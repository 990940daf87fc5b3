"""`kvtide dashboards ...`: export the generated dashboards, or push them to a Grafana.

cluster/cli.py calls `register(subparsers)`; each subcommand sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    dash = subparsers.add_parser("dashboards", help="Grafana dashboards: export JSON or push to a Grafana")
    sub = dash.add_subparsers(dest="dashboards_command", required=True)

    push = sub.add_parser("push", help="create or update kvtide's dashboards in a Grafana (idempotent)")
    push.add_argument("--grafana-url", required=True, help="e.g. http://grafana.monitoring:3000")
    push.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                      help="service-account token (default: $GRAFANA_TOKEN)")
    push.add_argument("--user", help="basic-auth user (instead of --token)")
    push.add_argument("--password", default=os.environ.get("GRAFANA_PASSWORD"),
                      help="basic-auth password (default: $GRAFANA_PASSWORD)")
    push.add_argument("--folder", default="kvtide", help="folder title, created if missing (default: kvtide)")
    push.set_defaults(func=cmd_push)

    export = sub.add_parser("export", help="write the dashboards' JSON into DIR")
    export.add_argument("dir", type=Path, help="output directory (created if missing)")
    export.set_defaults(func=cmd_export)


def cmd_push(args: argparse.Namespace) -> int:
    from kvtide.dashboards.build import build_all
    from kvtide.dashboards.grafana_push import PushError, push_dashboards

    if args.token and args.user:
        print("kvtide: give either --token or --user/--password, not both", file=sys.stderr)
        return 2
    if args.user and not args.password:
        print("kvtide: --user needs --password (or $GRAFANA_PASSWORD)", file=sys.stderr)
        return 2
    try:
        result = push_dashboards(args.grafana_url, build_all(), token=args.token, user=args.user,
                                 password=args.password, folder=args.folder)
    except PushError as exc:
        print(f"kvtide: {exc}", file=sys.stderr)
        return 1
    print(f"kvtide: pushed {len(result.dashboards)} dashboards to folder '{args.folder}' "
          f"({', '.join(result.dashboards)})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from kvtide.dashboards.build import write_dashboards

    for path in write_dashboards(args.dir):
        print(path)
    return 0
