"""The cold/repeat split of a shared-prefix run's samples (benchmarks/cold_repeat.py)."""

from __future__ import annotations

import math

from kvtide.benchmarks.cold_repeat import split_cold_repeat, tpot_s


def _req(group: str, start_s: float, ttft_s: float | None, e2e_s: float = 1.0, tokens: int = 11) -> dict:
    return {"group": group, "start_s": start_s, "ttft_s": ttft_s, "e2e_s": e2e_s, "num_output_tokens": tokens,
            "ok": True}


def test_first_request_of_each_group_by_start_time_is_cold():
    """Each group's earliest request is cold whatever the file order; a request with no token counts as infinitely late."""
    reqs = [_req("b", 2.0, 0.2), _req("a", 1.0, 0.9), _req("a", 0.5, None), _req("b", 3.0, 0.1)]
    cold, repeat = split_cold_repeat(reqs)
    assert math.isinf(cold[0]) and cold[1:] == [0.2]
    assert repeat == [0.9, 0.1]


def test_tpot_is_decode_time_per_token_and_skips_tokenless_requests():
    """TPOT = (e2e - TTFT) / (tokens - 1); requests without a first token or with one token are left out."""
    reqs = [_req("a", 0.0, 0.5, e2e_s=1.5, tokens=11), _req("a", 1.0, None), _req("b", 2.0, 0.1, tokens=1)]
    assert tpot_s(reqs) == [0.1]
