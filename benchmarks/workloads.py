"""Benchmark workloads: deterministic request lists from a seed.

    shared-prefix   groups × prompts per group; each group shares one long system prompt
                    (SGLang's generated-shared-prefix: 64 × 16, 2048 / 128 / 256 tokens).
                    zipf_s > 0 draws each of the groups × prompts requests' group from a Zipf
                    law instead (P(group g) ∝ 1 / (g + 1)^s): a few hot groups, a long tail
    multi-turn      users × rounds; one system prompt for all, each round re-sends the
                    growing conversation (its prefix is the previous round's prompt)
    random          independent prompts, nothing shared (the no-affinity baseline)
    prefix-revisit  groups × rounds; each group one long system prompt, every round visits every
                    group once with a fresh question. The group order is one seeded permutation
                    cut into windows of `revisit_window` groups, each window reshuffled per round,
                    so a group comes back after at least groups − window and at most
                    groups + window − 2 other requests: a working set of many prefixes revisited
                    at a bounded distance (a cache holding fewer prefixes than that distance has
                    evicted a prefix, LRU, before it comes back; one holding them all has not)

Requests are chat messages (`BenchRequest.messages`). Text is drawn from a fixed word
list, so token counts are approximate: `tokens_per_word` converts (the default was
measured with the demo model's tokenizer; `calibrate_tokens_per_word` measures it for
any local tokenizer). The same seed and parameters give the same requests, byte for byte.

Order: shared-prefix and random are shuffled (seeded), so groups interleave as they
would from many clients. multi-turn is round-major (all users' round 1, then round 2,
each round shuffled): with steady arrivals, a user's next round is sent roughly one
round-length after the previous one. The assistant turns in the history are synthetic
text of the output length, not the model's replies (the demo model's output is random
text anyway); what matters for caching is that round k+1's prompt extends round k's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any, Sequence

# ~1.5 tokens per word (leading space included) with the demo model's BPE tokenizer,
# measured over this word list; see calibrate_tokens_per_word.
DEFAULT_TOKENS_PER_WORD = 1.5

WORDS = tuple(dict.fromkeys("""
the of and to in is for that with as on by this be are from or at an it not which can
if value object function name type return class module list string data set file line
code method call error time number first new used default argument example attribute
result option section process system state order field table event source target
model request server client engine cache block token prefix stream output input window
replica router policy metric queue batch memory device thread worker node cluster
simple large small fast slow early late open close start stop read write send receive
apple river mountain garden window silver orange forest ocean bridge castle pencil
morning evening summer winter yellow purple circle square market planet rocket
""".split()))


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: chat messages, the output budget, and its sharing group."""

    messages: tuple[dict[str, str], ...]
    max_tokens: int
    group: str  # shared-prefix group, multi-turn user, or the request index for random

    def as_prompt(self) -> str:
        """Plain text for /v1/completions: the messages joined in order."""
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages)


@dataclass(frozen=True)
class SharedPrefixParams:
    num_groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    zipf_s: float = 0.0  # 0: every group gets prompts_per_group requests; > 0: Zipf-skewed popularity


@dataclass(frozen=True)
class MultiTurnParams:
    num_users: int = 32
    num_rounds: int = 6
    system_prompt_len: int = 512
    question_len: int = 128
    output_len: int = 128


@dataclass(frozen=True)
class RandomParams:
    num_requests: int = 1024
    input_len: int = 1024
    output_len: int = 256


@dataclass(frozen=True)
class PrefixRevisitParams:
    num_groups: int = 24
    num_rounds: int = 5
    system_prompt_len: int = 4096
    question_len: int = 64
    output_len: int = 16
    # Groups per window: a group's revisit comes after groups − window .. groups + window − 2 other requests.
    revisit_window: int = 8


WORKLOAD_PARAMS: dict[str, type] = {
    "shared-prefix": SharedPrefixParams,
    "multi-turn": MultiTurnParams,
    "random": RandomParams,
    "prefix-revisit": PrefixRevisitParams,
}


@dataclass(frozen=True)
class Workload:
    name: str
    params: Any
    seed: int
    requests: tuple[BenchRequest, ...]


def _text(rng: random.Random, num_tokens: int, tokens_per_word: float) -> str:
    num_words = max(1, round(num_tokens / tokens_per_word))
    return " ".join(rng.choices(WORDS, k=num_words))


def _shared_prefix(p: SharedPrefixParams, rng: random.Random, tpw: float) -> list[BenchRequest]:
    if p.zipf_s < 0:
        raise ValueError(f"zipf_s must be >= 0, got {p.zipf_s}")
    if p.zipf_s > 0:
        return _zipf_shared_prefix(p, rng, tpw)
    out = []
    for g in range(p.num_groups):
        system = {"role": "system", "content": _text(rng, p.system_prompt_len, tpw)}
        for _ in range(p.prompts_per_group):
            question = {"role": "user", "content": _text(rng, p.question_len, tpw)}
            out.append(BenchRequest((system, question), p.output_len, f"group-{g}"))
    rng.shuffle(out)
    return out


def _zipf_shared_prefix(p: SharedPrefixParams, rng: random.Random, tpw: float) -> list[BenchRequest]:
    """groups × prompts requests, each one's group drawn with P(g) ∝ 1 / (g + 1)^s, in arrival order."""
    systems = [{"role": "system", "content": _text(rng, p.system_prompt_len, tpw)} for _ in range(p.num_groups)]
    weights = [1.0 / (g + 1) ** p.zipf_s for g in range(p.num_groups)]
    groups = rng.choices(range(p.num_groups), weights=weights, k=p.num_groups * p.prompts_per_group)
    return [BenchRequest((systems[g], {"role": "user", "content": _text(rng, p.question_len, tpw)}),
                         p.output_len, f"group-{g}") for g in groups]


