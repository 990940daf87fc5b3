"""Waiting for the app to serve, with a bound on replicas that keep failing to start.

Serve retries a replica whose constructor fails. Before any replica of a deployment has
started it gives up after a few tries (the app goes DEPLOY_FAILED); once one replica runs,
it retries the others forever. A start that cannot succeed then hangs: e.g. the second
engine on a shared GPU finding less free memory than vLLM's utilization check wants.
`StartupWatch` turns that into an error once failures have persisted for `grace_s`,
quoting Serve's message (which carries the replica's exception). Pure logic; the Ray
polling loop is `cluster.local.wait_until_running`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

# Serve's deployment messages while a replica fails to start (ray/serve/_private/deployment_state.py).
FAILURE_PREFIXES = ("A replica failed to start", "The deployment failed to start")


class StartupFailed(RuntimeError):
    """The app did not come up: Serve gave up, or its replicas kept failing past the grace period."""


@dataclass
class StartupWatch:
    """Feed it each status poll; it says when the app serves and raises when it will not."""

    grace_s: float
    failing_since_s: float | None = None

    def serving(self, app_status: str, app_message: str, deployment_messages: Mapping[str, str],
                now_s: float) -> bool:
        """True once the app is RUNNING; False to keep waiting; raises StartupFailed."""
        if app_status == "RUNNING":
            return True
        failures = {name: msg for name, msg in deployment_messages.items() if msg.startswith(FAILURE_PREFIXES)}
        if app_status == "DEPLOY_FAILED":
            raise StartupFailed(_describe("failed to deploy", app_message, failures))
        if not failures:
            self.failing_since_s = None  # a retry got past the failure: restart the clock
            return False
        if self.failing_since_s is None:
            self.failing_since_s = now_s
        if now_s - self.failing_since_s >= self.grace_s:
            raise StartupFailed(_describe(
                f"kept failing to start for {self.grace_s:.0f} s (Serve retries forever once one replica runs)",
                app_message, failures))
        return False


def _describe(what: str, app_message: str, failures: Mapping[str, str]) -> str:
    lines = [f"the kvtide app {what}"]
    lines += [f"{name}: {msg}" for name, msg in failures.items()] or ([app_message] if app_message else [])
    return "\n".join(lines)
