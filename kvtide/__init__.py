"""kvtide: an LLM serving cluster on Ray Serve.

The one import name kvtide installs. The repository keeps one top-level folder per idea;
the packaging maps each to a subpackage of `kvtide` (pyproject.toml, [tool.setuptools]):

    config/       -> kvtide.config        the config model and its presets (presets/*.yaml)
    autoscaling/  -> kvtide.autoscaling   KV control law, its Ray Serve adapter, warm start, capacity
    deployments/  -> kvtide.deployments   the Ray Serve deployments, by role: frontend/ (the OpenAI
                                          API), engine/ (the vLLM replica), routing/ (the policy and
                                          its Ray adapters), and thin Serve entry points (server.py,
                                          ingress.py, router_peer.py)
    dashboards/   -> kvtide.dashboards    metric catalog, dashboards and alerts as code
    cluster/      -> kvtide.cluster       app builder, CLI, local bootstrap, serve-config
    benchmarks/   -> kvtide.benchmarks    load generator, workloads, comparisons (drives local clusters)
    simulator/    -> kvtide.simulator     trace-driven fleet simulation on kvtide's own router code

Layering, bottom to top: config <- autoscaling <- deployments <- dashboards <- cluster <- benchmarks
<- simulator.
A package imports only packages below it, and no module imports one that imports it back;
the CLI finds the `kvtide bench` and `kvtide simulate` commands through the `kvtide.commands` entry
points rather than importing them. tests/unit/test_packaging.py pins all three.
"""

__version__ = "0.1.0"
