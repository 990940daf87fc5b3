"""The agentic workload: agent sessions over a few shared tool sets, each a run of turns whose context grows
with tool calls and their results, through the three APIs agents use.

A session is one agent at work: a tool set (its system prompt and tool definitions, shared by
every session drawn to it: 4–8k tokens, the long prefix agents share), a first user message,
then turns that each report a tool's result. Sessions are spread evenly over three APIs:

    chat        POST /v1/chat/completions with `tools`; the history is resent each turn: the
                assistant's tool call (`tool_calls`) and the tool's answer (role `tool`)
    messages    POST /v1/messages (Anthropic) with `tools`; the history is resent each turn: the
                assistant's `tool_use` block and the user's `tool_result` block
    responses   POST /v1/responses with `tools`; the first turn sends the instructions, each later
                turn only `previous_response_id` and the tool's result: the server keeps the history
                (kvtide's serving.responses_store, which pins the follow-ups to the replica holding it)

The models benchmarked have random weights and call no tools themselves, so the client plays the
agent (greedy decoding: a run repeats): every turn after the first follows a fixed tool call
(`lookup`, its arguments drawn per turn) whose result is drawn text. Chat and Messages resend that
call as the assistant's turn; Responses keeps what the model really answered, so its context
grows by the model's output and the result.

The ceiling any router's hit rate is read against (`infinite_cache_hit_rate`, in words like
workloads.oracle_hit_rate): a request's cached part is the longest run of leading segments
(the tool set, then each turn's message and tool call) some earlier request began with; a
Responses turn's previous output counts as cached (the server computed it) once the turn before
has been sent. The chat template's tokens are left out.

Builds sessions and request bodies (pure); `run_sessions` sends them; `kvtide bench agentic` runs
passes at several levels of sessions in flight against a running server and writes results.json
(provenance, the ceiling, per-API percentiles, the engine's prefix-cache counters) and report.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx

from kvtide.benchmarks.workloads import DEFAULT_TOKENS_PER_WORD, WORDS

APIS = ("chat", "messages", "responses")
TOOL_NAME = "lookup"


@dataclass(frozen=True)
class AgenticParams:
    num_sessions: int = 60
    num_tool_sets: int = 3
    tool_set_tokens: int = 6000  # system prompt + tool definitions of one tool set
    tools_per_set: int = 12
    min_turns: int = 5
    max_turns: int = 10
    question_tokens: int = 64
    tool_result_tokens: int = 256
    output_tokens: int = 64

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.num_tool_sets < 1 or self.tools_per_set < 1:
            raise ValueError("num_sessions, num_tool_sets and tools_per_set must be >= 1")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(f"turns must satisfy 1 <= min_turns <= max_turns, got {self.min_turns}, {self.max_turns}")


@dataclass(frozen=True)
class ToolSet:
    """A system prompt and OpenAI-style function tools, shared by the sessions drawn to it."""

    system: str
    tools: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class AgentSession:
    """One agent's run: its API, tool set, first message, and per later turn the tool call it made and the result."""

    session_id: str
    api: str
    tool_set: int
    question: str
    calls: tuple[dict[str, Any], ...]  # per turn after the first: the tool call's arguments
    results: tuple[str, ...]           # per turn after the first: the tool's answer
    output_tokens: int

    @property
    def num_turns(self) -> int:
        return 1 + len(self.results)


def _text(rng: random.Random, num_tokens: int, tokens_per_word: float) -> str:
    return " ".join(rng.choices(WORDS, k=max(1, round(num_tokens / tokens_per_word))))


