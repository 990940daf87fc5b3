"""`kvtide serve` stops cleanly on Ctrl-C and on SIGTERM: exit 0, in bound, and no process left behind.

Each case starts the real CLI in a process group of its own (its own Ray instance, on ports
apart from the session cluster's), waits for it to serve, sends the signal with nothing in
flight, and checks every process it had started (Ray's GCS, raylet and agents, the Serve
controller, HAProxy, the replicas, vLLM's engine cores) is gone once it has exited.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
from support import REPO

READY_TIMEOUT_S = 300.0
# The CLI's drain bound (cluster.local.STOP_DRAIN_TIMEOUT_S) plus the kill grace twice: an
# idle cluster stops far sooner (the run prints how long it took).
EXIT_BOUND_S = 30.0


def _serve(port: int) -> tuple[subprocess.Popen, "queue.Queue[str]"]:
    env = {**os.environ,
           # Apart from the session cluster's HAProxy, fallback proxy and metrics ports.
           "RAY_SERVE_HAPROXY_STATS_PORT": str(port + 404), "RAY_SERVE_HAPROXY_METRICS_PORT": str(port + 1101),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(port + 500),
           "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(port + 1500)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtide.cluster.cli", "serve", "--config", str(REPO / "config/presets/cpu.yaml"),
         "--replicas", "1", "--port", str(port), "--set", f"metrics.port={port + 80}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


def _wait_for_line(proc: subprocess.Popen, lines: "queue.Queue[str]", prefix: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            assert proc.poll() is None, f"kvtide serve exited early ({proc.returncode}):\n" + "".join(seen[-40:])
            continue
        seen.append(line)
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"no {prefix!r} line within {timeout_s:.0f} s:\n" + "".join(seen[-40:]))


def _session_processes(session_id: int) -> list[str]:
    """Processes still running in a session: every process `kvtide serve` starts stays in its session,
    including those started after the snapshot of its descendants (HAProxy's reloads) and orphans."""
    left = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getsid(proc.pid) == session_id and proc.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {proc.info['name']}")
        except (OSError, psutil.Error):  # gone meanwhile
            pass
    return left


def _kill_session(session_id: int) -> None:
    """SIGKILL every process still in a session (a failed run's cleanup)."""
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == session_id:
                proc.kill()
        except (OSError, psutil.Error):  # gone meanwhile
            pass


def test_serve_stops_on_sigint_and_on_sigterm_with_exit_0_and_no_process_left():
    """`kvtide serve` given SIGINT (then at once SIGTERM), and another given SIGTERM, each exit 0 in bound, leaving no process."""
    # Both clusters start side by side: one wait for two starts.
    servers = {sig: _serve(port) for sig, port in ((signal.SIGINT, 18600), (signal.SIGTERM, 18700))}
    try:
        descendants = {}
        for sig, (proc, lines) in servers.items():
            _wait_for_line(proc, lines, "kvtide: ready", READY_TIMEOUT_S)
            port = 18600 if sig == signal.SIGINT else 18700
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
            descendants[sig] = psutil.Process(proc.pid).children(recursive=True)
            assert any("raylet" in " ".join(p.cmdline()) for p in descendants[sig] if p.is_running())
        for sig, (proc, lines) in servers.items():
            signalled_s = time.monotonic()
            proc.send_signal(sig)
            if sig == signal.SIGINT:
                # A second signal on the heels of the first (Ctrl-C, then a supervisor's TERM)
                # runs the handler again while the first is still in it: it must not hang.
                proc.send_signal(signal.SIGTERM)
            returncode = proc.wait(timeout=EXIT_BOUND_S + 30)
            exit_s = time.monotonic() - signalled_s
            output = "".join(iter(lambda: lines.get(timeout=5), "kvtide: stopped.\n")) if returncode == 0 else ""
            print(f"\n{signal.Signals(sig).name}: exit {returncode} after {exit_s:.1f} s")
            assert returncode == 0, output
            assert exit_s < EXIT_BOUND_S
            left = [f"{p.pid} {p.name()}" for p in descendants[sig]
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            assert left == [], signal.Signals(sig).name
            assert _session_processes(proc.pid) == [], signal.Signals(sig).name  # start_new_session: sid = pid
    finally:
        # Every process of each session, not just the leader's group: Ray puts HAProxy and
        # others in groups of their own, and one left behind holds its ports for later runs.
        for proc, _ in servers.values():
            _kill_session(proc.pid)
            proc.wait()
