"""A vLLM-v1-like model of one engine: scheduler and KV cache manager, stepped by an outside event loop.

The fleet simulator holds one EngineModel per replica and calls `step(now_s)` on an engine that
has work; the step lasts `duration_s` (StepProfile) and its StepResult carries what the router and
the autoscaler see of a real engine: first tokens, finished requests, KV events (`stored` /
`removed` block hashes, as vLLM's KV events publisher sends them) and preemptions. The stats
(`num_running`, `kv_usage`, `pending_prefill_tokens`, ...) are the ones a replica reports.

Standard library only. The work of a step is proportional to the requests it schedules plus the
blocks it allocates, references and frees; nothing scans the whole cache or the whole queue.

Invariants (vLLM v1 scheduler + KV cache manager, simplified):

1. Step schedule. The token budget is max_num_batched_tokens. First every RUNNING request, in
   admission order, while budget remains: one still prefilling gets min(remaining prompt tokens,
   budget) tokens (chunked prefill); one decoding gets 1 token. Then WAITING requests in FIFO
   order while budget > 0 and fewer than max_num_seqs run: an admitted request becomes running
   (at the back of the running order) and gets min(remaining prompt tokens, budget). A request
   whose prompt becomes fully computed in a step produces an output token in that step (its first
   one: first_token_s = step end); a decoding request produces one token per step it is scheduled
   in. A request finishes once it has produced output_tokens tokens (finished_s = step end); its
   blocks are freed at the end of the step.
   - A waiting request is admitted only if the free queue can supply the blocks of its first
     chunk (after taking its prefix hits out of it); otherwise admission stops for this step (no
     preemption is made for a waiting request: vLLM's allocate_slots returning None).
   - As in vLLM, a step that preempted anything admits no waiting request.
2. Prefix cache hit, decided at each admission (the first one and each re-admission after a
   preemption): the longest run of the request's block_hashes, from the first, that the cache
   holds (in use by other requests or free-but-cached), never covering the prompt's last token:
   at most (prompt_tokens - 1) // block_size blocks. cached_tokens = hit blocks * block_size
   (overwritten at each admission). prefix_queries_tokens += prompt_tokens and
   prefix_hits_tokens += cached_tokens at each admission. Hit blocks are referenced by the request
   (ref count + 1; a free cached block leaves the free queue). Computed tokens start at
   cached_tokens.
3. Blocks. A request holds ceil(computed_tokens / block_size) blocks, allocated as its tokens are
   scheduled (prompt chunks; and one slot per decode token: a new block when the context crosses a
   block boundary). Allocation takes from the FRONT of the free queue (least recently freed
   first); a block taken that still holds a hash evicts it: the hash leaves the map and is appended
   to the step's `removed`. When a prompt block becomes fully computed and block_hashes has an
   entry for its index, the block gets that hash unless the map already holds the hash (then the
   block stays un-hashed: no duplicates, as in vLLM); a newly mapped hash is appended to `stored`.
   Simplification: decode blocks and the prompt's final partial block never get a hash (kvtide's
   router only matches prompt blocks).
4. Free order. When a request finishes or is preempted its blocks' ref counts drop; each block
   reaching 0 goes to the BACK of the free queue, the request's blocks taken in REVERSE order (tail
   first, so a shared prefix's head blocks are evicted last). Never-used blocks sit at the front of
   the free queue from the start (num_blocks of them, no hash; kept as a counter, not a list).
5. Preemption (recompute mode). When a running request needs more blocks for this step than the
   free queue holds, the most recently admitted running request is preempted (possibly the
   request itself, which is then not scheduled in this step), until enough blocks are free: its
   blocks are released as in 4, its computed tokens reset to 0, num_preemptions is incremented on
   it and on the engine, it goes to the FRONT of the waiting queue and into `preempted`.
   Simplification: the tokens it already produced stay produced (its remaining output count is
   unchanged) and on re-admission it prefills its prompt only (not prompt + generated tokens);
   completing that prefill produces its next output token (first_token_s is not set again). The
   victim is always at or after the request being scheduled in the running order, so a request
   already scheduled in this step is never preempted. add() refuses (ValueError) a request whose
   prompt alone needs more blocks than the engine has.
6. Duration = profile.step_time_s(prefill tokens scheduled, decode sequences scheduled, sum over
   scheduled sequences of their context length after the step). A step that schedules nothing
   lasts 0.0 and (save `preempted` in a step whose only running request preempted itself) returns
   empty lists. has_work() is False only with nothing running or waiting.
7. Stats are kept incrementally: kv_usage = blocks with ref count > 0 / num_blocks (only running
   requests hold references), pending_prefill_tokens = uncomputed prompt tokens of running
   requests + full prompts of waiting ones (a preempted request counts its whole prompt again).
8. CPU tier (limits.cpu_tier_blocks > 0; vLLM's KV offloading). Every hash a block newly gets on GPU is
   also stored in the tier (write-through, as the offloading connector stores what the engine computes),
   an LRU of cpu_tier_blocks hashes: a new one goes to its back (`cpu_stored`), the front is evicted past
   the capacity (`cpu_removed`). At admission, after the GPU hit, the longest run of the following
   block_hashes the tier holds (within the same cap) is loaded: those blocks are allocated on GPU like
   computed ones and get their hashes (`stored`), count as cached (cached_tokens includes them, as vLLM's
   computed tokens include a connector's), and add cpu_onload_s_per_token per token to the step's duration.
   Simplification: vLLM loads asynchronously while other requests step; here the load stalls the step.
   Stores and admissions (GPU hits and loads alike, as the connector touches a request's blocks) move a
   hash to the tier's back. prefix_hits_tokens counts GPU hits only;
   cpu_hits_tokens the loaded tokens.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepProfile:
    """Seconds one engine step takes: base_s + per_prefill_token_s * prefill tokens scheduled
    + per_decode_seq_s * decode sequences scheduled + per_kv_token_read_s * KV tokens read (the context
    length of every scheduled sequence, prefill chunks counted at their end position)."""

    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_read_s: float = 0.0

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        return (self.base_s + self.per_prefill_token_s * prefill_tokens
                + self.per_decode_seq_s * decode_seqs + self.per_kv_token_read_s * kv_tokens_read)


@dataclass(frozen=True)
class EngineLimits:
    """One engine's capacity: its KV blocks (GPU), tokens per block, and the scheduler's per-step caps."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    cpu_tier_blocks: int = 0  # host-memory blocks of the CPU KV tier (0: none)
    cpu_onload_s_per_token: float = 0.0  # seconds to load one token's KV from the tier (host link)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.cpu_tier_blocks < 0 or self.cpu_onload_s_per_token < 0:
            raise ValueError("EngineLimits.cpu_tier_blocks and cpu_onload_s_per_token must be >= 0")


