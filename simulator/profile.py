"""An engine profile: a model shape's KV size and step-time coefficients, fitted to measured GPU runs.

A profile is a JSON file (`simulator/profiles/*.json`, committed with the runs it came from):

    {"name": ..., "model": ..., "gpu": ..., "block_size": 16, "kv_bytes_per_token": 131072,
     "step": {"base_s": ..., "per_prefill_token_s": ..., "per_decode_seq_s": ..., "per_kv_token_read_s": ...},
     "fit": {"source": [result files], "equations": [...], "residuals_s": [...]}}

`fit_closed_loop` fits the step coefficients to a closed-loop overhead run (benchmarks/overhead.py:
fixed prompt and output lengths at several concurrencies). Each level gives one equation for the
mean step of the steady state, where every sequence decodes and, per step, C / output_len requests
of the C in flight prefill their prompt:

    step(C) = C / output tok/s    = base + (C * prompt / output) * prefill + C * decode
                                    + C * (prompt + output / 2) * kv_read

and the one-stream TTFT gives the step that prefills a whole prompt: base + prompt * prefill +
prompt * kv_read. At one prompt and output length the decode and KV-read columns are proportional
(both grow with C alone), so these runs cannot tell them apart: the fit sets kv_read to 0 and
decode carries both. Solved by non-negative least squares (every coefficient is a cost); the
measured and fitted step of every equation are kept in the profile, so a reader sees how well
the numbers describe the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvtide.simulator.engine import EngineLimits, StepProfile

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
COEFFICIENTS = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_read_s")


@dataclass(frozen=True)
class EngineProfile:
    name: str
    block_size: int
    kv_bytes_per_token: int
    step: StepProfile
    raw: Mapping[str, Any]

    def limits(self, kv_bytes: int, max_num_batched_tokens: int, max_num_seqs: int) -> EngineLimits:
        """Engine limits for `kv_bytes` of KV cache (as engine.kv_cache_memory_bytes sets it)."""
        num_blocks = kv_bytes // (self.kv_bytes_per_token * self.block_size)
        if num_blocks < 1:
            raise ValueError(f"{kv_bytes} bytes of KV hold no block of {self.block_size} tokens "
                             f"at {self.kv_bytes_per_token} bytes per token")
        return EngineLimits(num_blocks=num_blocks, block_size=self.block_size,
                            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)


def load_profile(name_or_path: str) -> EngineProfile:
    """A committed profile by name (simulator/profiles/<name>.json) or a JSON file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ValueError(f"no profile {name_or_path!r}: a JSON file, or one of: {known}")
    data = json.loads(path.read_text())
    step = StepProfile(**{k: float(data["step"][k]) for k in COEFFICIENTS})
    return EngineProfile(name=data["name"], block_size=int(data["block_size"]),
                         kv_bytes_per_token=int(data["kv_bytes_per_token"]), step=step, raw=data)


@dataclass(frozen=True)
class Level:
    """One closed-loop level of an overhead run: concurrency, output tok/s, median TTFT."""

    concurrency: int
    output_tokens_per_s: float
    ttft_p50_s: float


def equations(levels: Sequence[Level], prompt_tokens: int, output_tokens: int) -> tuple[list[list[float]], list[float]]:
    """Rows (coefficients of base, prefill, decode, kv read) and right-hand sides, one per level, then the
    one-stream TTFT's row (from the level of concurrency 1, if there is one)."""
    rows, rhs = [], []
    for level in levels:
        c = level.concurrency
        rows.append([1.0, c * prompt_tokens / output_tokens, float(c), c * (prompt_tokens + output_tokens / 2)])
        rhs.append(c / level.output_tokens_per_s)
    single = [level for level in levels if level.concurrency == 1]
    if single:
        rows.append([1.0, float(prompt_tokens), 0.0, float(prompt_tokens)])
        rhs.append(single[0].ttft_p50_s)
    return rows, rhs


def nnls(rows: Sequence[Sequence[float]], rhs: Sequence[float], iterations: int = 20000) -> list[float]:
    """Non-negative least squares by projected coordinate descent (columns scaled to unit norm first):
    four unknowns and a handful of rows need no numerical library."""
    n = len(rows[0])
    norms = [sum(r[j] ** 2 for r in rows) ** 0.5 or 1.0 for j in range(n)]
    a = [[r[j] / norms[j] for j in range(n)] for r in rows]
    x = [0.0] * n
    residual = list(rhs)
    for _ in range(iterations):
        changed = 0.0
        for j in range(n):
            col_sq = sum(row[j] ** 2 for row in a)
            if col_sq == 0:
                continue
            step = sum(row[j] * res for row, res in zip(a, residual)) / col_sq
            new = max(0.0, x[j] + step)
            delta = new - x[j]
            if delta:
                for i, row in enumerate(a):
                    residual[i] -= row[j] * delta
                x[j] = new
                changed = max(changed, abs(delta))
        if changed < 1e-15:
            break
    return [x[j] / norms[j] for j in range(n)]


@dataclass(frozen=True)
class ClosedLoopRun:
    """One overhead run's levels with its fixed prompt and output lengths."""

    levels: tuple[Level, ...]
    prompt_tokens: int
    output_tokens: int
    source: str = ""


def fit_closed_loop(levels: Sequence[Level], prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    """{step: coefficients, equations: [{row, measured_s, fitted_s}]} for one overhead run's levels."""
    return fit_runs([ClosedLoopRun(tuple(levels), prompt_tokens, output_tokens)])


def fit_runs(runs: Sequence[ClosedLoopRun]) -> dict[str, Any]:
    """The step coefficients fitted to every run's equations at once. KV reads are fitted only when the runs
    differ in context length (prompt + output / 2): at one context they are proportional to the decodes
    (module docstring) and the fit sets them to 0."""
    rows: list[list[float]] = []
    rhs: list[float] = []
    sources: list[str] = []
    for run in runs:
        r, b = equations(run.levels, run.prompt_tokens, run.output_tokens)
        rows += r
        rhs += b
        sources += [run.source] * len(r)
    contexts = {run.prompt_tokens + run.output_tokens / 2 for run in runs}
    if len(contexts) > 1:
        coefficients = nnls(rows, rhs)
    else:
        coefficients = nnls([row[:3] for row in rows], rhs) + [0.0]
    fitted = [sum(c * v for c, v in zip(coefficients, row)) for row in rows]
    return {"step": dict(zip(COEFFICIENTS, coefficients)),
            "kv_read_fitted": len(contexts) > 1,
            "equations": [{"source": s, "row": row, "measured_s": m, "fitted_s": f}
                          for s, row, m, f in zip(sources, rows, rhs, fitted)]}
