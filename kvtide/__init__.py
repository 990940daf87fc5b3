"""kvtide: an LLM serving cluster on Ray Serve.

The one import name kvtide installs. The repository keeps one top-level folder per idea;
the packaging maps each to a subpackage of `kvtide` (pyproject.toml, [tool.setuptools]):

    config/       -> kvtide.config        the config model (a leaf: imports no other kvtide package)
    deployments/  -> kvtide.deployments   ingress, engine replica, request router
    autoscaling/  -> kvtide.autoscaling   KV control law and its Ray Serve adapter
    dashboards/   -> kvtide.dashboards    metrics catalog, dashboards and alerts as code
    benchmarks/   -> kvtide.benchmarks    load generator, workloads, comparisons
    cluster/      -> kvtide.cluster       the top: app builder, CLI, local bootstrap

Layering, bottom to top: config <- deployments, autoscaling <- cluster; dashboards and
benchmarks sit beside cluster. A unit test pins it.
"""

__version__ = "0.1.0"
