"""`kvtide bench trace`: replay a real request trace, with its arrival times, through a client kvtide did not write.

The trace is Mooncake's format (one JSON object a line: `timestamp` in ms from the trace's
start, `input_length`, `output_length`, `hash_ids`, one id per prompt block, equal ids =
equal block contents and an id standing for its whole prefix chain; ../shared/traces/README.md).
The client is NVIDIA's aiperf (`--custom-dataset-type mooncake_trace --fixed-schedule`): it
turns each hash id into a fixed block of tokens and sends every request at its timestamp.
What is measured comes from aiperf's own per-request export (TTFT, e2e) and from the
engine's own counters (vLLM's prefix-cache queries and hits, scraped before and after), so
the figures do not rest on kvtide's load generator.

    kvtide bench trace --base-url http://127.0.0.1:8000 --metrics-url http://127.0.0.1:8080/metrics \\
        --model demo --tokenizer DIR --trace ../shared/traces/mooncake-synthetic.jsonl \\
        --block-tokens 32 --max-input-tokens 3072 --time-scale 2,1 --out-dir OUT

It starts no server. It pairs with a server something else started:

    kvtide       `kvtide serve` (or the GPU driver's cluster): --base-url is http.port's
                 proxy, --metrics-url Ray's metrics export (metrics.port, /metrics), where
                 vLLM's series read `ray_vllm_prefix_cache_queries_total` / `_hits_total`
                 (dashboards/catalog.py), summed over replicas
    bare vLLM    `python -m vllm.entrypoints.openai.api_server ...`: --metrics-url is the
                 same server's /metrics (`vllm:prefix_cache_queries_total` / `_hits_total`)

Scaling, done here, not by aiperf's synthesis options, so that the trace file aiperf reads
is exactly the one recorded (`ScaleOptions`, `scale_trace`), in this order:

    window        --start-s / --duration-s: requests whose original timestamp lies in
                  [start, start + duration)
    block size    --block-tokens B: each hash id becomes B tokens, so a prompt is
                  len(hash_ids) * B tokens; `input_length` is rewritten to that (every
                  block is whole: the release's partial last block of 512 would give one
                  id two sizes across requests, which aiperf refuses)
    over-long     --max-input-tokens N: a prompt longer than N is dropped, or with
                  --over-long truncate cut to its first N // B blocks. Choose N as the
                  served max_model_len minus the longest output (--max-output-tokens caps it)
    output        --output-scale: output_length * scale, rounded, at least 1 token, at
                  most --max-output-tokens; sent as max_tokens with ignore_eos, so the
                  engine generates that many tokens as the trace's server did
    limit         --limit N: the first N requests left (over-long ones walked past are
                  dropped or cut as above; the rest of the window is not looked at)
    time          timestamps rebased to the first request left, then multiplied by each
                  --time-scale (2 = half the trace's rate); one aiperf run per scale

`hash_ids` are kept, so equal ids stay equal tokens (aiperf seeds each id's tokens from the
id and the trace file's content hash). The ceiling a prefix cache can reach on the scaled
trace (`infinite_cache_hit_rate`: blocks whose id was seen earlier / all blocks, the README's
definition) is reported beside the engine's measured hit rate. They are read against each
other knowing the engine counts in its own blocks (`engine.block_size` tokens, so B should be
a multiple of it), never counts a prompt's last token as a hit, and tokenizes aiperf's text
itself (a block's tokens may merge with its neighbour's at the seam).

Each run's requests carry a fresh `cache_salt` (vLLM's, which kvtide honours) unless
--cache-salt none: blocks cached by an earlier run on the same server never count as hits.

aiperf runs from a virtualenv of its own ($KVTIDE_HOME/aiperf-venv, created and installed from
PyPI on first use; --aiperf BIN takes an installed one instead): it pins packages that must not
enter kvtide's environment. Its dataset workers force Hugging Face offline mode and look a
tokenizer up as a hub snapshot, so the served model's local tokenizer folder is laid out as a hub
cache entry (`hub_cache_layout`) and named to aiperf by its repo id.

Writes OUT/results.json (`RESULT_KEYS`; one entry of `runs` per time scale, written after each
run, so a crash keeps the finished ones), OUT/report.md, and per run OUT/ts-<scale>/: the
scaled trace, aiperf's artifacts and its log.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

# The release's block size: one hash id per 512 prompt tokens (../shared/traces/README.md).
TRACE_BLOCK_TOKENS = 512
# The aiperf this runner was written against: its export file names, its record format and
# the tokenizer workaround (hub cache layout) were checked on this version.
AIPERF_VERSION = "0.13.0"
AIPERF_SUMMARY_FILE = "profile_export_aiperf.json"
AIPERF_RECORDS_FILE = "profile_export.jsonl"
OVER_LONG = ("drop", "truncate")
ENDPOINT_TYPES = ("completions", "chat")
# Files of a model folder that make up its tokenizer; weights (large) are never copied.
TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
# The repo owner a local tokenizer is filed under in the hub cache when --tokenizer-name is not given.
LOCAL_REPO_OWNER = "kvtide-local"
METRICS_POLL_S = 1.0
DEFAULT_SLO_TTFT_MS = 1000.0  # = report.DEFAULT_SLO_TTFT_S, in aiperf's unit
RESULT_KEYS = ("kind", "provenance", "trace", "client", "server", "slo_ttft_ms", "notes", "runs")
RUN_KEYS = (
    "time_scale", "scaling", "scaled_trace", "cache_salt", "aiperf_command", "aiperf_exit_code",
    "num_requests", "num_errors", "duration_s", "requests_per_s", "ttft_ms", "e2e_ms",
    "goodput_requests_per_s", "prefix_cache", "infinite_cache_hit_rate", "aiperf_summary",
)


# ---- the trace -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRequest:
    """One request of a Mooncake-format trace."""

    timestamp_ms: float
    input_length: int  # prompt tokens
    output_length: int  # output tokens
    hash_ids: tuple[int, ...]  # one per prompt block; equal ids = equal blocks (and prefix chains)


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """The requests of a Mooncake-format JSON-lines text, in file order; raises ValueError naming a bad line."""
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            requests.append(TraceRequest(float(row["timestamp"]), int(row["input_length"]),
                                         int(row["output_length"]), tuple(int(i) for i in row.get("hash_ids") or ())))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace line {number}: {type(exc).__name__}: {exc}") from None
    return requests


# Where the shared synthetic trace lies from the repository root: a checkout's sibling shared/, or one inside it.
SHARED_TRACE_PATHS = (Path("..") / "shared" / "traces" / "mooncake-synthetic.jsonl",
                      Path("shared") / "traces" / "mooncake-synthetic.jsonl")


def default_trace_path(cwd: Path | None = None) -> Path:
    """The first of SHARED_TRACE_PATHS that exists under `cwd`; raises ValueError naming them when none does."""
    base = cwd or Path.cwd()
    for candidate in SHARED_TRACE_PATHS:
        if (base / candidate).exists():
            return base / candidate
    raise ValueError(f"no trace at {' or '.join(str(base / c) for c in SHARED_TRACE_PATHS)}; pass --trace")


def read_trace(path: str | Path) -> list[TraceRequest]:
    with Path(path).open() as f:
        return parse_trace(f)


def trace_lines(requests: Sequence[TraceRequest]) -> list[str]:
    """The requests as the Mooncake JSON lines aiperf reads (timestamps in ms, integral ones as ints)."""
    def ms(value: float) -> float | int:
        return int(value) if float(value).is_integer() else value

    return [json.dumps({"timestamp": ms(r.timestamp_ms), "input_length": r.input_length,
                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}, separators=(", ", ": "))
            for r in requests]


def write_trace(requests: Sequence[TraceRequest], path: str | Path) -> str:
    """Write the trace file aiperf reads; returns its sha256 (aiperf seeds block tokens from the content hash)."""
    text = "".join(line + "\n" for line in trace_lines(requests))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---- scaling ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScaleOptions:
    """How the trace is cut down to a small context (module docstring: the order they apply in)."""

    block_tokens: int
    time_scale: float = 1.0
    output_scale: float = 1.0
    max_input_tokens: int | None = None
    over_long: str = "drop"
    max_output_tokens: int | None = None
    limit: int | None = None
    start_s: float = 0.0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be 1 or more, got {self.block_tokens}")
        if not self.time_scale > 0 or not self.output_scale > 0:
            raise ValueError(f"time_scale and output_scale must be positive, got {self.time_scale}, {self.output_scale}")
        if self.over_long not in OVER_LONG:
            raise ValueError(f"over_long is one of {OVER_LONG}, got {self.over_long!r}")
        if self.max_input_tokens is not None and self.max_input_tokens < self.block_tokens:
            raise ValueError(f"max_input_tokens {self.max_input_tokens} holds no whole block of {self.block_tokens}")
        for name in ("max_output_tokens", "limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be 1 or more, got {value}")
        if self.start_s < 0 or (self.duration_s is not None and not self.duration_s > 0):
            raise ValueError(f"start_s must be >= 0 and duration_s > 0, got {self.start_s}, {self.duration_s}")


@dataclass(frozen=True)
class ScaledTrace:
    """The scaled requests (in send order) and how many each step kept, dropped or cut."""

    requests: list[TraceRequest]
    num_source: int  # requests in the file
    num_in_window: int
    num_dropped_no_blocks: int  # no hash id: nothing to scale into a prompt
    num_dropped_over_long: int
    num_truncated: int
    num_cut_by_limit: int


def scale_trace(requests: Sequence[TraceRequest], options: ScaleOptions) -> ScaledTrace:
    """Window → block size → over-long → output → limit → time, as the module docstring states.

    Send order is timestamp order, ties kept in file order (as the trace lists them). The window
    is walked in that order until `limit` requests are kept: the drop and truncation counts cover
    the requests walked, `num_cut_by_limit` the window's requests after the last one kept.
    """
    ordered = sorted(requests, key=lambda r: r.timestamp_ms)  # stable: ties keep file order
    start_ms = options.start_s * 1000.0
    end_ms = math.inf if options.duration_s is None else start_ms + options.duration_s * 1000.0
    window = [r for r in ordered if start_ms <= r.timestamp_ms < end_ms]
    b = options.block_tokens
    max_blocks = None if options.max_input_tokens is None else options.max_input_tokens // b
    empty = dropped = truncated = 0
    fitted: list[TraceRequest] = []
    scanned = 0
    for r in window:
        if options.limit is not None and len(fitted) == options.limit:
            break  # the limit counts requests sent: what lies past the last one is neither dropped nor cut
        scanned += 1
        ids = r.hash_ids
        if not ids:  # no block to scale: a prompt of zero tokens cannot be sent
            empty += 1
            continue
        if max_blocks is not None and len(ids) > max_blocks:
            if options.over_long == "drop":
                dropped += 1
                continue
            ids, truncated = ids[:max_blocks], truncated + 1
        output = max(1, round(r.output_length * options.output_scale))
        if options.max_output_tokens is not None:
            output = min(output, options.max_output_tokens)
        fitted.append(TraceRequest(r.timestamp_ms, len(ids) * b, output, ids))
    first_ms = fitted[0].timestamp_ms if fitted else 0.0
    # Rounded to the microsecond: float noise of the multiply must not leak into the file (its hash seeds tokens).
    timed = [replace(r, timestamp_ms=round((r.timestamp_ms - first_ms) * options.time_scale, 3)) for r in fitted]
    return ScaledTrace(timed, len(requests), len(window), empty, dropped, truncated, len(window) - scanned)


def infinite_cache_hit_rate(requests: Sequence[TraceRequest]) -> float | None:
    """Blocks whose hash id an earlier request (or an earlier block) already had / all blocks, in send order.

    The hit rate of one prefix cache that never evicts, shared by the whole fleet: the ceiling
    for any router and cache size (all blocks are the same size, so it is also the token ratio).
    None for no blocks.
    """
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        for block_id in r.hash_ids:
            hits += block_id in seen
            total += 1
            seen.add(block_id)
    return hits / total if total else None


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    from kvtide.benchmarks.report import percentile

    if not values:
        return {"p50": None, "p90": None, "max": None}
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "max": max(values)}


def trace_summary(requests: Sequence[TraceRequest]) -> dict[str, Any]:
    """{num_requests, span_s, offered_rate_per_s, input_tokens, output_tokens, infinite_cache_hit_rate}.

    offered_rate_per_s: requests / (last timestamp − first), the rate aiperf sends at on average
    (None when the span is zero).
    """
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0 if requests else 0.0
    return {"num_requests": len(requests), "span_s": span_s,
            "offered_rate_per_s": len(requests) / span_s if span_s > 0 else None,
            "input_tokens": _spread([r.input_length for r in requests]),
            "output_tokens": _spread([r.output_length for r in requests]),
            "infinite_cache_hit_rate": infinite_cache_hit_rate(requests)}


def scaling_record(options: ScaleOptions, scaled: ScaledTrace) -> dict[str, Any]:
    """Exactly how the trace was scaled, for the result JSON: the options, the rules and the counts."""
    return {
        **asdict(options),
        "source_block_tokens": TRACE_BLOCK_TOKENS,
        "rules": [
            f"window: original timestamp in [start_s, start_s + duration_s) ({'open end' if options.duration_s is None else 'closed window'})",
            "input_length = len(hash_ids) * block_tokens (every block whole); hash_ids kept as in the trace",
            (f"prompt over max_input_tokens: {'dropped' if options.over_long == 'drop' else 'cut to its first max_input_tokens // block_tokens blocks'}"
             if options.max_input_tokens is not None else "no input cap"),
            "output_length = max(1, round(output_length * output_scale))"
            + (", at most max_output_tokens" if options.max_output_tokens is not None else ""),
            "limit: the window walked in send order until `limit` requests are kept" if options.limit is not None else "no limit",
            "timestamp_ms = (timestamp_ms - first kept timestamp_ms) * time_scale",
        ],
        "num_source_requests": scaled.num_source,
        "num_in_window": scaled.num_in_window,
        "num_dropped_no_blocks": scaled.num_dropped_no_blocks,
        "num_dropped_over_long": scaled.num_dropped_over_long,
        "num_truncated": scaled.num_truncated,
        "num_cut_by_limit": scaled.num_cut_by_limit,
        "num_sent": len(scaled.requests),
    }


# ---- the tokenizer as a hub cache entry -------------------------------------------------------

def tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    """The folder's tokenizer files (configs, vocabularies, templates), never its weights."""
    return sorted(p for p in tokenizer_dir.iterdir()
                  if p.is_file() and p.suffix in TOKENIZER_SUFFIXES and not p.name.endswith(WEIGHT_SUFFIXES)
                  and not p.name.endswith(".index.json"))  # a weights' shard index: no part of the tokenizer


