"""Loggers for code that runs inside Ray Serve replicas."""

from __future__ import annotations

import logging


def replica_logger(name: str) -> logging.Logger:
    """`ray.serve.kvtide.<name>`: a child of Ray Serve's logger, so in a replica its lines land in the
    replica's Serve log file. A plain `kvtide.*` logger has no handler there and its INFO lines
    (a replica's start-up phases, warm start, failures it recovered from) were dropped."""
    return logging.getLogger(f"ray.serve.kvtide.{name}")
