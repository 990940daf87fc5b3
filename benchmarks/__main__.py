"""`python -m kvtide.benchmarks bench ...`: the bench commands without the kvtide CLI (same flags)."""

from __future__ import annotations

import argparse
import sys

from kvtide.benchmarks.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtide.benchmarks")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # ConfigError is a ValueError: print its field-by-field message
        print(f"kvtide bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
