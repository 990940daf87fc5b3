"""Prefix-aware request routing, pure: block hashes, replica snapshots, the prefix index, the policy.

Beside them: replication (hot prefix groups' demand), sessions (multi-turn memory),
rendezvous (hashing every router computes alike) and fleet (routing stats applied as they
arrive). No Ray import anywhere in this package: the Ray Serve `RequestRouter` adapter
lives outside it and feeds it plain values (snapshots, digests, the clock).
"""
