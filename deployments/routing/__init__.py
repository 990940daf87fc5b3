"""Prefix-aware request routing, pure: block hashes, replica snapshots, the prefix index, the policy.

No Ray import anywhere in this package: the Ray Serve `RequestRouter` adapter lives
outside it and feeds it plain values (snapshots, digests, the clock).
"""
