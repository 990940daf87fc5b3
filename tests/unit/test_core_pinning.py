"""The engine core's main thread stays pinned and every thread that inherits the pin is freed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

from kvtide.deployments.engine import core_pinning
from kvtide.deployments.engine.core_pinning import (EngineCorePin, engine_core_pids, engine_cores_exited, logger,
                                                    threads_to_free)

# A stand-in engine core: one helper thread at start, another each time it reads a line (as vLLM's
# lazily started pools do), each announced on stdout once it runs.
_CHILD = """
import sys, threading
stop = threading.Event()
def start():
    threading.Thread(target=stop.wait, daemon=True).start()
    print("started", flush=True)
start()
for _ in sys.stdin:
    start()
"""


def test_only_threads_carrying_exactly_the_main_threads_pin_are_freed():
    """The main thread and threads with any other affinity are left; exact copies of the pin are freed."""
    pin = frozenset({0})
    affinities = {10: pin, 11: frozenset({0, 1}), 12: pin, 13: frozenset({1}), 14: frozenset({0, 2})}
    assert threads_to_free(10, affinities, pin) == [12]


def _thread_affinities(pid: int) -> dict[int, frozenset[int]]:
    return {int(tid): frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def test_a_thread_started_after_the_pin_is_freed_by_the_next_apply():
    """A real process: apply pins its main thread; a thread it starts later inherits the pin until apply runs again."""
    free = frozenset(os.sched_getaffinity(0))
    assert len(free) >= 2, "needs two cores to tell pinned from free"
    pinned = frozenset({min(free)})
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "started"
        pin = EngineCorePin(pinned, free, find_engine_cores=lambda: [child.pid])
        pin.apply()
        threads = _thread_affinities(child.pid)
        assert threads.pop(child.pid) == pinned
        assert threads and set(threads.values()) == {free}

        child.stdin.write("more\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "started"
        assert pinned in {cores for tid, cores in _thread_affinities(child.pid).items() if tid != child.pid}
        pin.apply()
        threads = _thread_affinities(child.pid)
        assert threads.pop(child.pid) == pinned
        assert set(threads.values()) == {free}
        assert pin.freed_threads == 1
    finally:
        child.kill()
        child.wait()


def test_an_engine_with_every_core_is_left_alone():
    """When the engine's cores are all the replica has, apply changes nothing (and finds no process)."""
    def must_not_look() -> list[int]:
        raise AssertionError("apply looked for engine cores although the engine has every core")

    free = frozenset(os.sched_getaffinity(0))
    EngineCorePin(free, free, find_engine_cores=must_not_look).apply()


def test_a_process_that_is_gone_is_skipped(caplog, monkeypatch):
    """An engine core that exited leaves a warning, not an exception."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    free = frozenset(os.sched_getaffinity(0))
    assert len(free) >= 2, "needs two cores: an engine with every core is never pinned"
    # The replica logger sits under `ray.serve`, which stops propagation once Ray is imported,
    # so caplog's handler listens on the logger itself (and only there: each record once).
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            EngineCorePin(frozenset({min(free)}), free, find_engine_cores=lambda: [child.pid]).apply()
    finally:
        logger.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"could not pin engine core {child.pid}: "), warnings


def test_engine_cores_count_as_exited_only_once_every_known_one_is_gone():
    """A replica's health check fails when its engine-core processes all exited; an in-process engine (no pid) never fails it."""
    assert not engine_cores_exited([])
    running = subprocess.Popen(["sleep", "60"])
    finished = subprocess.Popen(["true"])
    finished.wait()
    try:
        assert not engine_cores_exited([running.pid, finished.pid])  # one still runs
        assert engine_cores_exited([finished.pid])
        running.kill()
        running.wait()
        assert engine_cores_exited([running.pid, finished.pid])
    finally:
        running.kill()


def test_engine_core_pids_come_from_vllms_process_handles_whatever_the_title(monkeypatch):
    """The pids are those of the processes vLLM's client started; the title search only when it keeps none."""
    monkeypatch.setattr(core_pinning, "engine_core_children", lambda: [999])
    processes = [SimpleNamespace(pid=41), SimpleNamespace(pid=None), SimpleNamespace(pid=42)]  # None: not started
    engine = SimpleNamespace(engine_core=SimpleNamespace(
        resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=processes))))
    assert engine_core_pids(engine) == [41, 42]
    no_manager = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=None)))
    assert engine_core_pids(no_manager) == [999]
    assert engine_core_pids(SimpleNamespace()) == [999]