def default_repo_id(tokenizer_dir: Path, name: str | None = None) -> str:
    """ORG/NAME for the hub cache: `name` when it is one, else kvtide-local/<folder name> (hub-safe characters)."""
    if name and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name):
        return name
    base = re.sub(r"[^\w.-]+", "-", (name or tokenizer_dir.resolve().name)).strip("-.") or "tokenizer"
    return f"{LOCAL_REPO_OWNER}/{base}"


def hub_cache_layout(tokenizer_dir: str | Path, hf_home: str | Path, repo_id: str) -> Path:
    """Lay a local tokenizer folder out as a Hugging Face hub cache entry; returns the snapshot folder.

    `$HF_HOME/hub/models--ORG--NAME/snapshots/REV/` holds copies of the tokenizer files and
    `refs/main` holds REV, so `--tokenizer ORG/NAME` resolves with HF_HUB_OFFLINE=1 (aiperf's
    dataset workers force offline mode and ask for a hub snapshot; a plain folder path fails
    there). REV is a hash of the files' names and contents: the same tokenizer lands in the
    same snapshot, a changed one in a new snapshot that refs/main then names.
    """
    source = Path(tokenizer_dir)
    files = tokenizer_files(source)
    if not any(p.name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json") for p in files):
        raise ValueError(f"{source}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    revision = digest.hexdigest()[:40]  # the hub's commit hashes are 40 hex digits
    org, name = repo_id.split("/", 1)
    repo_dir = Path(hf_home) / "hub" / f"models--{org}--{name}"
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        shutil.copyfile(p, snapshot / p.name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot


# ---- aiperf -----------------------------------------------------------------------------------

def kvtide_home() -> Path:
    return Path(os.environ.get("KVTIDE_HOME", Path.home() / ".cache" / "kvtide"))


def aiperf_venv_commands(venv_dir: Path, python: str = sys.executable) -> list[list[str]]:
    """The commands that make aiperf's own virtualenv: a venv, then the pinned aiperf from PyPI."""
    return [[python, "-m", "venv", str(venv_dir)],
            [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "--quiet", f"aiperf=={AIPERF_VERSION}"]]


def ensure_aiperf(aiperf_bin: str | None, venv_dir: Path | None = None,
                  run: Callable[..., Any] = subprocess.run) -> str:
    """The aiperf executable: `aiperf_bin` if given, else $KVTIDE_HOME/aiperf-venv's, created on first use."""
    if aiperf_bin:
        return aiperf_bin
    venv_dir = venv_dir or kvtide_home() / "aiperf-venv"
    binary = venv_dir / "bin" / "aiperf"
    if not binary.exists():
        print(f"kvtide bench trace: installing aiperf {AIPERF_VERSION} into {venv_dir} (once) ...", flush=True)
        for command in aiperf_venv_commands(venv_dir):
            run(command, check=True)
    return str(binary)


def aiperf_version(aiperf_bin: str) -> str | None:
    try:
        done = subprocess.run([aiperf_bin, "--version"], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


@dataclass(frozen=True)
class AiperfOptions:
    """One aiperf replay of a scaled trace against one server."""

    aiperf_bin: str
    base_url: str
    model: str
    tokenizer_repo_id: str
    trace_path: Path
    artifact_dir: Path
    block_tokens: int
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    endpoint_type: str = "completions"
    request_timeout_s: float = 600.0
    cache_salt: str | None = None
    random_seed: int = 0
    api_key: str | None = None


def aiperf_extra_inputs(options: AiperfOptions) -> dict[str, Any]:
    """Fields added to every request: ignore_eos (generate the trace's output length, not the
    random-weight model's chance EOS) and the run's cache_salt when there is one."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if options.cache_salt:
        extra["cache_salt"] = options.cache_salt
    return extra


def aiperf_command(options: AiperfOptions) -> list[str]:
    """`aiperf profile` replaying the scaled trace at its timestamps, streaming (TTFT), records exported."""
    command = [
        options.aiperf_bin, "profile",
        "--model", options.model,
        "--url", options.base_url,
        "--endpoint-type", options.endpoint_type,
        "--streaming",
        "--tokenizer", options.tokenizer_repo_id,
        "--input-file", str(options.trace_path),
        "--custom-dataset-type", "mooncake_trace",
        "--isl-block-size", str(options.block_tokens),
        "--fixed-schedule",
        "--extra-inputs", json.dumps(aiperf_extra_inputs(options), sort_keys=True),
        "--goodput", f"time_to_first_token:{options.slo_ttft_ms:g}",
        "--request-timeout-seconds", f"{options.request_timeout_s:g}",
        "--random-seed", str(options.random_seed),
        "--artifact-dir", str(options.artifact_dir),
        "--export-level", "records",
        # Token counts as the engine reports them (the usage chunk): re-tokenizing a random-weight
        # model's text client-side miscounts outputs, and costs CPU on the machine being measured.
        "--use-server-token-count",
        # The engine's counters are scraped by this runner; aiperf's own scraping and GPU
        # probes would only add load on the machine being measured.
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--ui-type", "none",
    ]
    if options.api_key:
        command += ["--api-key", options.api_key]
    return command


def aiperf_env(hf_home: Path, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """aiperf's environment: the hub cache with the laid-out tokenizer, offline (nothing is fetched)."""
    return {**base, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def redacted_argv(command: Sequence[str]) -> list[str]:
    """The argv with an API key (`--api-key KEY` or `--api-key=KEY`) replaced by a placeholder."""
    shown = list(command)
    for i, part in enumerate(shown):
        if part == "--api-key" and i + 1 < len(shown):
            shown[i + 1] = "REDACTED"
        elif part.startswith("--api-key="):
            shown[i] = "--api-key=REDACTED"
    return shown


def redacted(command: Sequence[str]) -> str:
    """The command as recorded: shell-quoted, an API key replaced by a placeholder."""
    return shlex.join(redacted_argv(command))


# ---- aiperf's export --------------------------------------------------------------------------

@dataclass(frozen=True)
class RecordTimes:
    """One request of aiperf's per-request export (profile_export.jsonl)."""

    ok: bool
    start_ns: int
    end_ns: int
    ttft_ms: float | None
    e2e_ms: float | None


_TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}


def _metric_ms(metrics: Mapping[str, Any], tag: str) -> float | None:
    entry = metrics.get(tag)
    if not isinstance(entry, Mapping) or entry.get("value") is None:
        return None
    unit = entry.get("unit", "ms")
    if unit not in _TO_MS:
        raise ValueError(f"aiperf record: {tag} in unit {unit!r}, expected one of {', '.join(_TO_MS)}")
    return float(entry["value"]) * _TO_MS[unit]


def parse_aiperf_records(text: str) -> list[RecordTimes]:
    """The profiling-phase requests of aiperf's profile_export.jsonl (warm-up records left out).

    A record with an `error`, or without a request latency, is a failed request.
    """
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        meta, metrics = row.get("metadata") or {}, row.get("metrics") or {}
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue
        e2e_ms = _metric_ms(metrics, "request_latency")
        records.append(RecordTimes(ok=row.get("error") is None and e2e_ms is not None,
                                   start_ns=int(meta["request_start_ns"]), end_ns=int(meta["request_end_ns"]),
                                   ttft_ms=_metric_ms(metrics, "time_to_first_token"), e2e_ms=e2e_ms))
    return records


SUMMARY_METRICS = ("time_to_first_token", "request_latency", "goodput", "request_throughput", "request_count",
                   "error_request_count", "good_request_count", "benchmark_duration")


def parse_aiperf_summary(text: str) -> dict[str, Any]:
    """aiperf's own aggregate (profile_export_aiperf.json) for the metrics a trace run reports: a cross-check
    of the figures this runner computes from the records. Each is {unit, avg, p50, p90, p99} as present."""
    data = json.loads(text)
    picked: dict[str, Any] = {"aiperf_version": data.get("aiperf_version")}
    for tag in SUMMARY_METRICS:
        entry = data.get(tag)
        if isinstance(entry, Mapping):
            picked[tag] = {k: entry[k] for k in ("unit", "avg", "p50", "p90", "p99") if entry.get(k) is not None}
    return picked


def records_report(records: Sequence[RecordTimes], slo_ttft_ms: float) -> dict[str, Any]:
    """{num_requests, num_errors, duration_s, requests_per_s, ttft_ms, e2e_ms, goodput_requests_per_s}.

    Percentiles as report.percentile takes them (numpy's default) over successful requests;
    the duration runs from the first request's send to the last one's end (as report.py's run
    JSON); goodput counts successes whose TTFT was within `slo_ttft_ms` (inclusive), per second.
    """
    from kvtide.benchmarks.report import percentile

    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    e2es = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    duration_s = (max(r.end_ns for r in records) - min(r.start_ns for r in records)) / 1e9 if records else 0.0

    def per_s(n: int) -> float | None:
        return n / duration_s if duration_s > 0 else None

    def stats(values: list[float]) -> dict[str, float | None]:
        return {"p50": percentile(values, 50) if values else None, "p90": percentile(values, 90) if values else None}

    return {"num_requests": len(records), "num_errors": len(records) - len(ok), "duration_s": duration_s,
            "requests_per_s": per_s(len(ok)), "ttft_ms": stats(ttfts), "e2e_ms": stats(e2es),
            "goodput_requests_per_s": per_s(sum(1 for t in ttfts if t <= slo_ttft_ms))}


# ---- the engine's prefix-cache counters -------------------------------------------------------

def prefix_cache_delta(before_text: str, after_text: str) -> dict[str, Any]:
    """{hits_tokens, queries_tokens, hit_rate} between two scrapes of the server's Prometheus text.

    vLLM's own counters, summed over every engine in the text, either spelling (report.py:
    `ray_vllm_prefix_cache_*_total` through Ray, `vllm:prefix_cache_*_total` bare). hit_rate is
    None when nothing was queried.
    """
    from kvtide.benchmarks.report import metrics_delta, parse_metrics

    delta = metrics_delta(parse_metrics(before_text), parse_metrics(after_text))
    assert delta is not None
    return {"hits_tokens": delta.prefix_cache_hits, "queries_tokens": delta.prefix_cache_queries,
            "hit_rate": delta.prefix_cache_hits / delta.prefix_cache_queries if delta.prefix_cache_queries > 0 else None}


def _scrape(url: str) -> str:
    import httpx

    resp = httpx.get(url, timeout=10.0)
    resp.raise_for_status()
    return resp.text


def scrape_settled(url: str, before_text: str | None, num_ok: int, settle_s: float) -> str:
    """Scrape until the server's request counters include `num_ok` more successes than `before_text`
    (Ray's metrics export lags the engine by seconds), or `settle_s` runs out."""
    from kvtide.benchmarks.report import metrics_delta, parse_metrics

    text = _scrape(url)
    deadline = time.monotonic() + settle_s
    while before_text is not None and time.monotonic() < deadline:
        delta = metrics_delta(parse_metrics(before_text), parse_metrics(text))
        if delta is not None and sum(delta.requests_by_replica.values()) >= num_ok:
            break
        time.sleep(METRICS_POLL_S)
        text = _scrape(url)
    return text


# ---- the runner -------------------------------------------------------------------------------

def _scale_label(scale: float) -> str:
    return f"ts-{scale:g}"


def _warmup(base_url: str, model: str, count: int) -> int:
    """`count` short unrelated requests (first-request costs stay out of the runs); returns the successes."""
    if count <= 0:
        return 0
    import asyncio

    from kvtide.benchmarks.loadgen import run_load
    from kvtide.benchmarks.workloads import build_workload, make_params

    warm = build_workload("random", make_params("random", num_requests=count, input_len=64, output_len=8), seed=-1)
    load = asyncio.run(run_load(base_url, warm.requests, concurrency=min(count, 4), duration_s=120.0, model=model,
                                progress=False))
    return sum(r.ok for r in load.results)


def report_markdown(results: Mapping[str, Any]) -> str:
    """A short report: one row per time scale, then the scaling, the client and the provenance."""
    from kvtide.benchmarks.protocol import provenance_markdown

    def f(value: float | None, fmt: str = "{:.0f}") -> str:
        return "–" if value is None else fmt.format(value)

    slo = results["slo_ttft_ms"]
    lines = ["# Trace replay", ""]
    lines += [f"- {note}" for note in results["notes"]] + ([""] if results["notes"] else [])
    lines += [f"Trace `{results['trace']['path']}` (sha256 {results['trace']['sha256'][:12]}…), replayed by "
              f"aiperf {results['client']['version']} with `--fixed-schedule` against `{results['server']['base_url']}`"
              f" (model `{results['server']['model']}`); hit rates from the engine's own prefix-cache counters.", "",
              f"| time scale | requests (errors) | offered req/s | TTFT p50 (ms) | TTFT p90 (ms) | e2e p90 (ms) "
              f"| goodput (req/s, TTFT ≤ {slo:g} ms) | measured hit rate | infinite-cache hit rate |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in results["runs"]:
        lines.append(
            f"| {run['time_scale']:g} | {run['num_requests']} ({run['num_errors']}) "
            f"| {f(run['scaled_trace']['offered_rate_per_s'], '{:.2f}')} | {f(run['ttft_ms']['p50'])} "
            f"| {f(run['ttft_ms']['p90'])} | {f(run['e2e_ms']['p90'])} | {f(run['goodput_requests_per_s'], '{:.2f}')} "
            f"| {f(run['prefix_cache']['hit_rate'], '{:.3f}')} | {f(run['infinite_cache_hit_rate'], '{:.3f}')} |")
    if results["runs"]:
        scaling = results["runs"][0]["scaling"]
        lines += ["", "## Scaling", ""] + [f"- {rule}" for rule in scaling["rules"]]
        lines.append("- options: " + ", ".join(f"{k}={scaling[k]}" for k in (
            "block_tokens", "max_input_tokens", "over_long", "output_scale", "max_output_tokens", "limit",
            "start_s", "duration_s")))
        lines.append(f"- requests: {scaling['num_source_requests']} in the file, {scaling['num_in_window']} in the "
                     f"window, {scaling['num_dropped_no_blocks']} without blocks, {scaling['num_dropped_over_long']} "
                     f"dropped over-long, {scaling['num_truncated']} truncated, {scaling['num_cut_by_limit']} past "
                     f"the limit, {scaling['num_sent']} sent")
        lines += ["", "## Commands", ""] + [f"- time scale {run['time_scale']:g}: `{run['aiperf_command']}`"
                                            for run in results["runs"]]
    return "\n".join(lines) + "\n\n" + provenance_markdown(results["provenance"])


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def run_trace(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Every time scale in turn: scale, replay through aiperf, scrape, parse; writes results as it goes."""
    from kvtide.benchmarks.loadgen import check_loopback
    from kvtide.benchmarks.protocol import provenance

    check_loopback(args.base_url)  # the project's load tools only target this machine
    check_loopback(args.metrics_url)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    aiperf_bin = ensure_aiperf(args.aiperf)
    version = aiperf_version(aiperf_bin)
    hf_home = Path(args.hf_home) if args.hf_home else kvtide_home() / "aiperf-hf"
    repo_id = default_repo_id(Path(args.tokenizer), args.tokenizer_name)
    hub_cache_layout(args.tokenizer, hf_home, repo_id)
    trace = args.trace or default_trace_path()
    source = read_trace(trace)
    results: dict[str, Any] = {
        "kind": "trace_replay",
        "provenance": provenance(redacted_argv(argv)),
        "trace": {"path": str(trace), "sha256": file_sha256(trace), "num_requests": len(source),
                  "block_tokens": TRACE_BLOCK_TOKENS},
        "client": {"name": "aiperf", "version": version, "bin": aiperf_bin, "tokenizer_dir": str(args.tokenizer),
                   "tokenizer_repo_id": repo_id, "hf_home": str(hf_home), "endpoint_type": args.endpoint_type},
        "server": {"base_url": args.base_url, "metrics_url": args.metrics_url, "model": args.model},
        "slo_ttft_ms": args.slo_ttft_ms,
        "notes": list(args.note),
        "runs": [],
    }
    assert tuple(results) == RESULT_KEYS
    initial_text = _scrape(args.metrics_url)
    num_warm_ok = _warmup(args.base_url, args.model, args.warmup)
    # The export lags: the first run's "before" must already include the warm-up, or it counts in the run;
    # each later run starts where the previous one's "after" ended.
    before_text = scrape_settled(args.metrics_url, initial_text, num_warm_ok, args.metrics_settle_s)
    for scale in args.time_scale:
        options = ScaleOptions(block_tokens=args.block_tokens, time_scale=scale, output_scale=args.output_scale,
                               max_input_tokens=args.max_input_tokens, over_long=args.over_long,
                               max_output_tokens=args.max_output_tokens, limit=args.limit, start_s=args.start_s,
                               duration_s=args.duration_s)
        scaled = scale_trace(source, options)
        if not scaled.requests:
            raise ValueError("the scaling left no request to send; widen the window or raise --max-input-tokens")
        run_dir = out / _scale_label(scale)
        trace_path = run_dir / "trace.jsonl"
        trace_sha = write_trace(scaled.requests, trace_path)
        salt = None if args.cache_salt == "none" else (
            f"kvtide-trace-{secrets.token_hex(8)}" if args.cache_salt == "auto" else args.cache_salt)
        aiperf_options = AiperfOptions(aiperf_bin=aiperf_bin, base_url=args.base_url, model=args.model,
                                       tokenizer_repo_id=repo_id, trace_path=trace_path.resolve(),
                                       artifact_dir=(run_dir / "aiperf").resolve(), block_tokens=args.block_tokens,
                                       slo_ttft_ms=args.slo_ttft_ms, endpoint_type=args.endpoint_type,
                                       request_timeout_s=args.request_timeout_s, cache_salt=salt,
                                       random_seed=args.seed, api_key=args.api_key)
        command = aiperf_command(aiperf_options)
        print(f"kvtide bench trace: time scale {scale:g}: {len(scaled.requests)} requests over "
              f"{trace_summary(scaled.requests)['span_s']:.1f} s → aiperf", flush=True)
        with (run_dir / "aiperf.log").open("w") as log:
            done = subprocess.run(command, env=aiperf_env(hf_home), stdout=log, stderr=subprocess.STDOUT, check=False)
        records_path = aiperf_options.artifact_dir / AIPERF_RECORDS_FILE
        summary_path = aiperf_options.artifact_dir / AIPERF_SUMMARY_FILE
        records = parse_aiperf_records(records_path.read_text()) if records_path.exists() else []
        measured = records_report(records, args.slo_ttft_ms)
        after_text = scrape_settled(args.metrics_url, before_text, measured["num_requests"] - measured["num_errors"],
                                    args.metrics_settle_s)
        run = {
            "time_scale": scale,
            "scaling": scaling_record(options, scaled),
            "scaled_trace": {"path": str(trace_path), "sha256": trace_sha, **trace_summary(scaled.requests)},
            "cache_salt": salt,
            "aiperf_command": redacted(command),
            "aiperf_exit_code": done.returncode,
            **measured,
            "prefix_cache": prefix_cache_delta(before_text, after_text),
            "infinite_cache_hit_rate": infinite_cache_hit_rate(scaled.requests),
            "aiperf_summary": parse_aiperf_summary(summary_path.read_text()) if summary_path.exists() else None,
        }
        assert tuple(run) == RUN_KEYS
        results["runs"].append(run)
        before_text = after_text
        _write_json(out / "results.json", results)  # after each run: a crash keeps the finished ones
        print(f"kvtide bench trace: time scale {scale:g}: {run['num_requests']} requests ({run['num_errors']} errors), "
              f"TTFT p50 {run['ttft_ms']['p50']} ms, hit rate {run['prefix_cache']['hit_rate']} "
              f"(infinite cache {run['infinite_cache_hit_rate']}), aiperf exit {done.returncode}", flush=True)
    (out / "report.md").write_text(report_markdown(results))
    return results


# ---- the command ------------------------------------------------------------------------------

def _scales(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `bench trace` to the `bench` subcommands."""
    p = sub.add_parser("trace", help="replay a Mooncake-format trace with its arrival times through aiperf; "
                                     "report TTFT, e2e, goodput and the engine's prefix-cache hit rate")
    p.add_argument("--base-url", required=True, help="running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--metrics-url", required=True,
                   help="its Prometheus text: kvtide's Ray metrics port (http://127.0.0.1:8080/metrics) or bare "
                        "vLLM's BASE/metrics")
    p.add_argument("--model", required=True, help="served model name to send")
    p.add_argument("--tokenizer", required=True, help="the served model's local tokenizer folder")
    p.add_argument("--tokenizer-name", help="ORG/NAME to file the tokenizer under in aiperf's hub cache "
                                            f"(default: {LOCAL_REPO_OWNER}/<folder name>)")
    p.add_argument("--trace", help="Mooncake-format JSON lines (default: the shared synthetic trace, "
                                   f"{' or '.join(map(str, SHARED_TRACE_PATHS))} from the working directory)")
    p.add_argument("--out-dir", required=True, help="results.json, report.md and one folder per time scale")
    g = p.add_argument_group("scaling (module docstring: the order they apply in)")
    g.add_argument("--block-tokens", type=int, required=True,
                   help="tokens per hash id (a multiple of the engine's block size)")
    g.add_argument("--max-input-tokens", type=int, help="longest prompt sent: max_model_len minus the longest output")
    g.add_argument("--over-long", choices=OVER_LONG, default="drop", help="a longer prompt is dropped or truncated")
    g.add_argument("--time-scale", type=_scales, default=[1.0],
                   help="multiply timestamps (2 = half the trace's rate); a comma list runs each in turn")
    g.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    g.add_argument("--max-output-tokens", type=int, help="cap output lengths (after --output-scale)")
    g.add_argument("--limit", type=int, help="send the first N requests left after the other cuts")
    g.add_argument("--start-s", type=float, default=0.0, help="window start, seconds of the original trace")
    g.add_argument("--duration-s", type=float, help="window length, seconds of the original trace")
    r = p.add_argument_group("run")
    r.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS,
                   help=f"TTFT objective for goodput (default {DEFAULT_SLO_TTFT_MS:g})")
    r.add_argument("--endpoint-type", choices=ENDPOINT_TYPES, default="completions",
                   help="completions sends the trace's tokens as they are; chat adds the chat template")
    r.add_argument("--cache-salt", default="auto",
                   help="auto: a fresh cache_salt per run (earlier runs' blocks never hit); none; or a fixed salt")
    r.add_argument("--warmup", type=int, default=4, help="short unrelated requests sent before the first run")
    r.add_argument("--request-timeout-s", type=float, default=600.0, help="aiperf's per-request timeout")
    r.add_argument("--metrics-settle-s", type=float, default=30.0,
                   help="longest wait for the server's request counters to include a run")
    r.add_argument("--seed", type=int, default=0, help="aiperf's --random-seed")
    r.add_argument("--api-key", help="sent as a bearer token (recorded as REDACTED)")
    r.add_argument("--aiperf", help=f"aiperf executable (default: $KVTIDE_HOME/aiperf-venv, aiperf {AIPERF_VERSION} "
                                    "installed there on first use)")
    r.add_argument("--hf-home", help="hub cache aiperf reads the tokenizer from (default $KVTIDE_HOME/aiperf-hf)")
    r.add_argument("--note", action="append", default=[], help="a line for the report (repeatable)")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    results = run_trace(args, ["kvtide", *sys.argv[1:]])
    print(f"kvtide bench trace: wrote {args.out_dir}/results.json and report.md")
    failed = any(run["aiperf_exit_code"] != 0 or run["num_errors"] or not run["num_requests"] for run in results["runs"])
    return 1 if failed else 0
