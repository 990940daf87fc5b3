"""Prefix-aware request routing: pure block hashes, replica snapshots, the prefix index, the policy.

Beside them: replication (hot prefix groups' demand), sessions (multi-turn memory),
rendezvous (hashing every router computes alike) and fleet (routing stats applied as they
arrive). None of these imports Ray. The Ray adapters sit beside them, named `ray_*`:
ray_router (kvtide's `RequestRouter`s, which feed the policy plain values: snapshots,
digests, the clock), ray_baselines and ray_prefix_baseline (Ray's own routers as baselines).
"""
