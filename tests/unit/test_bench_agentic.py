"""The agentic workload: sessions over shared tool sets, each API's turn bodies, the infinite-cache ceiling, the report."""

from __future__ import annotations

import pytest

from kvtide.benchmarks.agentic import (APIS, TOOL_NAME, AgenticParams, AgentSession, ToolSet, TurnResult,
                                       build_agentic, infinite_cache_hit_rate, turn_body, turns_report)


def test_sessions_are_deterministic_spread_over_the_three_apis_and_share_few_tool_sets():
    """The same (params, seed) builds the same sessions; APIs alternate; turns within bounds; tool sets of the size
    asked (in words at the given tokens per word)."""
    params = AgenticParams(num_sessions=9, num_tool_sets=2, tool_set_tokens=600, tools_per_set=4, min_turns=2,
                           max_turns=4)
    first, again = build_agentic(params, seed=3), build_agentic(params, seed=3)
    assert first == again and build_agentic(params, seed=4) != first
    tool_sets, sessions = first
    assert [s.api for s in sessions] == list(APIS) * 3
    assert all(2 <= s.num_turns <= 4 and len(s.calls) == len(s.results) == s.num_turns - 1 for s in sessions)
    assert {s.tool_set for s in sessions} <= {0, 1} and len(tool_sets) == 2
    words = [len(ts.system.split()) + sum(len(t["function"]["description"].split()) for t in ts.tools)
             for ts in tool_sets]
    assert all(abs(w * 1.5 - 600) <= 1.5 * 5 for w in words), words  # DEFAULT_TOKENS_PER_WORD
    assert tool_sets[0].tools[0]["function"]["name"] == TOOL_NAME


@pytest.mark.parametrize("bad", [dict(num_sessions=0), dict(min_turns=0), dict(min_turns=5, max_turns=4)])
def test_impossible_params_are_refused(bad):
    """No sessions, no turns, or a turn range upside down: ValueError naming the bound."""
    with pytest.raises(ValueError):
        AgenticParams(**bad)


TOOLS = ToolSet("system prompt words", ({"type": "function", "function": {
    "name": TOOL_NAME, "description": "looks a word up", "parameters": {"type": "object", "properties": {}}}},))


def _session(api: str, turns: int = 3) -> AgentSession:
    return AgentSession(f"s-{api}", api, 0, "first question", tuple({"query": f"q{t}"} for t in range(turns - 1)),
                        tuple(f"result {t}" for t in range(turns - 1)), 8)


def test_a_chat_turn_resends_the_history_with_each_tool_call_and_its_result():
    """Chat: system, question, then per earlier turn the assistant's tool call and a tool message answering its id."""
    path, body = turn_body("m", TOOLS, _session("chat"), 2)
    assert path == "/v1/chat/completions" and body["tools"] == list(TOOLS.tools) and body["stream"]
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    calls = [m["tool_calls"][0] for m in body["messages"] if m["role"] == "assistant"]
    answers = [m for m in body["messages"] if m["role"] == "tool"]
    assert [c["id"] for c in calls] == [a["tool_call_id"] for a in answers]
    assert [a["content"] for a in answers] == ["result 0", "result 1"]


def test_a_messages_turn_resends_tool_use_and_tool_result_blocks():
    """Messages: `system` apart, the history alternates the assistant's tool_use and the user's tool_result."""
    path, body = turn_body("m", TOOLS, _session("messages"), 1)
    assert path == "/v1/messages" and body["system"] == TOOLS.system and body["tool_choice"] == {"type": "none"}
    assert body["tools"][0]["input_schema"] == TOOLS.tools[0]["function"]["parameters"]
    use, result = body["messages"][1]["content"][0], body["messages"][2]["content"][0]
    assert (use["type"], result["type"]) == ("tool_use", "tool_result") and use["id"] == result["tool_use_id"]


def test_a_responses_turn_after_the_first_sends_only_the_previous_id_and_the_result():
    """Responses: the first turn carries the instructions; later ones previous_response_id and the tool's result
    (the server keeps the history); without the previous id a later turn cannot be built."""
    session = _session("responses")
    _, first = turn_body("m", TOOLS, session, 0)
    assert first["instructions"] == TOOLS.system and first["store"] and "previous_response_id" not in first
    _, later = turn_body("m", TOOLS, session, 1, previous_response_id="resp_1")
    assert later["previous_response_id"] == "resp_1" and "instructions" not in later and "result 0" in later["input"]
    with pytest.raises(ValueError, match="previous response"):
        turn_body("m", TOOLS, session, 1)
    with pytest.raises(ValueError, match="turns"):
        turn_body("m", TOOLS, session, 3)


def test_the_infinite_cache_ceiling_counts_the_shared_tool_set_and_each_sessions_own_history():
    """Two chat sessions on one tool set, two turns each: turn 0 of the second hits the tool set; each turn 1 hits its
    own turn 0's prompt. Computed by hand in words."""
    tool_set = ToolSet("a b c d e f", ({"type": "function", "function": {
        "name": TOOL_NAME, "description": "g h i j", "parameters": {}}},))  # 10 words
    sessions = [AgentSession(f"s{i}", "chat", 0, "q q", ({"query": "x"},), ("r r r",), 4) for i in range(2)]
    call_words = len('{"query": "x"}'.split())  # the tool call's arguments as resent
    turn0, turn1 = 10 + 2, 10 + 2 + call_words + 3
    hit = 10 + 2 * (10 + 2)  # turn 0: the second session's tool set; turn 1: each its own turn-0 prompt
    assert infinite_cache_hit_rate([tool_set], sessions) == pytest.approx(hit / (2 * turn0 + 2 * turn1))
    assert infinite_cache_hit_rate([tool_set], []) is None


