"""The simulator's engine model: vLLM-v1-like chunked-prefill scheduling, prefix cache, LRU eviction, preemption."""

from __future__ import annotations

import random

import pytest

from kvtide.simulator.engine import EngineLimits, EngineModel, SimRequest, StepProfile, StepResult

BS = 4
UNIT = StepProfile(base_s=1.0, per_prefill_token_s=0.0, per_decode_seq_s=0.0)  # every step lasts 1 s


def _engine(num_blocks=64, budget=64, max_seqs=16, block_size=BS, profile=UNIT) -> EngineModel:
    return EngineModel(EngineLimits(num_blocks=num_blocks, block_size=block_size,
                                    max_num_batched_tokens=budget, max_num_seqs=max_seqs), profile)


def _req(rid: str, hashes: tuple[int, ...], prompt: int, output: int = 1, arrival: float = 0.0) -> SimRequest:
    return SimRequest(request_id=rid, arrival_s=arrival, block_hashes=hashes, prompt_tokens=prompt,
                      output_tokens=output)


class _Clock:
    """Steps an engine back to back from t=0, as the fleet's event loop does."""

    def __init__(self, engine: EngineModel) -> None:
        self.engine = engine
        self.now = 0.0

    def step(self) -> StepResult:
        result = self.engine.step(self.now)
        self.now += result.duration_s
        return result

    def drain(self, limit: int = 10_000) -> list[StepResult]:
        results = []
        while self.engine.has_work():
            results.append(self.step())
            assert len(results) < limit, "engine did not drain"
        return results


# ---- budget and chunking ----------------------------------------------------------------------


def test_long_prompt_is_chunked_over_steps_then_decodes_one_token_per_step():
    """A 10-block prompt under a 4-block budget prefills over 3 steps, its first token ends step 3, then 1 token/step."""
    engine = _engine(budget=4 * BS)
    r = _req("a", tuple(range(1, 11)), prompt=10 * BS, output=3)
    engine.add(r)
    clock = _Clock(engine)
    results = clock.drain()
    assert [s.prefill_tokens for s in results] == [16, 16, 8, 0, 0]
    assert [s.decode_seqs for s in results] == [0, 0, 0, 1, 1]
    assert [[q.request_id for q in s.first_tokens] for s in results] == [[], [], ["a"], [], []]
    assert r.first_token_s == 3.0
    assert r.finished_s == 5.0
    assert [[q.request_id for q in s.finished] for s in results] == [[], [], [], [], ["a"]]
    assert not engine.has_work() and engine.kv_usage == 0.0


def test_output_of_one_token_finishes_in_the_prefill_step():
    """A request with output_tokens=1 finishes in the step that completes its prompt, at that step's end."""
    engine = _engine()
    r = _req("a", (1,), prompt=6, output=1)
    engine.add(r)
    s = engine.step(2.0)
    assert s.first_tokens == [r] and s.finished == [r]
    assert r.first_token_s == r.finished_s == 3.0
    assert not engine.has_work()


def test_running_decodes_come_first_and_the_waiting_prefill_gets_the_rest():
    """Decodes of running requests are scheduled before a waiting prompt, which is chunked into the leftover budget."""
    engine = _engine(budget=10)
    a = _req("a", (1, 2), prompt=8, output=5)
    b = _req("b", (3, 4, 5, 6, 7), prompt=20, output=2)
    engine.add(a)
    engine.add(b)
    clock = _Clock(engine)
    s1, s2, s3 = clock.step(), clock.step(), clock.step()
    assert (s1.prefill_tokens, s1.decode_seqs) == (8 + 2, 0)     # a's whole prompt, then 2 of b's
    assert (s2.prefill_tokens, s2.decode_seqs) == (9, 1)         # a decodes, b gets the other 9
    assert (s3.prefill_tokens, s3.decode_seqs) == (9, 1)         # b's prompt completes: 2 + 9 + 9 = 20
    assert a.first_token_s == 1.0 and b.first_token_s == 3.0
    assert s3.first_tokens == [b]


