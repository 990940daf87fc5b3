"""Which cores a CPU engine binds: the least-used ones on the machine, whatever its rank.

vLLM binds each CPU worker's OpenMP threads to one core, and engines bound to one core take turns
on it while other cores may idle: a replica starting on a serving engine's core starts, and then
serves, at a fraction of its speed (OpenMP threads spin while they wait). The replica's rank spreads engines
that start together (`placement.cpu_threads_bind`: rank r takes core r·tp mod n), but a rank does
not say which cores are in use: Serve gives a replacement a fresh rank while the replica it
replaces still holds its own (Serve releases a rank only once that replica has stopped), so a
replacement can land on a serving engine's core while the lost one's core idles.

So a replica claims its cores: an exclusive `flock` on a slot file per (core, slot) in a
directory shared by every replica on the machine, held open for the replica's life. The kernel
drops a lock when its process exits, however it exits, so a slot is claimable exactly when no
live replica holds it. A replica takes, for each TP worker, the first claimable slot scanning
slot 0 of every core, then slot 1, ...: the least-used cores, and among equals its rank's order
(the cores `cpu_threads_bind` gives it first), so a fleet started together binds as before.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
from pathlib import Path
from typing import Callable

from kvtide.deployments.engine.placement import core_preference, cpu_threads_bind
from kvtide.deployments.logs import replica_logger

logger = replica_logger("engine")


# Engines per core a claim can count; past it a worker binds by rank order, unclaimed.
MAX_SLOTS_PER_CORE = 16


def choose_cores(preference: list[int], tensor_parallel_size: int,
                 try_claim: Callable[[int, int], bool]) -> list[int]:
    """One core per TP worker: each the first (core, slot) `try_claim` grants, slot by slot, cores in `preference` order.

    A worker's core differs from the other workers' while the machine has enough cores (they
    repeat, as `cpu_threads_bind`'s, only where it has fewer cores than workers). Claims stop once
    every worker has a core; past MAX_SLOTS_PER_CORE the rest take the first preferred cores left.
    """
    chosen: list[int] = []
    distinct = len(preference) >= tensor_parallel_size
    for slot in range(MAX_SLOTS_PER_CORE):
        for core in preference:
            if len(chosen) == tensor_parallel_size:
                return chosen
            if distinct and core in chosen:
                continue
            if try_claim(core, slot):
                chosen.append(core)
    filler = itertools.cycle([core for core in preference if core not in chosen] or preference)
    while len(chosen) < tensor_parallel_size:
        chosen.append(next(filler))
    return chosen


def default_claims_dir() -> Path:
    """One directory per user on the machine: every replica of that user's clusters sees the same claims."""
    return Path(tempfile.gettempdir()) / f"kvtide-cpu-cores-{os.getuid()}"


class CoreClaims:
    """The cores this process holds (open, locked files); closing them, or exiting, frees them."""

    def __init__(self, claims_dir: Path | None = None):
        self.claims_dir = claims_dir or default_claims_dir()
        self._held: dict[tuple[int, int], int] = {}  # (core, slot) → fd of its locked file

    @property
    def held(self) -> list[tuple[int, int]]:
        """The (core, slot) pairs this process holds."""
        return sorted(self._held)

    def try_claim(self, core: int, slot: int) -> bool:
        """Lock the (core, slot) file without waiting; True when this process now holds it."""
        if (core, slot) in self._held:
            return True
        self.claims_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.claims_dir / f"core-{core}.slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live process
            os.close(fd)
            return False
        self._held[(core, slot)] = fd
        return True

    def release(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()


def claim_threads_bind(replica_rank: int, tensor_parallel_size: int, available_cores: list[int],
                       claims: CoreClaims) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for this replica's engine, its cores claimed in `claims` where free."""
    preference = core_preference(replica_rank, tensor_parallel_size, available_cores)
    try:
        cores = choose_cores(preference, tensor_parallel_size, claims.try_claim)
    except OSError as exc:  # the claims directory unusable: bind by rank alone
        logger.warning("cannot claim CPU cores in %s (%s): binding by replica rank", claims.claims_dir, exc)
        claims.release()
        return cpu_threads_bind(replica_rank, tensor_parallel_size, available_cores)
    shared = [(core, slot) for core, slot in claims.held if slot > 0]
    if shared:
        logger.warning("CPU cores shared with other engines on this machine (core, engines before this one): %s", shared)
    return "|".join(str(core) for core in cores)
