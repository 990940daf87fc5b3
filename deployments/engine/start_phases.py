"""Where an engine replica's start-up time goes, phase by phase (logged, and exported as a gauge).

Why: a new replica serves many times later after the autoscaler's decision than vLLM's
own engine init alone takes. The rest is Ray placing the actor, Python importing vLLM in
the replica, and vLLM spawning its engine-core process, which imports it again. Each
replica says how long each took, so a run shows which one to cut.

Phases, from wall-clock stamps taken in the replica's constructor:
    process       the actor's process start → the constructor (a pre-started Ray worker
                  may have idled in the pool: an upper bound on process start-up)
    import        importing vLLM in the replica
    engine        AsyncLLM.from_engine_args: engine-core process spawn, its imports,
                  model load, KV cache, CUDA graphs
    warm_start    prefilling the fleet's hot prefixes

And, once a standby has been woken (engine/standby.py), the gauge's phase `wake`: vLLM's wake
from sleep mode plus the warm-up prefill, the whole of what a scale-up waits for with a standby.
"""

from __future__ import annotations

PHASES = ("process", "import", "engine", "warm_start")
WAKE_PHASE = "wake"


def start_phases(process_start_s: float, constructor_s: float, imported_s: float, engine_s: float,
                 warm_s: float) -> dict[str, float]:
    """Seconds per phase from the stamps (time.time()); a clock step backwards reads as 0."""
    stamps = (process_start_s, constructor_s, imported_s, engine_s, warm_s)
    return {phase: max(0.0, end - start) for phase, start, end in zip(PHASES, stamps, stamps[1:])}


def describe(phases: dict[str, float]) -> str:
    """One log line: each phase and the total."""
    parts = ", ".join(f"{phase} {phases[phase]:.1f} s" for phase in PHASES)
    return f"{parts}; total {sum(phases.values()):.1f} s"