def test_max_num_seqs_caps_admission():
    """No more than max_num_seqs requests run; a waiting one is admitted in the step after a running one finished."""
    engine = _engine(max_seqs=2)
    reqs = [_req("a", (), prompt=3, output=2), _req("b", (), prompt=3, output=3), _req("c", (), prompt=3, output=1)]
    for r in reqs:
        engine.add(r)
    clock = _Clock(engine)
    s1 = clock.step()
    assert s1.first_tokens == reqs[:2]
    assert (engine.num_running, engine.num_waiting) == (2, 1)
    s2 = clock.step()                         # a finishes; c still cannot enter in this step
    assert s2.finished == [reqs[0]] and s2.first_tokens == []
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    s3 = clock.step()                         # b's last decode, c admitted
    assert (s3.decode_seqs, s3.prefill_tokens) == (1, 3)
    assert s3.finished == [reqs[1], reqs[2]]
    assert not engine.has_work()


# ---- prefix cache hits ------------------------------------------------------------------------


def test_shared_prefix_hits_and_counters():
    """A request sharing 3 of 4 blocks with a finished one hits 3 blocks; the counters add prompt and hit tokens."""
    engine = _engine()
    first = _req("first", (1, 2, 3, 4), prompt=4 * BS + 2)
    engine.add(first)
    _Clock(engine).drain()
    assert first.cached_tokens == 0
    assert (engine.prefix_queries_tokens, engine.prefix_hits_tokens) == (18, 0)
    second = _req("second", (1, 2, 3, 9), prompt=4 * BS + 2)
    engine.add(second)
    s = engine.step(10.0)
    assert second.cached_tokens == 3 * BS
    assert s.prefill_tokens == 18 - 12
    assert (engine.prefix_queries_tokens, engine.prefix_hits_tokens) == (36, 12)


def test_the_prompt_last_token_never_hits():
    """An identical repeat hits (prompt_tokens - 1) // block_size blocks: all 4 with a partial tail, 3 when block-aligned."""
    engine = _engine()
    clock = _Clock(engine)
    aligned = (11, 12, 13, 14)
    engine.add(_req("aligned-1", aligned, prompt=4 * BS))
    clock.drain()
    again = _req("aligned-2", aligned, prompt=4 * BS)
    engine.add(again)
    s = clock.step()
    assert again.cached_tokens == 3 * BS and s.prefill_tokens == BS

    tailed = (21, 22, 23, 24)
    engine.add(_req("tailed-1", tailed, prompt=4 * BS + 3))
    clock.drain()
    again = _req("tailed-2", tailed, prompt=4 * BS + 3)
    engine.add(again)
    s = clock.step()
    assert again.cached_tokens == 4 * BS and s.prefill_tokens == 3
    assert engine.prefix_queries_tokens == 2 * 16 + 2 * 19
    assert engine.prefix_hits_tokens == 12 + 16


# ---- KV events --------------------------------------------------------------------------------


def test_stored_hashes_appear_once_in_order():
    """Full prompt blocks are stored in order as they are computed; a hash already held is not stored twice."""
    engine = _engine(budget=10)
    a = _req("a", (1, 2, 3, 4), prompt=16, output=2)
    b = _req("b", (1, 2, 3, 4), prompt=16, output=2)
    engine.add(a)
    engine.add(b)
    clock = _Clock(engine)
    s1 = clock.step()                       # a: 10 tokens, blocks 0-1 full
    assert s1.stored == [1, 2]
    s2 = clock.step()                       # a: 6 tokens (blocks 2-3); b: hits 3 blocks, computes block 3 itself
    assert s2.stored == [3, 4]
    assert b.cached_tokens == 12
    assert engine.cached_blocks() == 4      # b's copy of block 3 stays un-hashed
    rest = clock.drain()
    assert all(s.stored == [] and s.removed == [] for s in rest)
    assert engine.cached_blocks() == 4 and all(engine.holds(h) for h in (1, 2, 3, 4))


def test_lru_eviction_order_and_restore():
    """Eviction takes least recently freed blocks first, a request's tail before its head; an evicted hash recomputed is stored again."""
    engine = _engine(num_blocks=4)
    clock = _Clock(engine)
    engine.add(_req("r1", (1, 2), prompt=8))          # blocks 0,1; freed tail first: queue = [2 fresh, 3 fresh, (2), (1)]
    s = clock.step()
    assert (s.stored, s.removed) == ([1, 2], [])
    engine.add(_req("r2", (5, 6, 7), prompt=12))      # takes both fresh blocks, then evicts hash 2
    s = clock.step()
    assert (s.stored, s.removed) == ([5, 6, 7], [2])
    assert engine.holds(1) and not engine.holds(2)
    engine.add(_req("r3", (8, 9), prompt=8))          # queue = [(1), (7), (6), (5)]
    s = clock.step()
    assert (s.stored, s.removed) == ([8, 9], [1, 7])
    engine.add(_req("r4", (1, 2), prompt=8))          # queue = [(6), (5), (9), (8)]: no hit, 1 and 2 stored again
    s = clock.step()
    assert (s.stored, s.removed) == ([1, 2], [6, 5])
    assert engine.cached_blocks() == 4
    assert sorted(h for h in range(1, 10) if engine.holds(h)) == [1, 2, 8, 9]