def test_the_report_gives_percentiles_per_api_and_how_often_a_follow_up_stayed_on_its_replica():
    """turns_report: per API counts, errors and TTFT/e2e percentiles; same_replica_share over consecutive turns."""
    rows = [TurnResult("a", "chat", 0, True, 0.1, 1.0, "r1"), TurnResult("a", "chat", 1, True, 0.3, 2.0, "r1"),
            TurnResult("b", "messages", 0, True, 0.2, 1.0, "r2"), TurnResult("b", "messages", 1, True, 0.2, 1.0, "r1"),
            TurnResult("c", "responses", 0, False, None, 0.5, None, error="HTTP 500")]
    report = turns_report(rows)
    assert report["all"]["turns"] == 5 and report["all"]["errors"] == 1
    assert report["chat"]["ttft_p50_s"] == pytest.approx(0.2) and report["responses"]["ttft_p50_s"] is None
    assert report["same_replica_share"] == pytest.approx(0.5)


def test_levels_parse_as_a_comma_list_of_positive_integers():
    """--sessions-in-flight: "16,50" → [16, 50]; zero, negatives or words are refused."""
    import argparse

    from kvtide.benchmarks.agentic import _levels

    assert _levels("16,50") == [16, 50]
    for bad in ("0", "16,-1", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            _levels(bad)


def _entry(hit_rate: float, ttft_p90_s: float, repeat: int) -> dict:
    return {"sessions_in_flight": 16, "infinite_cache_hit_rate": 0.8, "prefix_cache": {"hit_rate": hit_rate},
            "hit_rate_vs_infinite_cache": hit_rate / 0.8, "repeat": repeat,
            "report": {"all": {"turns": 40, "errors": 0, "ttft_p50_s": 0.05, "ttft_p90_s": ttft_p90_s,
                               "e2e_p90_s": 1.2}, "same_replica_share": 1.0}}


def test_policies_are_summarized_over_repeats_and_paired_with_bare_by_repeat():
    """summarize_policies: each metric's median (min–max) over the repeats; against bare, the ratio paired by repeat
    and a verdict only where the ranges do not overlap."""
    from kvtide.benchmarks.agentic import summarize_policies

    runs = {"bare": {"16": [_entry(0.4, 0.20, r) for r in range(3)]},
            "prefix_aware": {"16": [_entry(0.76, t, r) for r, t in enumerate((0.08, 0.10, 0.09))]}}
    summary = summarize_policies(runs)
    assert summary["prefix_aware"]["16"]["metrics"]["ttft_p90_s"]["median"] == pytest.approx(0.09)
    vs = summary["prefix_aware"]["16"]["vs_bare"]
    assert vs["ttft_p90_s"]["ratio"]["median"] == pytest.approx(0.45) and vs["ttft_p90_s"]["verdict"] == "better"
    assert vs["engine_hit_rate"]["verdict"] == "better" and "vs_bare" not in summary["bare"]["16"]


def test_the_report_reads_each_policys_hit_rate_against_the_ceiling_and_bare():
    """report.md: a row per policy and level (ms, hit rates, their ratio to the ceiling), then the ratios to bare."""
    from kvtide.benchmarks.agentic import report_markdown, summarize_policies

    policies = {"bare": {"16": [_entry(0.4, 0.2, 0)]}, "prefix_aware": {"16": [_entry(0.76, 0.1, 0)]}}
    prov = {"kvtide_commit": "abc", "versions": {"vllm": "0.32.0"}, "gpu": None, "command": "kvtide",
            "host": {"system": "Linux", "release": "6", "machine": "x86_64", "cpu_count": 2},
            "utc": "2026-12-06T00:00:00+00:00"}
    params = {"num_sessions": 60, "num_tool_sets": 3, "tool_set_tokens": 6000, "min_turns": 5, "max_turns": 10}
    text = report_markdown({"params": params, "policies": policies, "summary": summarize_policies(policies),
                            "provenance": prov, "repeats": 1})
    assert "| prefix_aware | 16 | 40 (0) | 50 | 100 | 1200 | 1.000 | 0.760 | 0.950 |" in text
    assert "| prefix_aware | 16 | 0.50×" in text and "too few to tell a difference from noise" in text


def test_comparing_with_bare_needs_the_history_resent():
    """bare vLLM behind round robin shares no Responses store: the comparison refuses to chain previous_response_id."""
    import argparse

    from kvtide.benchmarks.agentic import compare_policies

    args = argparse.Namespace(policies="prefix_aware,bare", resend_history=False)
    with pytest.raises(ValueError, match="resend-history"):
        compare_policies(None, args, ["kvtide"])


def test_a_resent_responses_turn_carries_every_call_and_result_as_input_items():
    """--resend-history: a later Responses turn resends instructions, the question and each function call with its
    output (matching call ids), stores nothing and needs no previous id."""
    _, body = turn_body("m", TOOLS, _session("responses"), 2, resend_history=True)
    assert "previous_response_id" not in body and body["store"] is False and body["instructions"] == TOOLS.system
    kinds = [item.get("type", "message") for item in body["input"]]
    assert kinds == ["message", "function_call", "function_call_output", "function_call", "function_call_output"]
    calls, outputs = body["input"][1::2], body["input"][2::2]
    assert [c["call_id"] for c in calls] == [o["call_id"] for o in outputs]