def _multi_turn(p: MultiTurnParams, rng: random.Random, tpw: float) -> list[BenchRequest]:
    system = {"role": "system", "content": _text(rng, p.system_prompt_len, tpw)}
    histories: list[list[dict[str, str]]] = [[system] for _ in range(p.num_users)]
    out = []
    for _ in range(p.num_rounds):
        this_round = []
        for user, history in enumerate(histories):
            history.append({"role": "user", "content": _text(rng, p.question_len, tpw)})
            this_round.append(BenchRequest(tuple(history), p.output_len, f"user-{user}"))
            history.append({"role": "assistant", "content": _text(rng, p.output_len, tpw)})
        rng.shuffle(this_round)
        out.extend(this_round)
    return out


def _random(p: RandomParams, rng: random.Random, tpw: float) -> list[BenchRequest]:
    return [BenchRequest(({"role": "user", "content": _text(rng, p.input_len, tpw)},), p.output_len, f"request-{i}")
            for i in range(p.num_requests)]


def _prefix_revisit(p: PrefixRevisitParams, rng: random.Random, tpw: float) -> list[BenchRequest]:
    """Every round visits every group once; a group stays in its window of the permutation, so its
    position moves by less than a window from one round to the next (the revisit bound above)."""
    if p.num_groups < 1 or p.num_rounds < 1 or p.revisit_window < 1:
        raise ValueError(f"prefix-revisit needs num_groups, num_rounds and revisit_window >= 1, got {p}")
    systems = [{"role": "system", "content": _text(rng, p.system_prompt_len, tpw)} for _ in range(p.num_groups)]
    order = list(range(p.num_groups))
    rng.shuffle(order)
    windows = [order[i: i + p.revisit_window] for i in range(0, p.num_groups, p.revisit_window)]
    out = []
    for _ in range(p.num_rounds):
        for window in windows:
            visits = list(window)
            rng.shuffle(visits)
            out += [BenchRequest((systems[g], {"role": "user", "content": _text(rng, p.question_len, tpw)}),
                                 p.output_len, f"group-{g}") for g in visits]
    return out


_BUILDERS = {"shared-prefix": _shared_prefix, "multi-turn": _multi_turn, "random": _random,
             "prefix-revisit": _prefix_revisit}


def make_params(name: str, **overrides: Any) -> Any:
    """The params dataclass of workload `name` with the given fields overridden (None values ignored)."""
    if name not in WORKLOAD_PARAMS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_PARAMS)}")
    cls = WORKLOAD_PARAMS[name]
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in overrides.items() if k in known and v is not None})


def build_workload(name: str, params: Any = None, *, seed: int = 0,
                   tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> Workload:
    """Requests of workload `name` (see the module docstring), deterministic in (params, seed)."""
    params = params if params is not None else make_params(name)
    if not isinstance(params, WORKLOAD_PARAMS.get(name, ())):
        raise ValueError(f"workload {name!r} takes {WORKLOAD_PARAMS[name].__name__}, got {type(params).__name__}")
    if tokens_per_word <= 0:
        raise ValueError(f"tokens_per_word must be positive, got {tokens_per_word}")
    rng = random.Random(f"{name}:{seed}")  # str seeds hash with sha512: stable across processes
    requests = _BUILDERS[name](params, rng, tokens_per_word)
    return Workload(name, params, seed, tuple(requests))


def oracle_hit_rate(requests: Sequence[BenchRequest]) -> float | None:
    """The prefix-cache hit rate of one infinite cache shared by the whole fleet, sent in this order.

    Every shared prefix is computed once: a request's cached part is its longest run of leading
    whole messages that an earlier request began with (a shared system prompt; in multi-turn the
    previous round's prompt). Counted in words, which is the token ratio since all text is drawn
    at one tokens-per-word rate; chat-template tokens are left out. The ceiling any router's
    hit rate is read against. None for no requests.
    """
    seen: set[tuple[str, ...]] = set()
    hit_words = total_words = 0
    for request in requests:
        words = [len(m["content"].split()) for m in request.messages]
        keys = [tuple(m["content"] for m in request.messages[: i + 1]) for i in range(len(words))]
        cached = max((i + 1 for i, key in enumerate(keys[:-1]) if key in seen), default=0)
        hit_words += sum(words[:cached])
        total_words += sum(words)
        seen.update(keys)
    return hit_words / total_words if total_words else None


def oracle_hit_rate_after(warm: Sequence[BenchRequest], requests: Sequence[BenchRequest]) -> float | None:
    """`oracle_hit_rate` of `requests` sent after `warm`: the infinite cache already holds every prefix
    `warm` sent, and only `requests`' own words count (a run measured after an unmeasured first pass,
    e.g. prefix-revisit's first round). None for no requests."""
    def words(batch: Sequence[BenchRequest]) -> int:
        return sum(len(m["content"].split()) for r in batch for m in r.messages)

    total = words(requests)
    if not total:
        return None
    # The oracle scans in order, so the hits over warm + requests are warm's own hits plus requests'.
    both = [*warm, *requests]
    hits = (oracle_hit_rate(both) or 0.0) * words(both) - (oracle_hit_rate(warm) or 0.0) * words(warm)
    return hits / total


def calibrate_tokens_per_word(tokenizer_path: str, *, num_words: int = 2000, seed: int = 0) -> float:
    """Tokens per word of this module's text under a local HF tokenizer (e.g. the served model's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    text = " ".join(random.Random(seed).choices(WORDS, k=num_words))
    return len(tokenizer.encode(text, add_special_tokens=False)) / num_words
