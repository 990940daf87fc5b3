"""Create or update kvtide's dashboards in a Grafana, through its HTTP API (grafana-client).

Idempotent: each dashboard keeps its uid and is posted with `overwrite: true`, so a
re-push updates in place; the folder is looked up by title and created only if missing.
Failures become `PushError` with a message an operator can act on (bad credentials,
missing permission, unreachable server), and the CLI exits non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_FOLDER = "kvtide"


class PushError(RuntimeError):
    """A push that did not happen, with the reason in words."""


@dataclass(frozen=True)
class PushResult:
    folder_uid: str
    dashboards: tuple[str, ...]  # uids, in push order


def push_dashboards(grafana_url: str, dashboards: dict[str, dict[str, Any]], *, token: str | None = None,
                    user: str | None = None, password: str | None = None, folder: str = DEFAULT_FOLDER,
                    timeout_s: float = 10.0) -> PushResult:
    """Push every dashboard (name → JSON model) into `folder`; returns what was written."""
    from grafana_client import GrafanaApi

    credential: Any = token if token else ((user, password) if user else None)
    api = GrafanaApi.from_url(grafana_url.rstrip("/"), credential=credential, timeout=timeout_s)
    with _explained(grafana_url):
        folder_uid = _ensure_folder(api, folder)
        uids = []
        for dashboard in dashboards.values():
            body = {k: v for k, v in dashboard.items() if k not in ("id", "version")}
            api.dashboard.update_dashboard({"dashboard": body, "folderUid": folder_uid, "overwrite": True,
                                            "message": "kvtide dashboards push"})
            uids.append(dashboard["uid"])
    return PushResult(folder_uid, tuple(uids))


def _ensure_folder(api: Any, title: str) -> str:
    for existing in api.folder.get_all_folders():
        if existing.get("title") == title:
            return existing["uid"]
    return api.folder.create_folder(title)["uid"]


class _explained:
    """Turns grafana-client and transport errors into PushError messages."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        from grafana_client.client import GrafanaClientError, GrafanaException

        status = getattr(exc, "status_code", None)
        if isinstance(exc, GrafanaClientError) and status == 401:
            raise PushError(f"Grafana at {self.url} rejected the credentials (401 Unauthorized): "
                            "check --token, or --user/--password") from exc
        if isinstance(exc, GrafanaClientError) and status == 403:
            raise PushError(f"Grafana at {self.url} denied the request (403 Forbidden): the token or user "
                            "needs the Editor role (folders:create, dashboards:write)") from exc
        if isinstance(exc, GrafanaException):
            if status in (0, None):
                raise PushError(f"cannot reach Grafana at {self.url}: {exc.message}") from exc
            raise PushError(f"Grafana at {self.url} answered {status}: {exc.message}") from exc
        if isinstance(exc, OSError) or type(exc).__module__.startswith(("niquests", "urllib3", "requests")):
            raise PushError(f"cannot reach Grafana at {self.url}: {exc}") from exc
        return False
