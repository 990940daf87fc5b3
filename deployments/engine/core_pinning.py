"""Keep a CPU engine core's spinning main thread on its engine's cores, and every other thread of it free.

vLLM binds only the workers' OpenMP threads. The engine core's main thread waits for their output
by spinning (`sched_yield`, for a second after each read), so left free it takes most of another
core: on a small machine, the core that HAProxy, the routing peer, the replica's HTTP server and
the clients share. Pinned to the engine's own cores it yields to the worker there instead. Only
the main thread: pinning every thread (its ZMQ input and output threads too) can leave a request
hanging under overload (benchmarks/results/overhead-cpu-engine-core-pinning); those threads carry
requests in and tokens out and must stay free to run on whichever core is idle.

Linux gives a new thread its creator's affinity, so a thread the main thread starts after the pin
(vLLM may start one at any time) would be confined with it. The replica therefore repeats `EngineCorePin.apply` with its gauge refresh: a
thread that inherited the pin is freed within one period.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

from kvtide.deployments.logs import replica_logger

logger = replica_logger("engine")

# vLLM's process title for the engine core (`psutil.Process.name()` is cut at 15 characters).
ENGINE_CORE_TITLE = "VLLM::EngineCore"


def threads_to_free(main_tid: int, affinities: Mapping[int, frozenset[int]],
                    pinned_cores: frozenset[int]) -> list[int]:
    """The threads other than `main_tid` that carry exactly the main thread's pin: they inherited it.

    A thread with any other affinity was placed on purpose (by vLLM or the OS) and is left alone.
    """
    return sorted(tid for tid, cores in affinities.items() if tid != main_tid and cores == pinned_cores)


class EngineCorePin:
    """Pins the main thread of each engine-core child of this process to `pinned_cores`; frees its other threads."""

    def __init__(self, pinned_cores: frozenset[int], free_cores: frozenset[int],
                 find_engine_cores: Callable[[], Iterable[int]] | None = None):
        self.pinned_cores = pinned_cores
        self.free_cores = free_cores  # the replica's own affinity, before any pin
        self._find_engine_cores = find_engine_cores or engine_core_children
        self._engine_core_pids: list[int] = []
        self.freed_threads = 0  # threads that had inherited the pin, over the replica's life

    def apply(self) -> None:
        """Pin each engine core's main thread and free threads that inherited the pin; never raises."""
        if self.pinned_cores == self.free_cores:  # the engine has every core: nothing to confine
            return
        if not self._engine_core_pids:
            self._engine_core_pids = list(self._find_engine_cores())
        for pid in self._engine_core_pids:
            try:
                if frozenset(os.sched_getaffinity(pid)) != self.pinned_cores:
                    os.sched_setaffinity(pid, self.pinned_cores)  # a pid is its main thread's tid: that thread only
                    logger.info("engine core %d: main thread pinned to cores %s", pid, sorted(self.pinned_cores))
                for tid in threads_to_free(pid, _thread_affinities(pid), self.pinned_cores):
                    os.sched_setaffinity(tid, self.free_cores)
                    self.freed_threads += 1
                    logger.info("engine core %d: thread %d had inherited the pin; freed to cores %s",
                                pid, tid, sorted(self.free_cores))
            except OSError as exc:  # gone, or not ours to pin: vLLM's placement stands
                logger.warning("could not pin engine core %d: %s", pid, exc)


def _thread_affinities(pid: int) -> dict[int, frozenset[int]]:
    """Each live thread of `pid` with its affinity (a thread that exits meanwhile is skipped)."""
    found = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        try:
            found[int(name)] = frozenset(os.sched_getaffinity(int(name)))
        except OSError:
            continue
    return found


def engine_cores_exited(pids: Iterable[int]) -> bool:
    """True when engine-core processes were found at start and none of them runs any more.

    vLLM's own monitor marks the engine dead when its core exits; this is the same fact read from
    the process table, so a replica whose engine core is gone fails its health check whatever
    state the engine client is left in. No pid known (an in-process engine): nothing to check.
    """
    import psutil

    pids = list(pids)
    if not pids:
        return False
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:  # gone
            continue
    return True


def engine_core_pids(engine: Any) -> list[int]:
    """Pids of the engine-core processes of `engine` (vLLM's AsyncLLM), from vLLM's own process handles.

    Not by title first: vLLM titles the process VLLM::EngineCore through setproctitle, and on the
    CPU cluster some engine cores (on one start, every one) kept the interpreter's title; a search
    by title then found none, so that replica's core was never pinned nor watched for its exit.
    The title search remains for a client that keeps no handles (another vLLM's layout).
    """
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    processes = getattr(getattr(resources, "engine_manager", None), "processes", None) or []
    pids = [process.pid for process in processes if getattr(process, "pid", None)]
    return pids or engine_core_children()


def engine_core_children() -> list[int]:
    """Pids of this process's descendants titled as vLLM engine cores."""
    import psutil

    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if ENGINE_CORE_TITLE in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            continue
    return pids