def _tool_set(rng: random.Random, p: AgenticParams, tpw: float) -> ToolSet:
    # Half of the tokens in the tool definitions' descriptions, half in the system prompt.
    per_tool = p.tool_set_tokens // 2 // p.tools_per_set
    tools = tuple({"type": "function", "function": {
        "name": TOOL_NAME if i == 0 else f"tool_{i}", "description": _text(rng, per_tool, tpw),
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
        for i in range(p.tools_per_set))
    return ToolSet(_text(rng, p.tool_set_tokens - per_tool * p.tools_per_set, tpw), tools)


def build_agentic(params: AgenticParams | None = None, *, seed: int = 0,
                  tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> tuple[tuple[ToolSet, ...], tuple[AgentSession, ...]]:
    """The tool sets and sessions, deterministic in (params, seed): session i takes API i mod 3 and a tool set
    drawn uniformly; its number of turns is drawn in [min_turns, max_turns]."""
    p = params or AgenticParams()
    if tokens_per_word <= 0:
        raise ValueError(f"tokens_per_word must be positive, got {tokens_per_word}")
    rng = random.Random(f"agentic:{seed}")
    tool_sets = tuple(_tool_set(rng, p, tokens_per_word) for _ in range(p.num_tool_sets))
    sessions = []
    for i in range(p.num_sessions):
        turns = rng.randint(p.min_turns, p.max_turns)
        sessions.append(AgentSession(
            f"agent-{i}", APIS[i % len(APIS)], rng.randrange(p.num_tool_sets),
            _text(rng, p.question_tokens, tokens_per_word),
            tuple({"query": _text(rng, 4, tokens_per_word)} for _ in range(turns - 1)),
            tuple(_text(rng, p.tool_result_tokens, tokens_per_word) for _ in range(turns - 1)),
            p.output_tokens))
    return tool_sets, tuple(sessions)


def _call_id(session: AgentSession, turn: int) -> str:
    return f"call_{session.session_id.replace('-', '_')}_{turn}"


def turn_body(model: str, tool_set: ToolSet, session: AgentSession, turn: int,
              previous_response_id: str | None = None, resend_history: bool = False) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of `session`'s turn `turn` (0-based). A Responses turn after the first needs the id of the
    response to the turn before, unless `resend_history`: then it resends the instructions and every tool call and
    result as input items, stores nothing, and needs no server-side store (bare vLLM behind round robin has none
    shared). Chat and Messages always resend the whole history."""
    if not 0 <= turn < session.num_turns:
        raise ValueError(f"{session.session_id} has {session.num_turns} turns, not a turn {turn}")
    if session.api == "responses":
        body: dict[str, Any] = {"model": model, "max_output_tokens": session.output_tokens, "stream": True,
                                "tools": [{"type": "function", **t["function"]} for t in tool_set.tools],
                                "tool_choice": "none", "store": not resend_history, "temperature": 0}
        if resend_history:
            items: list[dict[str, Any]] = [{"role": "user", "content": session.question}]
            for t in range(turn):
                call_id = _call_id(session, t)
                items.append({"type": "function_call", "call_id": call_id, "name": TOOL_NAME,
                              "arguments": json.dumps(session.calls[t])})
                items.append({"type": "function_call_output", "call_id": call_id, "output": session.results[t]})
            return "/v1/responses", {**body, "instructions": tool_set.system, "input": items}
        if turn == 0:
            return "/v1/responses", {**body, "instructions": tool_set.system, "input": session.question}
        if previous_response_id is None:
            raise ValueError("a Responses turn after the first needs the previous response's id")
        result = f"{TOOL_NAME}({json.dumps(session.calls[turn - 1])}) returned: {session.results[turn - 1]}"
        return "/v1/responses", {**body, "previous_response_id": previous_response_id, "input": result}
    if session.api == "chat":
        messages: list[dict[str, Any]] = [{"role": "system", "content": tool_set.system},
                                          {"role": "user", "content": session.question}]
        for t in range(turn):
            call_id = _call_id(session, t)
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": TOOL_NAME, "arguments": json.dumps(session.calls[t])}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": session.results[t]})
        return "/v1/chat/completions", {"model": model, "messages": messages, "tools": list(tool_set.tools),
                                        "tool_choice": "none", "max_tokens": session.output_tokens,
                                        "stream": True, "ignore_eos": True, "temperature": 0}
    if session.api == "messages":
        history: list[dict[str, Any]] = [{"role": "user", "content": session.question}]
        for t in range(turn):
            call_id = _call_id(session, t)
            history.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": call_id, "name": TOOL_NAME, "input": session.calls[t]}]})
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id, "content": session.results[t]}]})
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in tool_set.tools]
        # tool_choice none, as on the other APIs: the model is only shown the tools (vLLM's default with tools
        # is auto, which a server without a tool-call parser refuses).
        return "/v1/messages", {"model": model, "system": tool_set.system, "messages": history, "tools": tools,
                                "tool_choice": {"type": "none"}, "max_tokens": session.output_tokens, "stream": True,
                                "temperature": 0}
    raise ValueError(f"unknown API {session.api!r}; choose one of {', '.join(APIS)}")


def _stored(session: AgentSession, resend_history: bool) -> bool:
    """Whether the server keeps this session's history (a Responses session chained by previous_response_id)."""
    return session.api == "responses" and not resend_history


def _segments(tool_set_index: int, tool_set: ToolSet, session: AgentSession, turn: int,
              stored: bool) -> list[tuple[str, int]]:
    """The prompt of a turn as (key, words) segments in order: the tool set, the question, then per earlier turn
    its output (the model's, where the server keeps the history; the tool call's otherwise) and the tool's result."""
    set_words = len(tool_set.system.split()) + sum(len(t["function"]["description"].split()) for t in tool_set.tools)
    segments = [(f"set-{tool_set_index}", set_words), (f"{session.session_id}/q", len(session.question.split()))]
    for t in range(turn):
        output_words = session.output_tokens if stored else len(json.dumps(session.calls[t]).split())
        segments.append((f"{session.session_id}/out{t}", output_words))
        segments.append((f"{session.session_id}/res{t}", len(session.results[t].split())))
    return segments


def infinite_cache_hit_rate(tool_sets: Sequence[ToolSet], sessions: Sequence[AgentSession],
                            resend_history: bool = False) -> float | None:
    """The hit rate of one infinite cache shared by the fleet (module docstring), sessions' turns sent in turn order
    across sessions (every session's turn 0, then every turn 1, ...). None for no requests."""
    seen: set[tuple[str, ...]] = set()
    hit = total = 0
    for turn in range(max((s.num_turns for s in sessions), default=0)):
        for session in sessions:
            if turn >= session.num_turns:
                continue
            stored = _stored(session, resend_history)
            segments = _segments(session.tool_set, tool_sets[session.tool_set], session, turn, stored)
            keys = [tuple(key for key, _ in segments[: i + 1]) for i in range(len(segments))]
            cached = max((i + 1 for i, key in enumerate(keys[:-1]) if key in seen), default=0)
            words = [w for _, w in segments]
            if stored and turn > 0:
                cached = len(segments) - 1  # the server holds the conversation so far; the new result is new
            hit += sum(words[:cached])
            total += sum(words)
            seen.update(keys)
    return hit / total if total else None


@dataclass
class TurnResult:
    session_id: str
    api: str
    turn: int
    ok: bool
    ttft_s: float | None
    e2e_s: float
    replica: str | None = None
    cached_tokens: int | None = None
    error: str | None = None


@dataclass
class _Stream:
    first_s: float | None = None
    response_id: str | None = None
    cached_tokens: int | None = None
    error: str | None = None
    events: int = field(default=0)


def _read_event(stream: _Stream, api: str, data: dict[str, Any], now_s: float) -> None:
    """Fold one SSE event of `api` into `stream`: the first output, the response id, the cached prompt tokens."""
    if "error" in data and api != "messages" or data.get("type") == "error":
        stream.error = str(data.get("error"))[:200]
        return
    stream.events += 1
    if api == "chat":
        choices = data.get("choices") or []
        if stream.first_s is None and any((c.get("delta") or {}).get("content") or (c.get("delta") or {}).get(
                "tool_calls") for c in choices):
            stream.first_s = now_s
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            stream.cached_tokens = details["cached_tokens"]
    elif api == "messages":
        if stream.first_s is None and data.get("type") == "content_block_delta":
            stream.first_s = now_s
        usage = (data.get("message") or {}).get("usage") or data.get("usage") or {}
        if usage.get("cache_read_input_tokens") is not None:
            stream.cached_tokens = usage["cache_read_input_tokens"]
    else:  # responses
        kind = data.get("type", "")
        if stream.first_s is None and kind.endswith(".delta"):
            stream.first_s = now_s
        response = data.get("response") or {}
        if response.get("id"):
            stream.response_id = response["id"]
        details = (response.get("usage") or {}).get("input_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            stream.cached_tokens = details["cached_tokens"]


async def _send_turn(client: httpx.AsyncClient, path: str, body: dict[str, Any], api: str,
                     session_id: str) -> tuple[_Stream, float, str | None]:
    stream = _Stream()
    start = time.perf_counter()
    replica = None
    try:
        async with client.stream("POST", path, json=body, headers={"x-session-id": session_id}) as resp:
            replica = resp.headers.get("x-kvtide-replica")
            if resp.status_code != 200:
                stream.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
            else:
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                        _read_event(stream, api, json.loads(line[5:]), time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"[:200]
    return stream, start, replica


async def run_session(client: httpx.AsyncClient, model: str, tool_set: ToolSet, session: AgentSession,
                      think_s: float = 0.0, resend_history: bool = False) -> list[TurnResult]:
    """Every turn of one session in order (a turn is sent when the one before has ended, after `think_s`); stops at
    the first failed turn (an agent cannot go on without its answer)."""
    results: list[TurnResult] = []
    previous_id = None
    for turn in range(session.num_turns):
        path, body = turn_body(model, tool_set, session, turn, previous_id, resend_history)
        stream, start, replica = await _send_turn(client, path, body, session.api, session.session_id)
        end = time.perf_counter()
        error = stream.error or (None if not _stored(session, resend_history) or stream.response_id
                                 else "no response id")
        results.append(TurnResult(session.session_id, session.api, turn, error is None,
                                  None if stream.first_s is None else stream.first_s - start, end - start,
                                  replica, stream.cached_tokens, error))
        if error is not None:
            break
        previous_id = stream.response_id
        if think_s:
            await asyncio.sleep(think_s)
    return results


async def run_sessions(base_url: str, model: str, tool_sets: Sequence[ToolSet], sessions: Sequence[AgentSession],
                       *, max_sessions_in_flight: int, request_timeout_s: float = 600.0,
                       think_s: float = 0.0, resend_history: bool = False) -> list[TurnResult]:
    """All `sessions`, at most `max_sessions_in_flight` at once (each session's turns in order): every turn's result."""
    from kvtide.benchmarks.loadgen import client_limits

    if max_sessions_in_flight < 1:
        raise ValueError(f"max_sessions_in_flight must be >= 1, got {max_sessions_in_flight}")
    gate = asyncio.Semaphore(max_sessions_in_flight)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(request_timeout_s, connect=10.0),
                                 limits=client_limits(max_sessions_in_flight)) as client:
        async def one(session: AgentSession) -> list[TurnResult]:
            async with gate:
                return await run_session(client, model, tool_sets[session.tool_set], session, think_s,
                                         resend_history)

        per_session = await asyncio.gather(*(one(s) for s in sessions))
    return [result for results in per_session for result in results]


def turns_report(results: Sequence[TurnResult]) -> dict[str, Any]:
    """Per API and in all: turns, errors, TTFT p50/p90 and e2e p90 (s), and how often a session's later turn ran on
    the replica of its turn before (`same_replica_share`)."""
    from kvtide.benchmarks.report import percentile

    def stats(rows: Sequence[TurnResult]) -> dict[str, Any]:
        ok = [r for r in rows if r.ok]
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        e2es = sorted(r.e2e_s for r in ok)
        return {"turns": len(rows), "errors": len(rows) - len(ok),
                "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
                "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
                "e2e_p90_s": percentile(e2es, 90) if e2es else None}

    by_session: dict[str, list[TurnResult]] = {}
    for r in results:
        by_session.setdefault(r.session_id, []).append(r)
    follow_ups = stays = 0
    for rows in by_session.values():
        rows.sort(key=lambda r: r.turn)
        for before, after in zip(rows, rows[1:]):
            if before.replica and after.replica:
                follow_ups += 1
                stays += before.replica == after.replica
    return {"all": stats(results), **{api: stats([r for r in results if r.api == api]) for api in APIS},
            "same_replica_share": stays / follow_ups if follow_ups else None}


# ---- `kvtide bench agentic` -----------------------------------------------------------------------

# What a level's summary reads from each repeat's entry, and which way is better.
SUMMARY_METRICS: tuple[tuple[str, Any, bool], ...] = (
    ("hit_rate_vs_infinite_cache", lambda e: e.get("hit_rate_vs_infinite_cache"), True),
    ("engine_hit_rate", lambda e: (e.get("prefix_cache") or {}).get("hit_rate"), True),
    ("ttft_p50_s", lambda e: e["report"]["all"]["ttft_p50_s"], False),
    ("ttft_p90_s", lambda e: e["report"]["all"]["ttft_p90_s"], False),
    ("e2e_p90_s", lambda e: e["report"]["all"]["e2e_p90_s"], False),
    ("same_replica_share", lambda e: e["report"]["same_replica_share"], True),
)
BASELINE_POLICY = "bare"


@dataclass(frozen=True)
class Servers:
    """How `kvtide bench compare` starts a policy's servers and reads their counters, handed in by benchmarks/cli.py
    (which imports this module; this one imports nothing of it): `serving(policy, config, out, args)` (a context
    manager yielding a target with base_url, metrics, model_name), `policy_config(config_path, overrides, policy)`,
    `repeat_order(policies, repeat)`, `scrape(client, metrics)` and `settled_after(client, metrics, before, num_ok,
    settle_s)` (async)."""

    serving: Callable[..., Any]
    policy_config: Callable[..., Any]
    repeat_order: Callable[..., list[str]]
    scrape: Callable[..., Any]
    settled_after: Callable[..., Any]


def _params(args: argparse.Namespace) -> AgenticParams:
    return AgenticParams(num_sessions=args.sessions, num_tool_sets=args.tool_sets,
                         tool_set_tokens=args.tool_set_tokens, tools_per_set=args.tools_per_set,
                         min_turns=args.min_turns, max_turns=args.max_turns, question_tokens=args.question_tokens,
                         tool_result_tokens=args.tool_result_tokens, output_tokens=args.output_tokens)


async def measure_level(servers: Servers, base_url: str, model: str, metrics: Any, tool_sets: Sequence[ToolSet],
                        sessions: Sequence[AgentSession], level: int, *, request_timeout_s: float, settle_s: float,
                        resend_history: bool) -> dict[str, Any]:
    """One pass of `sessions` at `level` sessions in flight, the engines' prefix-cache counters (`metrics`: one
    Prometheus URL, or a mapping of independent servers' URLs, or None) scraped around it."""
    from kvtide.benchmarks.report import metrics_delta

    async with httpx.AsyncClient(timeout=10.0) as client:
        before = await servers.scrape(client, metrics)
        started = time.monotonic()
        turns = await run_sessions(base_url, model, tool_sets, sessions, max_sessions_in_flight=level,
                                   request_timeout_s=request_timeout_s, resend_history=resend_history)
        elapsed_s = time.monotonic() - started
        after = await servers.settled_after(client, metrics, before, sum(t.ok for t in turns), settle_s)
    ceiling = infinite_cache_hit_rate(tool_sets, sessions, resend_history)
    entry: dict[str, Any] = {"sessions_in_flight": level, "elapsed_s": elapsed_s, "infinite_cache_hit_rate": ceiling,
                             "report": turns_report(turns), "turns": [asdict(t) for t in turns]}
    delta = metrics_delta(before, after)
    if delta is not None:
        rate = delta.prefix_cache_hits / delta.prefix_cache_queries if delta.prefix_cache_queries > 0 else None
        entry["prefix_cache"] = {"hits_tokens": delta.prefix_cache_hits, "queries_tokens": delta.prefix_cache_queries,
                                 "hit_rate": rate}
        entry["hit_rate_vs_infinite_cache"] = rate / ceiling if rate is not None and ceiling else None
    return entry


def summarize_policies(runs: Mapping[str, Mapping[str, Sequence[dict[str, Any]]]]) -> dict[str, Any]:
    """{policy: {level: [entry per repeat]}} → per policy and level: each metric's median (min–max) over the
    repeats and, for all but `bare`, its ratio to bare's paired by repeat with the verdict over the ranges."""
    from kvtide.benchmarks.protocol import ratio_summary, summarize_repeats, verdict

    out: dict[str, Any] = {}
    base = runs.get(BASELINE_POLICY)
    for policy, levels in runs.items():
        out[policy] = {}
        for level, entries in levels.items():
            values = {key: [get(e) for e in entries] for key, get, _ in SUMMARY_METRICS}
            summary: dict[str, Any] = {"metrics": {key: summarize_repeats(v) for key, v in values.items()}}
            if base is not None and policy != BASELINE_POLICY and level in base:
                base_values = {key: [get(e) for e in base[level]] for key, get, _ in SUMMARY_METRICS}
                summary[f"vs_{BASELINE_POLICY}"] = {
                    key: {"ratio": ratio_summary(values[key], base_values[key]),
                          "verdict": verdict(values[key], base_values[key], higher)}
                    for key, _, higher in SUMMARY_METRICS}
            out[policy][level] = summary
    return out


def _write(out: Path, results: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(results))


def run_levels(servers: Servers, args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Against one running server: a pass of fresh sessions per level (each level its own seed)."""
    from kvtide.benchmarks.protocol import provenance

    params = _params(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"provenance": provenance(argv), "params": asdict(params),
                               "resend_history": args.resend_history, "repeats": 1, "policies": {"server": {}}}
    for i, level in enumerate(args.sessions_in_flight):
        tool_sets, sessions = build_agentic(params, seed=args.seed + i, tokens_per_word=args.tokens_per_word)
        entry = asyncio.run(measure_level(servers, args.base_url, args.model, args.metrics_url, tool_sets,
                                          sessions, level,
                                          request_timeout_s=args.request_timeout_s, settle_s=args.metrics_settle_s,
                                          resend_history=args.resend_history))
        results["policies"]["server"].setdefault(str(level), []).append(entry)
        results["summary"] = summarize_policies(results["policies"])
        _write(out, results)
    return results


def compare_policies(servers: Servers | None, args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Each policy's server started fresh per repeat (`kvtide bench compare`'s servers), the policy order rotated per
    repeat; per start an unmeasured warm-up pass, then every level. Within a repeat every policy gets the same
    sessions; each repeat draws new ones."""
    from kvtide.benchmarks.processes import stop_servers_on_sigterm
    from kvtide.benchmarks.protocol import provenance
    from kvtide.config import default_config_path

    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))
    if BASELINE_POLICY in policies and not args.resend_history:
        raise ValueError("bare vLLM behind round robin shares no Responses store: previous_response_id would reach "
                         "a server that never saw it; give --resend-history")
    assert servers is not None
    stop_servers_on_sigterm()
    configs = {p: servers.policy_config(args.config or default_config_path(), args.overrides, p) for p in policies}
    params = _params(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    server_args = argparse.Namespace(request_timeout=args.request_timeout_s, bare_balancer=args.bare_balancer)
    results: dict[str, Any] = {"provenance": provenance(argv), "params": asdict(params),
                               "resend_history": args.resend_history, "repeats": args.repeats, "order": [],
                               "hardware": args.hardware, "policies": {p: {} for p in policies}, "failed": {}}
    warm_tool_sets, warm_sessions = build_agentic(AgenticParams(num_sessions=3, num_tool_sets=1, min_turns=2,
                                                                max_turns=2, tool_set_tokens=params.tool_set_tokens),
                                                  seed=-1, tokens_per_word=args.tokens_per_word)
    for repeat in range(args.repeats):
        drawn = [build_agentic(params, seed=args.seed + 1000 * repeat + i, tokens_per_word=args.tokens_per_word)
                 for i in range(len(args.sessions_in_flight))]
        for policy in servers.repeat_order(policies, repeat):
            if policy in results["failed"]:
                continue
            try:
                with servers.serving(policy, configs[policy], out, server_args) as target:
                    asyncio.run(run_sessions(target.base_url, target.model_name, warm_tool_sets, warm_sessions,
                                             max_sessions_in_flight=3, request_timeout_s=args.request_timeout_s,
                                             resend_history=args.resend_history))
                    for level, (tool_sets, sessions) in zip(args.sessions_in_flight, drawn):
                        entry = asyncio.run(measure_level(
                            servers, target.base_url, target.model_name, target.metrics, tool_sets, sessions, level,
                            request_timeout_s=args.request_timeout_s, settle_s=args.metrics_settle_s,
                            resend_history=args.resend_history))
                        results["policies"][policy].setdefault(str(level), []).append({**entry, "repeat": repeat})
                        results["summary"] = summarize_policies(results["policies"])
                        _write(out, results)
                results["order"].append([policy, repeat])
            except Exception as exc:  # one policy failing to start must not lose the others' runs
                results["failed"][policy] = f"{type(exc).__name__}: {str(exc)[:500]}"
                _write(out, results)
    return results


def _spread(summary: Mapping[str, Any] | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    from kvtide.benchmarks.protocol import format_spread

    return format_spread(summary, scale=scale, fmt=fmt)


def report_markdown(results: Mapping[str, Any]) -> str:
    from kvtide.benchmarks.protocol import CLAIM_MIN_REPEATS, provenance_markdown

    p = results["params"]
    history = ("resent each turn (Responses too: input items)" if results.get("resend_history")
               else "resent each turn for chat and Messages; Responses chained by previous_response_id")
    lines = ["# Agentic workload", "",
             f"{p['num_sessions']} sessions over {p['num_tool_sets']} tool sets of ~{p['tool_set_tokens']} tokens, "
             f"{p['min_turns']}–{p['max_turns']} turns each (chat with tools, Messages, Responses: a third each); "
             f"history {history}. {results.get('repeats', 1)} repeat(s): cells are median (min–max) over them. "
             "TTFT and e2e per turn, milliseconds; hit rates from the engines' prefix-cache counters.", "",
             "| policy | sessions in flight | turns (errors) | TTFT p50 | TTFT p90 | e2e p90 | same replica | "
             "engine hit rate | / infinite cache |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for policy, levels in (results.get("summary") or {}).items():
        for level, summary in levels.items():
            m = summary["metrics"]
            entries = results["policies"][policy][level]
            turns = sum(e["report"]["all"]["turns"] for e in entries)
            errors = sum(e["report"]["all"]["errors"] for e in entries)
            lines.append(f"| {policy} | {level} | {turns} ({errors}) | {_spread(m['ttft_p50_s'], 1000, '{:.0f}')} | "
                         f"{_spread(m['ttft_p90_s'], 1000, '{:.0f}')} | {_spread(m['e2e_p90_s'], 1000, '{:.0f}')} | "
                         f"{_spread(m['same_replica_share'])} | {_spread(m['engine_hit_rate'])} | "
                         f"{_spread(m['hit_rate_vs_infinite_cache'])} |")
    against = [(policy, level, s[f"vs_{BASELINE_POLICY}"]) for policy, levels in (results.get("summary") or {}).items()
               for level, s in levels.items() if f"vs_{BASELINE_POLICY}" in s]
    if against:
        lines += ["", f"Against `{BASELINE_POLICY}` (ratios paired by repeat; the verdict compares the ranges):", "",
                  "| policy | sessions in flight | TTFT p90 | e2e p90 | engine hit rate |", "|---|---:|---:|---:|---:|"]
        for policy, level, vs in against:
            cells = [f"{_spread(vs[k]['ratio'], fmt='{:.2f}')}× {vs[k]['verdict'] or ''}".strip()
                     for k in ("ttft_p90_s", "e2e_p90_s", "engine_hit_rate")]
            lines.append(f"| {policy} | {level} | " + " | ".join(cells) + " |")
    if results.get("failed"):
        lines += ["", "Failed: " + "; ".join(f"{k}: {v}" for k, v in results["failed"].items())]
    repeats = results.get("repeats", 1)
    if repeats < CLAIM_MIN_REPEATS:
        lines += ["", f"**{repeats} repeat{'s' if repeats != 1 else ''}: too few to tell a difference from noise; "
                      f"the verdicts above are no claim ({CLAIM_MIN_REPEATS} or more: `--repeats`).**"]
    return "\n".join(lines) + "\n\n" + provenance_markdown(results["provenance"])


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"every level must be >= 1, got {text!r}")
    return levels


def add_compare_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a command that starts each policy's servers as `kvtide bench compare` does (Servers)."""
    cmp = p.add_argument_group("policies compared (servers started as `kvtide bench compare` starts them)")
    cmp.add_argument("--policies", help="comma list, e.g. prefix_aware,pow2,bare")
    cmp.add_argument("--config", help="kvtide config (default: the embedded one)")
    cmp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cmp.add_argument("--repeats", type=int, default=3, help="fresh starts per policy, order rotated (default 3)")
    cmp.add_argument("--bare-balancer", choices=("auto", "haproxy", "python"), default="auto",
                     help="the bare fleet's round robin (as in bench compare)")
    cmp.add_argument("--hardware", default="", help="what it ran on, for the report")


def add_parser(sub: argparse._SubParsersAction, servers: Servers) -> None:
    """Add `bench agentic` to the `bench` subcommands (`servers`: benchmarks/cli.py's, see Servers)."""
    p = sub.add_parser("agentic", help="agent sessions with tools through chat, Messages and Responses, against a "
                                       "running server (--base-url) or one fresh server per policy (--policies)")
    p.add_argument("--out-dir", required=True, help="results.json and report.md")
    one = p.add_argument_group("one running server")
    one.add_argument("--base-url", help="running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    one.add_argument("--metrics-url", help="its Prometheus text, for the engine's prefix-cache counters")
    one.add_argument("--model", help="served model name to send")
    add_compare_flags(p)
    defaults = AgenticParams()
    w = p.add_argument_group("workload")
    w.add_argument("--sessions", type=int, default=defaults.num_sessions)
    w.add_argument("--tool-sets", type=int, default=defaults.num_tool_sets)
    w.add_argument("--tool-set-tokens", type=int, default=defaults.tool_set_tokens)
    w.add_argument("--tools-per-set", type=int, default=defaults.tools_per_set)
    w.add_argument("--min-turns", type=int, default=defaults.min_turns)
    w.add_argument("--max-turns", type=int, default=defaults.max_turns)
    w.add_argument("--question-tokens", type=int, default=defaults.question_tokens)
    w.add_argument("--tool-result-tokens", type=int, default=defaults.tool_result_tokens)
    w.add_argument("--output-tokens", type=int, default=defaults.output_tokens)
    w.add_argument("--tokens-per-word", type=float, default=DEFAULT_TOKENS_PER_WORD,
                   help="the served tokenizer's tokens per word of the generated text")
    w.add_argument("--tokenizer", help="the served model's tokenizer folder: measure --tokens-per-word with it")
    w.add_argument("--resend-history", action="store_true",
                   help="Responses turns resend their history instead of previous_response_id (needed for bare)")
    w.add_argument("--sessions-in-flight", type=_levels, default=[16, 50],
                   help="comma list: one pass of fresh sessions per level")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--request-timeout-s", type=float, default=600.0)
    w.add_argument("--metrics-settle-s", type=float, default=30.0)
    p.set_defaults(func=functools.partial(cmd_agentic, servers=servers))


def cmd_agentic(args: argparse.Namespace, servers: Servers) -> int:
    argv = ["kvtide", *sys.argv[1:]]
    if args.tokenizer:
        from kvtide.benchmarks.workloads import calibrate_tokens_per_word

        args.tokens_per_word = calibrate_tokens_per_word(args.tokenizer)
    try:
        if args.policies:
            results = compare_policies(servers, args, argv)
        elif args.base_url and args.model:
            results = run_levels(servers, args, argv)
        else:
            print("kvtide bench agentic: give --base-url and --model, or --policies", file=sys.stderr)
            return 2
    except ValueError as exc:
        print(f"kvtide bench agentic: {exc}", file=sys.stderr)
        return 2
    print(report_markdown(results))
    errors = any(e["report"]["all"]["errors"] for levels in results["policies"].values()
                 for entries in levels.values() for e in entries)
    return 1 if errors or results.get("failed") else 0