def test_hit_on_a_free_cached_block_protects_it_from_eviction():
    """A free-but-cached block hit by an admission leaves the free queue, so that admission's allocation evicts the next one."""
    engine = _engine(num_blocks=3)
    clock = _Clock(engine)
    engine.add(_req("r1", (1, 2), prompt=8))          # blocks 0,1 used; free queue = [2 fresh, (2), (1)]
    clock.step()
    r2 = _req("r2", (1, 5), prompt=9)                 # hits (1); needs 2 more blocks: fresh 2, then evicts (2)
    engine.add(r2)
    s = clock.step()
    assert r2.cached_tokens == BS
    assert (s.stored, s.removed) == ([5], [2])
    assert engine.holds(1)


# ---- preemption ---------------------------------------------------------------------------------


def test_preemption_when_kv_runs_out():
    """Out of blocks, the latest admitted request is preempted to the front of the queue, re-prefills (with its prefix hit), and all finish."""
    engine = _engine(num_blocks=6, budget=100, max_seqs=2)
    a = _req("a", (21, 22), prompt=8, output=10)
    b = _req("b", (11, 12), prompt=8, output=10)
    c = _req("c", (31,), prompt=5, output=2)
    for r in (a, b, c):
        engine.add(r)
    clock = _Clock(engine)
    s = clock.step()                                  # a, b admitted (2 blocks each); c waits on max_num_seqs
    assert s.first_tokens == [a, b] and engine.num_waiting == 1
    for _ in range(4):                                # contexts 8 -> 12: one more block each, cache full
        s = clock.step()
        assert s.preempted == [] and s.decode_seqs == 2
    assert engine.kv_usage == 1.0
    s = clock.step()                                  # a needs a 4th block: b (admitted last) is preempted
    assert s.preempted == [b]
    assert (s.decode_seqs, s.prefill_tokens) == (1, 0)
    assert (b.num_preemptions, engine.num_preemptions) == (1, 1)
    assert (engine.num_running, engine.num_waiting) == (1, 2)
    assert engine.pending_prefill_tokens == 8 + 5    # b's whole prompt again, and c's
    s = clock.step()                                  # b, at the front, goes before c: hits its first block
    assert s.preempted == [] and b.cached_tokens == BS and c.first_token_s is None
    assert (s.decode_seqs, s.prefill_tokens) == (1, 4)
    assert (s.stored, s.removed) == ([12], [12])     # its second block was evicted by the refill and recomputed
    assert b.first_token_s == 1.0                    # the first token stays the first one
    clock.drain()
    for r in (a, b, c):
        assert r.finished_s is not None and r.first_token_s <= r.finished_s
    assert a.num_preemptions == 0 and c.num_preemptions == 0
    assert engine.num_preemptions == b.num_preemptions >= 1
    assert engine.prefix_queries_tokens == 8 + 8 * (1 + b.num_preemptions) + 5
    assert (engine.kv_usage, engine.pending_prefill_tokens) == (0.0, 0)


def test_add_refuses_a_prompt_larger_than_the_cache():
    """add() raises ValueError naming the request, the blocks its prompt needs and the engine's blocks."""
    engine = _engine(num_blocks=4)
    engine.add(_req("fits", (1, 2, 3, 4), prompt=16))
    with pytest.raises(ValueError, match=r"too-big.*5 KV blocks.*has 4"):
        engine.add(_req("too-big", (1, 2, 3, 4), prompt=17))
    assert engine.num_waiting == 1


# ---- stats and duration -------------------------------------------------------------------------


