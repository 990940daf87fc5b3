"""The worker-preload benchmark's row and report (benchmarks/worker_preload.py), from hand-built phases."""

from kvtide.benchmarks.worker_preload import markdown, summarize


def _row(variant: str, process_s: float, import_s: float) -> dict:
    phases = {"process": process_s, "import": import_s, "pid": 1}
    return summarize(variant, phases, phases, idle_workers=0) | {"serve_workers_rss_mib": {"ServeController": 170}}


def test_the_new_replicas_cost_is_its_process_plus_import_phase():
    """A preload that moves the import into the process phase leaves the sum unchanged."""
    assert _row("no_preload", 1.5, 5.0)["new_replica_process_plus_import_s"] == 6.5
    assert _row("preload", 6.5, 0.0)["new_replica_process_plus_import_s"] == 6.5


def test_report_states_the_ratio_of_preload_to_no_preload():
    """The report has one line per variant and the preload's sum as a ratio of the one without."""
    report = markdown([_row("no_preload", 2.0, 6.0), _row("preload", 4.0, 0.0)], "python -m x", "CPU")
    assert "| no_preload | 0 | 2.00 / 6.00 | 2.00 / 6.00 | 8.00 | 170 / – |" in report
    assert "0.50× without it" in report


def test_report_without_both_variants_has_no_ratio():
    """One variant alone: its row, no ratio."""
    assert "×" not in markdown([_row("preload", 4.0, 0.0)], "python -m x", "CPU")
