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

Pure: builds sessions and request bodies; the runner (`run_sessions`) sends them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

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
              previous_response_id: str | None = None) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of `session`'s turn `turn` (0-based). A Responses turn after the first needs the id of the
    response to the turn before; chat and Messages resend the whole history."""
    if not 0 <= turn < session.num_turns:
        raise ValueError(f"{session.session_id} has {session.num_turns} turns, not a turn {turn}")
    if session.api == "responses":
        body: dict[str, Any] = {"model": model, "max_output_tokens": session.output_tokens, "stream": True,
                                "tools": [{"type": "function", **t["function"]} for t in tool_set.tools],
                                "tool_choice": "none", "store": True, "temperature": 0}
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
        return "/v1/messages", {"model": model, "system": tool_set.system, "messages": history, "tools": tools,
                                "max_tokens": session.output_tokens, "stream": True, "temperature": 0}
    raise ValueError(f"unknown API {session.api!r}; choose one of {', '.join(APIS)}")


def _segments(tool_set_index: int, tool_set: ToolSet, session: AgentSession, turn: int) -> list[tuple[str, int]]:
    """The prompt of a turn as (key, words) segments in order: the tool set, the question, then per earlier turn
    its output (the model's, for Responses; the tool call's otherwise) and the tool's result."""
    set_words = len(tool_set.system.split()) + sum(len(t["function"]["description"].split()) for t in tool_set.tools)
    segments = [(f"set-{tool_set_index}", set_words), (f"{session.session_id}/q", len(session.question.split()))]
    for t in range(turn):
        output_words = session.output_tokens if session.api == "responses" else len(json.dumps(session.calls[t]).split())
        segments.append((f"{session.session_id}/out{t}", output_words))
        segments.append((f"{session.session_id}/res{t}", len(session.results[t].split())))
    return segments


def infinite_cache_hit_rate(tool_sets: Sequence[ToolSet], sessions: Sequence[AgentSession]) -> float | None:
    """The hit rate of one infinite cache shared by the fleet (module docstring), sessions' turns sent in turn order
    across sessions (every session's turn 0, then every turn 1, ...). None for no requests."""
    seen: set[tuple[str, ...]] = set()
    hit = total = 0
    for turn in range(max((s.num_turns for s in sessions), default=0)):
        for session in sessions:
            if turn >= session.num_turns:
                continue
            segments = _segments(session.tool_set, tool_sets[session.tool_set], session, turn)
            keys = [tuple(key for key, _ in segments[: i + 1]) for i in range(len(segments))]
            cached = max((i + 1 for i, key in enumerate(keys[:-1]) if key in seen), default=0)
            words = [w for _, w in segments]
            if session.api == "responses" and turn > 0:
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
                      think_s: float = 0.0) -> list[TurnResult]:
    """Every turn of one session in order (a turn is sent when the one before has ended, after `think_s`); stops at
    the first failed turn (an agent cannot go on without its answer)."""
    results: list[TurnResult] = []
    previous_id = None
    for turn in range(session.num_turns):
        path, body = turn_body(model, tool_set, session, turn, previous_id)
        stream, start, replica = await _send_turn(client, path, body, session.api, session.session_id)
        end = time.perf_counter()
        error = stream.error or (None if session.api != "responses" or stream.response_id else "no response id")
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
                       think_s: float = 0.0) -> list[TurnResult]:
    """All `sessions`, at most `max_sessions_in_flight` at once (each session's turns in order): every turn's result."""
    from kvtide.benchmarks.loadgen import client_limits

    if max_sessions_in_flight < 1:
        raise ValueError(f"max_sessions_in_flight must be >= 1, got {max_sessions_in_flight}")
    gate = asyncio.Semaphore(max_sessions_in_flight)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(request_timeout_s, connect=10.0),
                                 limits=client_limits(max_sessions_in_flight)) as client:
        async def one(session: AgentSession) -> list[TurnResult]:
            async with gate:
                return await run_session(client, model, tool_sets[session.tool_set], session, think_s)

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