def test_stats_after_a_few_steps():
    """kv_usage, num_running, num_waiting and pending_prefill_tokens match hand-computed values step by step."""
    engine = _engine(num_blocks=10, budget=8, max_seqs=4)
    a = _req("a", (1, 2), prompt=10, output=3)
    b = _req("b", (3,), prompt=6, output=2)
    engine.add(a)
    engine.add(b)
    stats = lambda: (engine.num_running, engine.num_waiting, engine.kv_usage, engine.pending_prefill_tokens)  # noqa: E731
    assert stats() == (0, 2, 0.0, 16)
    clock = _Clock(engine)
    clock.step()                      # a: 8 tokens, 2 blocks
    assert stats() == (1, 1, pytest.approx(0.2), 2 + 6)
    clock.step()                      # a: 2 tokens (3 blocks), b: 6 tokens (2 blocks)
    assert stats() == (2, 0, pytest.approx(0.5), 0)
    clock.step()                      # both decode; b finishes and frees its 2 blocks
    assert stats() == (1, 0, pytest.approx(0.3), 0)
    clock.step()                      # a finishes
    assert stats() == (0, 0, 0.0, 0)
    assert not engine.has_work()


def test_step_duration_follows_the_profile():
    """duration = base + prefill tokens, decode seqs and KV tokens read (context after the step) at their rates."""
    profile = StepProfile(base_s=0.01, per_prefill_token_s=0.001, per_decode_seq_s=0.002, per_kv_token_read_s=0.0001)
    assert profile.step_time_s(9, 1, 18) == pytest.approx(0.01 + 0.009 + 0.002 + 0.0018)
    engine = _engine(budget=10, profile=profile)
    engine.add(_req("a", (1, 2), prompt=8, output=5))
    s1 = engine.step(0.0)
    assert s1.duration_s == pytest.approx(0.01 + 8 * 0.001 + 8 * 0.0001)
    engine.add(_req("b", (3, 4, 5, 6, 7), prompt=20, output=2))
    s2 = engine.step(s1.duration_s)   # a decodes (context 9), b prefills 9 (context 9)
    assert (s2.prefill_tokens, s2.decode_seqs) == (9, 1)
    assert s2.duration_s == pytest.approx(0.01 + 9 * 0.001 + 1 * 0.002 + (9 + 9) * 0.0001)


def test_an_idle_step_lasts_nothing():
    """An engine with no work steps in 0.0 s with empty lists and reports no work."""
    engine = _engine()
    assert not engine.has_work()
    assert engine.step(5.0) == StepResult(0.0, 0, 0, [], [], [], [], [])


# ---- scale -----------------------------------------------------------------------------------------


