"""cluster.local.stop(): drains only when it has to, stops engines before Ray, leaves no process."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import psutil
import pytest
import ray
from ray import serve

from kvtide.cluster import local


def test_stop_without_a_ray_connection_starts_no_new_ray(monkeypatch):
    """Not connected to Ray (an interrupted start): stop skips serve.shutdown, which would start a fresh Ray."""
    calls: list[str] = []
    monkeypatch.setattr(local, "_adopt_orphans", lambda: None)  # leave the test process as it is
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    # Not the real sweep: in a full run this process's children are the integration tests'
    # Ray cluster, and killing its GCS makes Ray exit this process (rc 1, no pytest summary).
    monkeypatch.setattr(local, "_terminate_then_kill", lambda procs, grace_s: calls.append("sweep"))
    local.stop(drain_timeout_s=1.0)
    assert calls == ["ray.shutdown", "sweep"]


@pytest.mark.parametrize("in_flight, ray_outlives_stop, drains", [
    (0, False, False),    # idle, and Ray goes down next: nothing to wait for
    (3, False, True),     # requests in flight finish first
    (None, False, True),  # the count failed: they may be in flight
    (0, True, True),      # a cluster that outlives the stop: only Serve removes the app
])
def test_serve_drains_only_when_requests_may_be_in_flight_or_ray_outlives_the_stop(in_flight, ray_outlives_stop,
                                                                                    drains):
    """The drain decision: skipped only when nothing is in flight and this stop takes Ray down."""
    assert local.serve_drain_needed(in_flight, ray_outlives_stop=ray_outlives_stop) is drains


def _connected_stop(monkeypatch, in_flight: int | None) -> list[str]:
    """Run stop() as if connected to a Ray instance it started, recording the steps it takes."""
    calls: list[str] = []
    monkeypatch.setattr(local, "_adopt_orphans", lambda: None)  # leave the test process as it is
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(local, "requests_in_flight", lambda: in_flight)
    monkeypatch.setattr(local, "_started_ray_here", lambda procs: True)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(local, "_stop_engines", lambda procs: calls.append("stop engines"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(local, "_terminate_then_kill", lambda procs, grace_s: calls.append("sweep"))
    # Not through the root logger: a Ray log filter an earlier test installed there asks the
    # (here pretended) Ray connection for its worker id.
    quiet = logging.getLogger("kvtide.local.unit-test")
    quiet.propagate = False
    monkeypatch.setattr(local, "logger", quiet)
    local.stop(drain_timeout_s=5.0)
    return calls


def test_idle_stop_skips_serve_drain_and_stops_engines_before_ray(monkeypatch):
    """Nothing in flight: no Serve drain; the engines go first (GPUs freed), then Ray."""
    assert _connected_stop(monkeypatch, in_flight=0) == ["stop engines", "ray.shutdown", "sweep"]


def test_stop_with_requests_in_flight_drains_serve_first(monkeypatch):
    """Requests in flight: Serve drains them before anything is stopped under them."""
    assert _connected_stop(monkeypatch, in_flight=2) == ["serve.shutdown", "stop engines", "ray.shutdown", "sweep"]


def test_in_flight_count_unknown_when_ray_fails(monkeypatch):
    """A failed count is None (so the stop drains), not zero."""
    def fail(**_kwargs):
        raise ConnectionError("GCS unreachable")

    monkeypatch.setattr(ray.util, "list_named_actors", fail)
    assert local.requests_in_flight(timeout_s=0.1) is None


class FakeProc:
    """A psutil.Process stand-in: a command line and children; `gone` ones raise like a vanished process."""

    def __init__(self, cmdline: str, children: list["FakeProc"] = (), gone: bool = False) -> None:
        self._cmdline, self._children, self._gone = cmdline, list(children), gone

    def cmdline(self) -> list[str]:
        if self._gone:
            raise psutil.NoSuchProcess(0)
        return self._cmdline.split()

    def children(self, recursive: bool = False) -> list["FakeProc"]:
        assert recursive
        return self._children


def test_engine_processes_are_those_under_the_engine_replicas():
    """Only what runs under an engine replica counts: not the replica, not other replicas' or Ray's processes."""
    core, worker = FakeProc("VLLM::EngineCore"), FakeProc("VLLM::Worker")
    engine = FakeProc("ray::ServeReplica:kvtide:Engine.handle_request", [core, worker])
    router = FakeProc("ray::ServeReplica:kvtide:Router", [FakeProc("helper")])
    procs = [FakeProc("raylet --flags"), engine, router, FakeProc("ray::ServeReplica:kvtide:Engine", gone=True)]
    assert local.engine_processes(procs) == [core, worker]


def _child(code: str) -> psutil.Process:
    """A child running `code` once it has printed that it is set up (signal handler installed)."""
    proc = subprocess.Popen([sys.executable, "-c", code + "\n"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return psutil.Process(proc.pid)


def test_terminate_then_kill_kills_what_ignores_sigterm_and_reaps_everything():
    """SIGTERM first; a process ignoring it is killed after the grace; none is left, not even a zombie."""
    polite = _child("import signal; print('ready', flush=True); signal.pause()")
    stubborn = _child("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                      "signal.pause()")
    local._terminate_then_kill([polite, stubborn], grace_s=1.0)
    for proc in (polite, stubborn):
        assert not psutil.pid_exists(proc.pid)  # exited and reaped


def test_wait_exited_counts_a_zombie_as_exited():
    """A process that exited but is not reaped yet is not waited for (and this process reaps its own)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # blocks until it exits, leaves it unreaped
    assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    assert local.wait_exited([psutil.Process(proc.pid)], timeout_s=5.0) == []
    assert not psutil.pid_exists(proc.pid)


def test_wait_exited_returns_the_survivors_after_the_timeout():
    """A process still running at the timeout is returned for the caller to kill."""
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        assert [p.pid for p in local.wait_exited([psutil.Process(proc.pid)], timeout_s=0.2)] == [proc.pid]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


ADOPTER = """
import os, subprocess, psutil
from kvtide.cluster import local
local._adopt_orphans()
orphan_pid = int(subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout)
orphan = psutil.Process(orphan_pid)
print(orphan.ppid() == os.getpid())
orphan.kill()
orphan.wait()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="child subreapers are Linux's")
def test_a_stopping_process_adopts_its_orphaned_descendants():
    """A grandchild whose parent exits is re-parented to the stopping process, where its sweep finds it."""
    out = subprocess.run([sys.executable, "-c", ADOPTER], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