@dataclass
class SimRequest:
    """One request as the engine sees it; the engine fills in the fields after output_tokens."""

    request_id: str
    arrival_s: float
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0


@dataclass
class StepResult:
    """What one step did: its duration, what it scheduled, and the events it produced."""

    duration_s: float
    prefill_tokens: int
    decode_seqs: int
    first_tokens: list[SimRequest]
    finished: list[SimRequest]
    stored: list[int]
    removed: list[int]
    preempted: list[SimRequest]
    cpu_stored: list[int] = field(default_factory=list)  # hashes entering the CPU tier
    cpu_removed: list[int] = field(default_factory=list)  # hashes the CPU tier evicted
    loaded_tokens: int = 0  # tokens loaded from the CPU tier in this step


class _Seq:
    """The engine's private state of one request."""

    __slots__ = ("req", "prompt", "hashes", "output", "blocks", "computed", "produced")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.prompt = req.prompt_tokens
        self.hashes = req.block_hashes
        self.output = req.output_tokens
        self.blocks: list[int] = []
        self.computed = 0   # tokens whose KV is computed (prompt, then one per decode step)
        self.produced = 0   # output tokens produced so far (kept across preemptions)


class EngineModel:
    """One engine: a FIFO scheduler with chunked prefill over a prefix-cached, LRU-evicted KV block pool."""

    __slots__ = ("_limits", "_profile", "_bs", "_num_blocks", "_max_tokens", "_max_seqs",
                 "_ref", "_block_hash", "_hash_to_block", "_free", "_next_fresh",
                 "_running", "_waiting", "_pending_prefill", "_queries", "_hits", "_preemptions",
                 "_blocks_touched", "_cpu", "_cpu_hits", "_cpu_stored", "_cpu_removed")

    def __init__(self, limits: EngineLimits, profile: StepProfile) -> None:
        self._limits = limits
        self._profile = profile
        self._bs = limits.block_size
        self._num_blocks = limits.num_blocks
        self._max_tokens = limits.max_num_batched_tokens
        self._max_seqs = limits.max_num_seqs
        self._ref = [0] * limits.num_blocks          # block id -> ref count
        self._block_hash: dict[int, int] = {}         # block id -> hash, hashed blocks only
        self._hash_to_block: dict[int, int] = {}      # hash -> block id
        # Free queue: never-used blocks [_next_fresh, num_blocks) come first (they were queued before
        # any block was freed), then _free, least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._next_fresh = 0
        self._running: list[_Seq] = []                # admission order
        self._waiting: deque[_Seq] = deque()
        self._pending_prefill = 0
        self._queries = 0
        self._hits = 0
        self._preemptions = 0
        self._blocks_touched = 0   # cumulative blocks allocated, hit-referenced and released (tests bound it)
        # The CPU tier: hash → None, least recently stored or hit first (invariant 8); None: no tier.
        self._cpu: OrderedDict[int, None] | None = OrderedDict() if limits.cpu_tier_blocks else None
        self._cpu_hits = 0
        self._cpu_stored: list[int] = []
        self._cpu_removed: list[int] = []

    # ---- stats (O(1)) -------------------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def profile(self) -> StepProfile:
        return self._profile

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self._free_count() / self._num_blocks

    @property
    def pending_prefill_tokens(self) -> int:
        return self._pending_prefill

    @property
    def prefix_queries_tokens(self) -> int:
        return self._queries

    @property
    def prefix_hits_tokens(self) -> int:
        return self._hits

    @property
    def num_preemptions(self) -> int:
        return self._preemptions

    @property
    def cpu_hits_tokens(self) -> int:
        return self._cpu_hits

    def cpu_cached_blocks(self) -> int:
        """Hashes the CPU tier holds (0 without one)."""
        return len(self._cpu) if self._cpu is not None else 0

    def cached_blocks(self) -> int:
        """Blocks currently holding a hash (in use or free-but-cached)."""
        return len(self._hash_to_block)

    def holds(self, block_hash: int) -> bool:
        """Whether some block (in use or free-but-cached) holds this hash."""
        return block_hash in self._hash_to_block

    def has_work(self) -> bool:
        """Any request running or waiting."""
        return bool(self._running) or bool(self._waiting)

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request: SimRequest) -> None:
        """Enqueue a request at the back of the waiting queue."""
        bs = self._bs
        if request.output_tokens < 1:
            raise ValueError(f"request {request.request_id}: output_tokens must be >= 1, "
                             f"got {request.output_tokens}")
        if request.prompt_tokens < max(1, len(request.block_hashes) * bs):
            raise ValueError(f"request {request.request_id}: prompt_tokens {request.prompt_tokens} is "
                             f"fewer than its {len(request.block_hashes)} full blocks of {bs} tokens")
        needed = -(-request.prompt_tokens // bs)
        if needed > self._num_blocks:
            raise ValueError(f"request {request.request_id}: its prompt needs {needed} KV blocks "
                             f"({request.prompt_tokens} tokens) but the engine has {self._num_blocks}")
        self._waiting.append(_Seq(request))
        self._pending_prefill += request.prompt_tokens

    # ---- one step -------------------------------------------------------------------------------

    def step(self, now_s: float, slowdown: float = 1.0) -> StepResult:
        """Schedule one step starting at now_s; it ends at now_s + duration_s.

        `slowdown` multiplies the profile's duration: the share of a GPU this engine gets while
        others on the same GPU step too (the fleet decides it; 1.0 alone)."""
        bs = self._bs
        budget = self._max_tokens
        running = self._running
        hash_to_block = self._hash_to_block
        prefill_tokens = 0
        decode_seqs = 0
        kv_read = 0
        first: list[SimRequest] = []
        done: list[_Seq] = []
        stored: list[int] = []
        removed: list[int] = []
        preempted: list[SimRequest] = []
        self._cpu_stored, self._cpu_removed = [], []
        cpu = self._cpu
        loaded_tokens = 0

        # Running requests, in admission order.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            c = seq.computed
            prompt = seq.prompt
            n = prompt - c if c < prompt else 1
            if n > budget:
                n = budget
            new_c = c + n
            need = -(-new_c // bs) - len(seq.blocks)
            if need > 0:
                scheduled = True
                while self._free_count() < need:
                    victim = running.pop()
                    self._preempt(victim, preempted)
                    if victim is seq:
                        scheduled = False
                        break
                if not scheduled:
                    break
                self._allocate(need, seq.blocks, removed)
            seq.computed = new_c
            budget -= n
            kv_read += new_c
            if c < prompt:
                prefill_tokens += n
                self._pending_prefill -= n
                if seq.hashes:
                    self._hash_full_blocks(seq, c, new_c, stored)
                if new_c < prompt:
                    i += 1
                    continue
            else:
                decode_seqs += 1
            seq.produced += 1
            if seq.req.first_token_s is None:
                first.append(seq.req)
            if seq.produced >= seq.output:
                done.append(seq)
            i += 1

        # Waiting requests, FIFO; none in a step that preempted (as vLLM).
        if not preempted:
            waiting = self._waiting
            ref = self._ref
            max_seqs = self._max_seqs
            while waiting and budget > 0 and len(running) < max_seqs:
                seq = waiting[0]
                prompt = seq.prompt
                hashes = seq.hashes
                cap = (prompt - 1) // bs
                if cap > len(hashes):
                    cap = len(hashes)
                hit_blocks: list[int] = []
                free_hits = 0
                for j in range(cap):
                    b = hash_to_block.get(hashes[j])
                    if b is None:
                        break
                    if ref[b] == 0:
                        free_hits += 1
                    hit_blocks.append(b)
                gpu_cached = len(hit_blocks) * bs
                loaded = 0
                if cpu is not None:
                    j = len(hit_blocks)
                    while j < cap and hashes[j] in cpu:
                        j += 1
                    loaded = (j - len(hit_blocks)) * bs
                cached = gpu_cached + loaded
                n = prompt - cached
                if n > budget:
                    n = budget
                new_c = cached + n
                need = -(-new_c // bs) - len(hit_blocks)
                if need > self._free_count() - free_hits:
                    break   # its first chunk does not fit: admission stops for this step
                waiting.popleft()
                free = self._free
                for b in hit_blocks:
                    if ref[b] == 0:
                        del free[b]
                    ref[b] += 1
                self._blocks_touched += len(hit_blocks)
                seq.blocks = hit_blocks
                if need > 0:
                    self._allocate(need, hit_blocks, removed)
                req = seq.req
                req.cached_tokens = cached
                self._queries += prompt
                self._hits += gpu_cached
                if cpu is not None:
                    self._cpu_hits += loaded
                    loaded_tokens += loaded
                    for h in hashes[:len(hit_blocks) + loaded // bs]:  # the connector touches what it holds
                        if h in cpu:
                            cpu.move_to_end(h)
                self._pending_prefill -= cached + n
                seq.computed = new_c
                running.append(seq)
                budget -= n
                kv_read += new_c
                prefill_tokens += n
                if hashes:
                    self._hash_full_blocks(seq, gpu_cached, new_c, stored)
                if new_c == prompt:
                    seq.produced += 1
                    if req.first_token_s is None:
                        first.append(req)
                    if seq.produced >= seq.output:
                        done.append(seq)

        if prefill_tokens == 0 and decode_seqs == 0:
            return StepResult(0.0, 0, 0, [], [], stored, removed, preempted, self._cpu_stored, self._cpu_removed)
        duration = self._profile.step_time_s(prefill_tokens, decode_seqs, kv_read) * slowdown
        duration += loaded_tokens * self._limits.cpu_onload_s_per_token
        end = now_s + duration
        for req in first:
            req.first_token_s = end
        if done:
            for seq in done:
                seq.req.finished_s = end
                self._release(seq)
            self._running = [s for s in running if s.produced < s.output]
        return StepResult(duration, prefill_tokens, decode_seqs, first, [s.req for s in done],
                          stored, removed, preempted, self._cpu_stored, self._cpu_removed, loaded_tokens)

    # ---- blocks ---------------------------------------------------------------------------------

    def _free_count(self) -> int:
        return self._num_blocks - self._next_fresh + len(self._free)

    def _allocate(self, count: int, out: list[int], removed: list[int]) -> None:
        """Take `count` blocks from the front of the free queue into `out`, evicting their hashes."""
        ref = self._ref
        for _ in range(count):
            if self._next_fresh < self._num_blocks:
                b = self._next_fresh
                self._next_fresh = b + 1
            else:
                b, _unused = self._free.popitem(last=False)
                h = self._block_hash.pop(b, None)
                if h is not None:
                    del self._hash_to_block[h]
                    removed.append(h)
            ref[b] = 1
            out.append(b)
        self._blocks_touched += count

    def _hash_full_blocks(self, seq: _Seq, old_computed: int, new_computed: int, stored: list[int]) -> None:
        """Give a hash to each prompt block that became full between old_computed and new_computed."""
        bs = self._bs
        lo = old_computed // bs
        hi = (new_computed if new_computed < seq.prompt else seq.prompt) // bs
        if hi > len(seq.hashes):
            hi = len(seq.hashes)
        hash_to_block = self._hash_to_block
        for idx in range(lo, hi):
            h = seq.hashes[idx]
            if h not in hash_to_block:
                b = seq.blocks[idx]
                hash_to_block[h] = b
                self._block_hash[b] = h
                stored.append(h)
                if self._cpu is not None:
                    self._offload(h)

    def _offload(self, h: int) -> None:
        """Write-through to the CPU tier (invariant 8): `h` at the LRU's back, the front evicted past capacity."""
        cpu = self._cpu
        if h in cpu:
            cpu.move_to_end(h)
            return
        cpu[h] = None
        self._cpu_stored.append(h)
        if len(cpu) > self._limits.cpu_tier_blocks:
            self._cpu_removed.append(cpu.popitem(last=False)[0])

    def _release(self, seq: _Seq) -> None:
        """Drop the request's references, tail blocks first; blocks reaching 0 join the back of the free queue."""
        ref = self._ref
        free = self._free
        blocks = seq.blocks
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                free[b] = None
        self._blocks_touched += len(blocks)
        seq.blocks = []

    def _preempt(self, seq: _Seq, preempted: list[SimRequest]) -> None:
        """Recompute-mode preemption: free its blocks, forget its computed tokens, requeue it at the front."""
        self._release(seq)
        self._pending_prefill += seq.computed if seq.computed < seq.prompt else seq.prompt
        seq.computed = 0
        seq.req.num_preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(seq)
        preempted.append(seq.req)
