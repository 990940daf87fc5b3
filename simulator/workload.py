"""The benchmark harness's own workloads as simulated requests: the same prompts, the same arrival times.

`kvtide bench compare` draws a point's prompts with `build_workload(name, params, seed + point offset)`
and sends them at `arrival_times_s(n, rate, duration, seed)`; this module draws the same ones, renders
each with the served model's chat template and tokenizer (as vLLM's chat endpoint does), and names its
full blocks with kvtide's own chained block hashes, so the simulated engines hit where the real ones
could. Only open-loop (rate) points replay: a closed loop's arrivals depend on the server's speed.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtide.simulator.engine import SimRequest


def render_token_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """The prompt's token ids as vLLM's chat endpoint renders it (template, generation prompt added)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def workload_requests(name: str, params: Any, *, seed: int, rate: float, duration_s: float, tokenizer: Any,
                      tokens_per_word: float, block_size: int) -> list[SimRequest]:
    """The requests one open-loop point of `kvtide bench compare` sends, as the engine model takes them."""
    from kvtide.benchmarks.loadgen import arrival_times_s
    from kvtide.benchmarks.workloads import build_workload
    from kvtide.deployments.routing.block_hash import block_hashes

    workload = build_workload(name, params, seed=seed, tokens_per_word=tokens_per_word)
    times = arrival_times_s(len(workload.requests), rate, duration_s, workload.seed)
    out = []
    for i, (request, at_s) in enumerate(zip(workload.requests, times)):
        ids = render_token_ids(tokenizer, request.messages)
        out.append(SimRequest(request_id=str(i), arrival_s=at_s, block_hashes=tuple(block_hashes(ids, block_size)),
                              prompt_tokens=len(ids), output_tokens=max(1, request.max_tokens)))
    return out