def _check_against_a_scan(engine: EngineModel) -> None:
    """Recompute the engine's incremental stats by scanning its private state, and compare."""
    n = engine.limits.num_blocks
    in_use = sum(1 for r in engine._ref if r > 0)
    free = n - engine._next_fresh + len(engine._free)
    assert in_use + free == n
    assert all(engine._ref[b] == 0 for b in engine._free)
    assert engine.kv_usage == pytest.approx(in_use / n)
    assert engine.pending_prefill_tokens == (sum(s.prompt - min(s.computed, s.prompt) for s in engine._running)
                                             + sum(s.prompt for s in engine._waiting))
    assert {b: h for h, b in engine._hash_to_block.items()} == engine._block_hash
    assert engine.cached_blocks() <= n
    for seq in engine._running:
        assert len(seq.blocks) == -(-seq.computed // engine.limits.block_size)
        assert all(engine._ref[b] > 0 for b in seq.blocks)
    assert sum(len(s.blocks) for s in engine._waiting) == 0


def test_many_requests_all_finish_with_bounded_block_work():
    """2,000 seeded requests with shared prefixes all finish, and the blocks touched stay linear in the requests' own blocks."""
    rng = random.Random(1234)
    bs = 16
    engine = _engine(num_blocks=1500, budget=2048, max_seqs=64, block_size=bs)
    families = [[f * 1000 + i for i in range(1, 9)] for f in range(12)]
    reqs = []
    unique = 10**9
    for n in range(2000):
        full = rng.randint(1, 80)
        shared = min(full, rng.randint(0, 8))
        hashes = list(rng.choice(families)[:shared])
        for _ in range(full - shared):
            unique += 1
            hashes.append(unique)
        reqs.append(_req(f"r{n}", tuple(hashes), prompt=full * bs + rng.randint(0, bs - 1),
                         output=rng.randint(1, 40), arrival=n * 0.01))
    clock = _Clock(engine)
    pending = list(reqs)
    steps = removed = 0
    while pending or engine.has_work():
        while pending and pending[0].arrival_s <= clock.now:
            engine.add(pending.pop(0))
        if not engine.has_work():
            clock.now = pending[0].arrival_s
            continue
        removed += len(clock.step().removed)
        steps += 1
        if steps % 25 == 0:
            _check_against_a_scan(engine)
    _check_against_a_scan(engine)
    assert engine.num_preemptions > 0 and removed > 0   # the seed drives eviction and preemption
    assert all(r.finished_s is not None and r.arrival_s <= r.first_token_s <= r.finished_s for r in reqs)
    assert (engine.kv_usage, engine.pending_prefill_tokens, engine.num_running) == (0.0, 0, 0)
    admissions = sum(1 + r.num_preemptions for r in reqs)
    assert engine.prefix_queries_tokens == sum(r.prompt_tokens * (1 + r.num_preemptions) for r in reqs)
    assert engine.prefix_hits_tokens > 0
    # Each admission references or allocates at most the request's blocks once and releases them once.
    bound = sum(2 * -(-(r.prompt_tokens + r.output_tokens) // bs) * (1 + r.num_preemptions) for r in reqs)
    assert engine._blocks_touched <= bound
    assert admissions >= 2000 and steps > 0


def _tier_engine(gpu_blocks: int, cpu_blocks: int, onload_s_per_token: float = 0.0) -> EngineModel:
    limits = EngineLimits(num_blocks=gpu_blocks, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                          cpu_tier_blocks=cpu_blocks, cpu_onload_s_per_token=onload_s_per_token)
    return EngineModel(limits, StepProfile(base_s=0.01, per_prefill_token_s=0.001, per_decode_seq_s=0.0))


def _run_one(engine: EngineModel, request: SimRequest, now_s: float) -> list:
    engine.add(request)
    results = []
    while engine.has_work():
        result = engine.step(now_s)
        results.append(result)
        now_s += result.duration_s
    return results


def test_a_cpu_tier_keeps_what_the_gpu_evicted_and_loads_it_instead_of_a_prefill():
    """Invariant 8: write-through offload, a later request's blocks past its GPU hit loaded, not recomputed."""
    engine = _tier_engine(gpu_blocks=5, cpu_blocks=16, onload_s_per_token=0.0001)
    a = SimRequest("a", 0.0, (1, 2, 3, 4), 17, 1)
    first = _run_one(engine, a, 0.0)
    assert [h for r in first for h in r.cpu_stored] == [1, 2, 3, 4]
    _run_one(engine, SimRequest("b", 1.0, (11, 12, 13, 14), 17, 1), 1.0)  # evicts a's blocks from the GPU
    assert not engine.holds(1) and engine.cpu_cached_blocks() == 8
    again = _run_one(engine, SimRequest("a2", 2.0, (1, 2, 3, 4), 17, 1), 2.0)
    assert again[0].loaded_tokens == 16 and again[0].prefill_tokens == 1
    assert engine.cpu_hits_tokens == 16 and engine.prefix_hits_tokens == 0
    assert again[0].duration_s == pytest.approx(0.01 + 0.001 * 1 + 16 * 0.0001)
    assert set(again[0].stored) == {1, 2, 3, 4}  # loaded blocks are GPU-cached again


def test_the_cpu_tier_evicts_its_least_recently_used_hash_past_its_capacity():
    """The tier is an LRU of cpu_tier_blocks hashes: the oldest leaves (cpu_removed) as new ones come."""
    engine = _tier_engine(gpu_blocks=12, cpu_blocks=4)
    _run_one(engine, SimRequest("a", 0.0, (1, 2, 3, 4), 17, 1), 0.0)
    results = _run_one(engine, SimRequest("b", 1.0, (5, 6), 9, 1), 1.0)
    assert [h for r in results for h in r.cpu_removed] == [1, 2]
    assert engine.cpu_cached_blocks() == 4


def test_without_a_cpu_tier_the_engine_reports_no_tier_events():
    """cpu_tier_blocks 0: no offload, no loads (the model as before the tier)."""
    engine = _tier_engine(gpu_blocks=12, cpu_blocks=0)
    results = _run_one(engine, SimRequest("a", 0.0, (1, 2, 3, 4), 17, 1), 0.0)
    assert all(not r.cpu_stored and not r.loaded_tokens for r in results) and engine.cpu_cached_blocks() == 0
