"""The prefix_aware policy as a chain of small stages (docs/architecture.md, "Routing policy").

    filters        which replicas may take the request, and which side of the load guard each is on
                   (filters.py: the standby filter, the pin, the load guard)
    scorers        what each candidate would cost the request, in prefill-token equivalents
                   (scorers.py: the prefix match by tier and its cost, the queue ahead, the hot
                   group's replication credit, the session's replica)
    picker         the order: guard side, session, cost, then the tie band and rendezvous
                   (picker.py)
    post-response  what a decision leaves behind once the request is sent or served
                   (post_response.py: routing history, group demand, session memory; the
                   prediction the frontend compares with the engine's real cached count)

`deployments.routing.policy.rank_replicas` composes them; each stage is pure (no Ray, no
clock) and tested on its own.
"""
