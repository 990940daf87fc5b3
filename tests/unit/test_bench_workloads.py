"""Benchmark workloads: deterministic, shaped as specified, sharing exactly what they should."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from kvtide.benchmarks.workloads import (
    MultiTurnParams,
    PrefixRevisitParams,
    RandomParams,
    SharedPrefixParams,
    build_workload,
    make_params,
    oracle_hit_rate,
    oracle_hit_rate_after,
)

SMALL = {
    "shared-prefix": SharedPrefixParams(num_groups=4, prompts_per_group=3, system_prompt_len=60, question_len=9,
                                        output_len=7),
    "multi-turn": MultiTurnParams(num_users=3, num_rounds=4, system_prompt_len=30, question_len=6, output_len=5),
    "random": RandomParams(num_requests=10, input_len=40, output_len=11),
    "prefix-revisit": PrefixRevisitParams(num_groups=7, num_rounds=4, system_prompt_len=50, question_len=5,
                                          output_len=3, revisit_window=3),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_same_seed_same_requests(name):
    """The same name, params and seed give identical requests; another seed gives different ones."""
    a = build_workload(name, SMALL[name], seed=1)
    assert a.requests == build_workload(name, SMALL[name], seed=1).requests
    assert a.requests != build_workload(name, SMALL[name], seed=2).requests


@pytest.mark.parametrize("name, count, max_tokens", [
    ("shared-prefix", 12, 7), ("multi-turn", 12, 5), ("random", 10, 11), ("prefix-revisit", 28, 3),
])
def test_request_count_and_output_budget(name, count, max_tokens):
    """Each workload yields its request count and sends output_len as max_tokens."""
    w = build_workload(name, SMALL[name])
    assert len(w.requests) == count
    assert {r.max_tokens for r in w.requests} == {max_tokens}


def test_shared_prefix_groups_share_only_their_system_prompt():
    """Requests of a group share one system prompt; groups differ; questions are fresh."""
    w = build_workload("shared-prefix", SMALL["shared-prefix"])
    systems = defaultdict(set)
    for r in w.requests:
        assert [m["role"] for m in r.messages] == ["system", "user"]
        systems[r.group].add(r.messages[0]["content"])
    assert Counter(r.group for r in w.requests) == {f"group-{g}": 3 for g in range(4)}
    assert all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 4
    assert len({r.messages[1]["content"] for r in w.requests}) == 12


def test_shared_prefix_is_shuffled():
    """Groups interleave (seeded shuffle), rather than arriving one group at a time."""
    groups = [r.group for r in build_workload("shared-prefix", SMALL["shared-prefix"]).requests]
    assert groups != sorted(groups, key=lambda g: int(g.split("-")[1]))


def test_multi_turn_history_grows_and_extends_previous_round():
    """Round k+1 of a user re-sends round k's messages plus an assistant turn and a new question."""
    w = build_workload("multi-turn", SMALL["multi-turn"])
    by_user = defaultdict(list)
    for r in w.requests:
        by_user[r.group].append(r.messages)
    for rounds in by_user.values():
        assert [len(m) for m in rounds] == [2, 4, 6, 8]
        for prev, cur in zip(rounds, rounds[1:]):
            assert cur[: len(prev)] == prev
            assert [m["role"] for m in cur[len(prev):]] == ["assistant", "user"]
    assert len({msgs[0]["content"] for msgs in by_user["user-0"]} |
               {msgs[0]["content"] for msgs in by_user["user-1"]}) == 1  # one system prompt for all


def test_multi_turn_is_round_major():
    """All users' round k come before any user's round k+1."""
    lengths = [len(r.messages) for r in build_workload("multi-turn", SMALL["multi-turn"]).requests]
    assert lengths == sorted(lengths)


def test_random_prompts_share_nothing():
    """Random prompts are all distinct."""
    w = build_workload("random", SMALL["random"])
    assert len({r.messages[0]["content"] for r in w.requests}) == 10


def test_length_scales_with_tokens_per_word():
    """Word counts follow tokens / tokens_per_word (the token-count approximation)."""
    p = RandomParams(num_requests=1, input_len=300, output_len=1)
    words = lambda tpw: len(build_workload("random", p, tokens_per_word=tpw).requests[0].messages[0]["content"].split())
    assert words(1.5) == 200 and words(1.0) == 300


def test_defaults_are_sglang_generated_shared_prefix():
    """shared-prefix defaults are SGLang's 64 groups × 16 prompts, 2048/128/256 tokens."""
    assert make_params("shared-prefix") == SharedPrefixParams(64, 16, 2048, 128, 256)


def test_make_params_ignores_other_workloads_flags_and_nones():
    """make_params takes only its workload's fields and skips unset (None) flags."""
    p = make_params("random", num_requests=5, num_groups=9, input_len=None)
    assert p == RandomParams(num_requests=5)


def test_unknown_workload_is_rejected():
    """An unknown workload name fails with the valid choices."""
    with pytest.raises(ValueError, match="shared-prefix"):
        make_params("nope")


def test_as_prompt_joins_messages():
    """The completions rendering keeps every message, in order."""
    r = build_workload("multi-turn", SMALL["multi-turn"]).requests[-1]
    assert r.as_prompt().splitlines()[0].startswith("system: ")
    assert r.as_prompt().count("\n") == len(r.messages) - 1


