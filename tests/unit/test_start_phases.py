"""start_phases: an engine replica's start-up split into process, import, engine and warm-start seconds."""

from __future__ import annotations

from kvtide.deployments.engine.start_phases import PHASES, describe, start_phases


def test_phases_are_the_gaps_between_stamps():
    """Each phase is the time between consecutive stamps, in the documented order."""
    phases = start_phases(100.0, 103.5, 111.0, 140.0, 141.25)
    assert phases == {"process": 3.5, "import": 7.5, "engine": 29.0, "warm_start": 1.25}
    assert tuple(phases) == PHASES


def test_a_clock_step_backwards_reads_as_zero():
    """Wall-clock stamps can step back (NTP): a phase is never negative."""
    assert start_phases(100.0, 99.0, 101.0, 101.0, 102.0)["process"] == 0.0


def test_describe_names_each_phase_and_the_total():
    """The log line lists every phase and their sum."""
    line = describe(start_phases(0.0, 1.0, 3.0, 6.0, 10.0))
    assert line == "process 1.0 s, import 2.0 s, engine 3.0 s, warm_start 4.0 s; total 10.0 s"
