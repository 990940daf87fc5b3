"""CPU engines claim cores of their own while free ones exist (deployments/engine/core_claims.py)."""

import subprocess
import sys
import textwrap

import pytest

from kvtide.deployments.engine.core_claims import CoreClaims, choose_cores, claim_threads_bind
from kvtide.deployments.engine.placement import core_preference


@pytest.mark.parametrize(("rank", "tp", "cores", "expected"), [
    (0, 1, [0, 1], [0, 1]),
    (1, 1, [0, 1], [1, 0]),
    (2, 1, [0, 1], [0, 1]),
    (1, 2, [3, 2, 1, 0], [2, 3, 0, 1]),
])
def test_preference_starts_at_the_ranks_core_and_lists_every_core_once(rank, tp, cores, expected):
    """A replica tries the cores cpu_threads_bind gives its rank first, then the others in turn."""
    assert core_preference(rank, tp, cores) == expected


@pytest.mark.parametrize(("preference", "tp", "engines", "expected"), [
    ([0, 1], 1, {}, [0]),                  # an idle machine: the rank's core, as binding by rank gives
    ([0, 1], 1, {0: 1}, [1]),              # the rank's core serves an engine: the idle one
    ([0, 1], 1, {0: 2, 1: 1}, [1]),        # none idle: the least used
    ([0, 1], 1, {0: 1, 1: 1}, [0]),        # all equally used: the rank's
    ([2, 3, 0, 1], 2, {2: 1, 0: 1}, [3, 1]),
    ([2, 3, 0, 1], 2, {2: 1, 3: 1, 0: 1}, [1, 2]),  # one idle core: it, then the first preferred of the rest
    ([0, 1], 4, {}, [0, 1, 0, 1]),         # more workers than cores: they repeat, as cpu_threads_bind's
])
def test_choose_cores_takes_the_least_used_cores_in_preference_order(preference, tp, engines, expected):
    """Each worker gets the core with the fewest engines, ties broken by the replica's order."""
    held = {(core, slot) for core, count in engines.items() for slot in range(count)}

    def try_claim(core: int, slot: int) -> bool:
        if (core, slot) in held:
            return False
        held.add((core, slot))
        return True

    assert choose_cores(preference, tp, try_claim) == expected


def test_claims_stop_once_every_worker_has_a_core():
    """A replica does not hold cores it will not bind: it stops claiming at tp cores."""
    tried = []
    choose_cores([0, 1, 2, 3], 2, lambda core, slot: tried.append((core, slot)) or True)
    assert tried == [(0, 0), (1, 0)]


def test_past_the_slot_limit_workers_bind_by_rank_order():
    """With every slot of every core held, the replica still gets cores: its rank's, unclaimed."""
    assert choose_cores([1, 0], 1, lambda core, slot: False) == [1]


HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kvtide.deployments.engine.core_claims import CoreClaims
    claims = CoreClaims(Path(sys.argv[1]))
    assert claims.try_claim(0, 0)
    print("claimed", flush=True)
    sys.stdin.read()
""")


def test_a_core_held_by_a_live_process_is_skipped_and_freed_when_it_is_killed(tmp_path):
    """Another process's engine on core 0 makes a replica of rank 0 bind core 1; SIGKILL of the holder frees core 0."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        claims = CoreClaims(tmp_path)
        assert claim_threads_bind(0, 1, [0, 1], claims) == "1"
        assert claims.held == [(1, 0)]
    finally:
        holder.kill()
        holder.wait()
    assert claims.try_claim(0, 0), "the killed holder's lock went with its process"
    claims.release()


def test_released_claims_are_free_again(tmp_path):
    """A second engine on a busy machine counts as a second slot; closing the first's claims frees its slots."""
    first, second = CoreClaims(tmp_path), CoreClaims(tmp_path)
    assert claim_threads_bind(0, 2, [0, 1], first) == "0|1"
    assert claim_threads_bind(0, 2, [0, 1], second) == "0|1"
    assert second.held == [(0, 1), (1, 1)]
    first.release()
    third = CoreClaims(tmp_path)
    assert third.try_claim(0, 0), "the released slot is free"
    second.release()
    third.release()


def test_an_unusable_claims_directory_binds_by_rank(tmp_path):
    """Claims that cannot be made (the directory is a file) fall back to the rank's cores, holding nothing."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    claims = CoreClaims(blocker)
    assert claim_threads_bind(1, 1, [0, 1], claims) == "1"
    assert claims.held == []