def test_zipf_popularity_is_skewed_and_seeded():
    """zipf_s > 0 keeps the request count, makes group 0 the most popular, and is deterministic."""
    p = SharedPrefixParams(num_groups=8, prompts_per_group=50, system_prompt_len=12, question_len=3, output_len=4,
                           zipf_s=1.2)
    w = build_workload("shared-prefix", p, seed=3)
    counts = Counter(r.group for r in w.requests)
    assert len(w.requests) == 400
    assert counts.most_common(1)[0][0] == "group-0"
    assert counts["group-0"] > 3 * counts["group-7"]
    assert w.requests == build_workload("shared-prefix", p, seed=3).requests


def test_negative_zipf_is_rejected():
    """A negative Zipf exponent is a configuration error, not a silent uniform run."""
    with pytest.raises(ValueError, match="zipf_s"):
        build_workload("shared-prefix", SharedPrefixParams(num_groups=2, prompts_per_group=2, zipf_s=-1.0))


def test_oracle_hit_rate_counts_each_shared_prefix_once():
    """Oracle: 2 groups × 3 prompts of a 12-word system + 3-word question hit (6-2)·12 of 6·15 words."""
    p = SharedPrefixParams(num_groups=2, prompts_per_group=3, system_prompt_len=12, question_len=3, output_len=4)
    w = build_workload("shared-prefix", p, tokens_per_word=1.0)
    assert oracle_hit_rate(w.requests) == pytest.approx((6 - 2) * 12 / (6 * 15))


def test_oracle_hit_rate_of_multi_turn_reuses_the_previous_round():
    """Oracle for multi-turn: round k+1 hits all of round k's prompt; random prompts never hit."""
    w = build_workload("multi-turn", MultiTurnParams(num_users=1, num_rounds=2, system_prompt_len=10,
                                                     question_len=5, output_len=4), tokens_per_word=1.0)
    # round 1: system 10 + q 5 (cold); round 2: 10 + 5 cached, then assistant 4 + q 5 new.
    assert oracle_hit_rate(w.requests) == pytest.approx(15 / (15 + 24))
    assert oracle_hit_rate(build_workload("random", SMALL["random"]).requests) == 0.0
    assert oracle_hit_rate([]) is None


def test_prefix_revisit_rounds_visit_every_group_once_with_its_own_prefix():
    """prefix-revisit: each round visits every group once, with the group's own prefix and a fresh question."""
    p = SMALL["prefix-revisit"]
    w = build_workload("prefix-revisit", p)
    rounds = [w.requests[i: i + p.num_groups] for i in range(0, len(w.requests), p.num_groups)]
    assert len(rounds) == p.num_rounds
    assert all(sorted(r.group for r in rnd) == sorted(f"group-{g}" for g in range(p.num_groups)) for rnd in rounds)
    systems = defaultdict(set)
    for r in w.requests:
        assert [m["role"] for m in r.messages] == ["system", "user"]
        systems[r.group].add(r.messages[0]["content"])
    assert all(len(s) == 1 for s in systems.values()) and len({next(iter(s)) for s in systems.values()}) == 7
    assert len({r.messages[1]["content"] for r in w.requests}) == len(w.requests)


@pytest.mark.parametrize("groups, window", [(7, 3), (24, 8), (5, 5), (6, 1)])
def test_prefix_revisit_distance_is_bounded_by_the_window(groups, window):
    """A revisit comes after groups − w .. groups + w − 2 requests (≥ groups − w distinct groups); rounds reshuffle."""
    p = PrefixRevisitParams(num_groups=groups, num_rounds=6, system_prompt_len=4, question_len=2, output_len=1,
                            revisit_window=window)
    groups_sent = [r.group for r in build_workload("prefix-revisit", p, seed=5).requests]
    last: dict[str, int] = {}
    for i, group in enumerate(groups_sent):
        if group in last:
            between = groups_sent[last[group] + 1: i]
            assert groups - window <= len(between) <= groups + window - 2
            assert len(set(between) - {group}) >= groups - window
        last[group] = i
    rounds = {tuple(groups_sent[i: i + groups]) for i in range(0, len(groups_sent), groups)}
    assert len(rounds) > 1 if window > 1 else len(rounds) == 1


def test_prefix_revisit_refuses_empty_shapes():
    """A prefix-revisit with no group, round or window is a configuration error."""
    with pytest.raises(ValueError, match="revisit_window"):
        build_workload("prefix-revisit", PrefixRevisitParams(revisit_window=0))


def test_oracle_after_a_first_round_counts_every_later_prefix_as_held():
    """After a warm first round the oracle holds every prefix: 4 later requests hit 12 of 15 words each, 0.8."""
    p = PrefixRevisitParams(num_groups=2, num_rounds=3, system_prompt_len=12, question_len=3, output_len=1,
                            revisit_window=2)
    w = build_workload("prefix-revisit", p, tokens_per_word=1.0)
    warm, measured = w.requests[:2], w.requests[2:]
    assert oracle_hit_rate_after(warm, measured) == pytest.approx(4 * 12 / (4 * 15))
    assert oracle_hit_rate(w.requests) == pytest.approx(4 * 12 / (6 * 15))
    assert oracle_hit_rate_after((), measured) == pytest.approx(oracle_hit_rate(measured))
    assert oracle_hit_rate_after(warm, ()) is None
