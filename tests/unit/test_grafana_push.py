"""`kvtide dashboards push` speaks Grafana's folder and dashboard API, idempotently, and explains failures.

A local HTTP server on 127.0.0.1 plays Grafana: it records every request and keeps
folders and dashboards by uid, answering as Grafana's API does.
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from kvtide.dashboards import cli
from kvtide.dashboards.build import build_all

TOKEN = "glsa_test"


class FakeGrafana:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.folders: dict[str, str] = {}  # uid -> title
        self.dashboards: dict[str, dict[str, Any]] = {}  # uid -> {"dashboard", "folderUid"}
        self.force_status: int | None = None


def _handler(state: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            auth = self.headers.get("Authorization", "")
            basic = "Basic " + base64.b64encode(b"admin:secret").decode()
            return auth in (f"Bearer {TOKEN}", basic)

        def _handle(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            state.requests.append((method, self.path, body))
            if state.force_status:
                return self._reply(state.force_status, {"message": "forced"})
            if not self._authorized():
                return self._reply(401, {"message": "invalid API key"})
            path = self.path.split("?")[0]
            if method == "GET" and path == "/api/folders":
                return self._reply(200, [{"uid": u, "title": t} for u, t in state.folders.items()])
            if method == "POST" and path == "/api/folders":
                uid = body.get("uid") or f"f{len(state.folders) + 1}"
                state.folders[uid] = body["title"]
                return self._reply(200, {"uid": uid, "title": body["title"]})
            if method == "POST" and path == "/api/dashboards/db":
                uid = body["dashboard"]["uid"]
                if uid in state.dashboards and not body.get("overwrite"):
                    return self._reply(412, {"message": "version-mismatch"})
                state.dashboards[uid] = {"dashboard": body["dashboard"], "folderUid": body.get("folderUid")}
                return self._reply(200, {"uid": uid, "status": "success", "version": 1})
            return self._reply(404, {"message": "not found"})

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

    return Handler


@pytest.fixture
def grafana() -> Iterator[tuple[str, FakeGrafana]]:
    state = FakeGrafana()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvtide")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dashboards", *argv])
    return args.func(args)


def test_push_creates_folder_and_posts_every_dashboard(grafana, capsys) -> None:
    """First push creates the folder, then POSTs each dashboard with its uid, folderUid and overwrite."""
    url, state = grafana
    assert _run("push", "--grafana-url", url, "--token", TOKEN, "--folder", "LLM serving") == 0
    assert list(state.folders.values()) == ["LLM serving"]
    (folder_uid,) = state.folders
    posts = [body for method, path, body in state.requests if (method, path) == ("POST", "/api/dashboards/db")]
    built = build_all()
    assert [p["dashboard"]["uid"] for p in posts] == [d["uid"] for d in built.values()]
    for post, dashboard in zip(posts, built.values()):
        assert post["folderUid"] == folder_uid and post["overwrite"] is True
        assert post["dashboard"]["panels"] == dashboard["panels"] and "id" not in post["dashboard"]
    assert "pushed 4 dashboards" in capsys.readouterr().out


def test_repush_is_idempotent(grafana) -> None:
    """A second push reuses the folder and updates the same uids in place."""
    url, state = grafana
    assert _run("push", "--grafana-url", url, "--token", TOKEN) == 0
    first = json.dumps(state.dashboards, sort_keys=True)
    assert _run("push", "--grafana-url", url, "--token", TOKEN) == 0
    assert len(state.folders) == 1
    assert json.dumps(state.dashboards, sort_keys=True) == first
    folder_creates = [r for r in state.requests if r[:2] == ("POST", "/api/folders")]
    assert len(folder_creates) == 1


def test_basic_auth_works(grafana) -> None:
    """--user/--password authenticate with HTTP basic auth."""
    url, state = grafana
    assert _run("push", "--grafana-url", url, "--user", "admin", "--password", "secret") == 0
    assert len(state.dashboards) == 4


def test_bad_token_fails_with_a_clear_message(grafana, capsys) -> None:
    """401 exits non-zero and says the credentials were rejected; nothing is written."""
    url, state = grafana
    assert _run("push", "--grafana-url", url, "--token", "wrong") == 1
    err = capsys.readouterr().err
    assert "rejected the credentials (401 Unauthorized)" in err and url in err
    assert not state.dashboards


def test_forbidden_names_the_missing_permission(grafana, capsys) -> None:
    """403 exits non-zero and names the role needed."""
    url, state = grafana
    state.force_status = 403
    assert _run("push", "--grafana-url", url, "--token", TOKEN) == 1
    assert "403 Forbidden" in capsys.readouterr().err


def test_unreachable_server_fails_with_a_clear_message(capsys) -> None:
    """A closed port exits non-zero with 'cannot reach Grafana'."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert _run("push", "--grafana-url", f"http://127.0.0.1:{port}", "--token", TOKEN) == 1
    assert "cannot reach Grafana" in capsys.readouterr().err


def test_export_writes_the_json(tmp_path) -> None:
    """`kvtide dashboards export DIR` writes one JSON file per dashboard."""
    assert _run("export", str(tmp_path / "out")) == 0
    files = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert files == sorted(build_all())
