"""Ray Serve deployments: the OpenAI frontend, the engine replica, the request routing.

    deployments/
      server.py        direct mode (default): EngineServer, an engine replica serving the OpenAI API
      router_peer.py   direct mode: RouterPeer, which HAProxy asks which replica takes each POST
      ingress.py       ingress mode: Ingress replicas in front of the engines (Ray handles)
      messages.py      what crosses frontend → engine (GenerateRequest, GenerateDelta, RoutingKey)
      names.py, logs.py, metric_sampling.py    deployment names, replica loggers, sampled histograms
      internal_auth.py the cluster secret: HAProxy's consult token, the routing headers' signature
      tenancy.py       tenants by API key: ids, stored responses and cache salts scoped to each
      frontend/        the OpenAI app and request pipeline: validation, prompts, SSE, auth,
                       admission, frontend metrics, the engine client, hot prefixes, routing_key
      engine/          the vLLM engine replica: its engine resolved as `vllm serve` resolves it,
                       vLLM's own OpenAI app on it, load stats, KV events → cache digest,
                       pending prefill, standby roles, stored-response ids, placement, core
                       claims and pinning, start phases, the demo model
      routing/         the prefix-aware policy (pure: no Ray) and its Ray adapters (ray_*.py)

Imports go down only, and a unit test (tests/unit/test_deployments_layout.py) pins it:
the shared modules ← routing ← engine, frontend (siblings: neither imports the other) ←
the three Serve entry points. The entry points only wire parts together.
"""
