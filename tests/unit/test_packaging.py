"""Packaging and layering: one `kvtide` import name, packages that only import downwards, no import cycle."""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli pip vendors
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]

# The layers, bottom to top; kvtide/__init__.py and docs/architecture.md state the same order.
LAYERS = ("config", "autoscaling", "deployments", "dashboards", "cluster", "benchmarks", "simulator")

# Each package and the kvtide packages it imports (besides itself): only layers below it, and
# only those it does import. Where an upper layer must be reachable from a lower one it is
# found, not imported (the CLI finds `kvtide bench` through the `kvtide.commands` entry points).
ALLOWED_IMPORTS = {
    "config": set(),
    "autoscaling": {"config"},
    "deployments": {"config", "autoscaling"},
    "dashboards": {"config"},
    "cluster": {"config", "autoscaling", "deployments", "dashboards"},
    "benchmarks": {"config", "autoscaling", "deployments", "cluster"},
    "simulator": {"config", "autoscaling", "deployments", "benchmarks"},
}


def _kvtide_imports(path: Path) -> set[str]:
    """Top-level kvtide packages a module imports, lazy (in-function) imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvtide" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED_IMPORTS))
def test_packages_import_only_the_layers_below(package):
    """No upward or sideways import: config imports no other kvtide package, deployments never import cluster."""
    violations = {
        str(path.relative_to(REPO)): sorted(used)
        for path in sorted((REPO / package).rglob("*.py"))
        if (used := _kvtide_imports(path) - ALLOWED_IMPORTS[package] - {package})
    }
    assert violations == {}


def test_the_allowed_imports_follow_the_layer_order():
    """The table covers every layer and allows only imports downwards, so no pair is allowed both ways."""
    assert list(ALLOWED_IMPORTS) == list(LAYERS)
    both_ways = sorted((a, b) for a, allowed in ALLOWED_IMPORTS.items() for b in allowed
                       if a in ALLOWED_IMPORTS.get(b, ()))
    assert both_ways == [], f"allowed in both directions: {both_ways}"
    upward = sorted((a, b) for a, allowed in ALLOWED_IMPORTS.items() for b in allowed
                    if LAYERS.index(b) >= LAYERS.index(a))
    assert upward == [], f"allowed sideways or upwards: {upward}"


def test_the_package_docstring_states_the_layer_order():
    """kvtide/__init__.py states the order this file pins, bottom to top."""
    import kvtide

    assert " <- ".join(LAYERS) in re.sub(r"\s+", " ", kvtide.__doc__)


def _module_files() -> dict[str, Path]:
    """Dotted kvtide.* module name → file, for every .py file in the folders pyproject maps into kvtide."""
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in package_dir.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _import_targets(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvtide modules `name` imports anywhere in its file (module level, in functions, under TYPE_CHECKING).

    `from kvtide.a.b import c` is kvtide.a.b.c where that is a module, else kvtide.a.b (its
    __init__ when a package); a relative import resolves against the module's package.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules}


def _import_graph() -> dict[str, set[str]]:
    modules = _module_files()
    return {name: _import_targets(name, path, modules) for name, path in modules.items()}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycle_through(start: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest import path start → … → start inside one strongly connected component."""
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


def test_no_module_imports_one_that_imports_it_back():
    """The module import graph (lazy imports included) is acyclic: no strongly connected component of two or
    more modules, and no module that imports itself."""
    graph = _import_graph()
    assert "kvtide.cluster.cli" in graph and graph["kvtide.config"]  # the graph did find the modules
    cycles = []
    for members in (c for c in _strongly_connected(graph) if len(c) > 1):
        shown: list[set[str]] = []  # one shortest cycle through each member, each cycle once
        for member in members:
            cycle = _cycle_through(member, set(members), graph)
            if set(cycle) not in shown:
                shown.append(set(cycle))
                cycles.append(" -> ".join(cycle))
    cycles += [f"{name} -> {name}" for name, targets in sorted(graph.items()) if name in targets]
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_the_cycle_check_finds_cycles():
    """The check itself: a three-module circle and a self-import are found, a diamond is not a cycle."""
    circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in _strongly_connected(circle) if len(c) > 1] == [["a", "b", "c"]]
    assert _cycle_through("a", {"a", "b", "c"}, circle) == ["a", "b", "c", "a"]
    diamond = {"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}
    assert all(len(c) == 1 for c in _strongly_connected(diamond))


def test_the_cli_finds_the_bench_commands_through_entry_points():
    """`kvtide bench ...` reaches the CLI through the `kvtide.commands` entry points, not an import."""
    from importlib.metadata import entry_points

    from kvtide.cluster.cli import COMMANDS_GROUP, build_parser

    commands = {"bench": "kvtide.benchmarks.cli:register", "simulate": "kvtide.simulator.cli:register"}
    assert {ep.name: ep.value for ep in entry_points(group=COMMANDS_GROUP)} == commands, \
        "reinstall: pip install --no-deps -e ."
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][COMMANDS_GROUP]
    assert declared == commands
    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert {"serve", "plan", "dashboards", "bench", "simulate"} <= set(subcommands.choices)
    # `kvtide plan --trace` finds its simulator step the same way (autoscaling sits below the simulator).
    planners = {"trace": "kvtide.simulator.plan:plan_on_trace"}
    assert {ep.name: ep.value for ep in entry_points(group="kvtide.planners")} == planners
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["kvtide.planners"] == planners


def test_serve_import_path_does_not_load_vllm():
    """Importing kvtide.cluster.app (Serve's import_path) loads neither vLLM nor torch: the controller stays light."""
    code = ("import sys, kvtide.cluster.app; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_wheel_installs_only_the_kvtide_import_name(tmp_path):
    """A built wheel holds one top-level package, kvtide (plus its dist-info), with every folder mapped in."""
    # Build from a copy: an in-tree build would leave build/ and egg-info in the checkout.
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", "results", "previews"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("kvtide-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"kvtide"}
    for module in ("kvtide/config/model.py", "kvtide/deployments/routing/policy.py", "kvtide/cluster/app.py",
                   "kvtide/config/presets/cpu.yaml", "kvtide/dashboards/generated/alerts.rules.yaml",
                   "kvtide/autoscaling/control_law.py", "kvtide/benchmarks/loadgen.py", "kvtide/simulator/fleet.py",
                   "kvtide/simulator/profiles/llama-8b-h100.json"):
        assert module in names
    # every subpackage of every mapped folder (setuptools' explicit list misses a new one silently)
    mapped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    missing = [f"{package.replace('.', '/')}/{init.parent.relative_to(REPO / folder).as_posix()}/__init__.py"
               .replace("/./", "/") for package, folder in mapped.items() if package != "kvtide"
               for init in (REPO / folder).rglob("__init__.py") if "__pycache__" not in init.parts]
    assert [name for name in missing if name not in names] == []


def test_the_embedded_default_config_resolves_to_a_file():
    """`kvtide serve` with no --config finds its packaged cpu.yaml through the kvtide namespace."""
    from kvtide.config import default_config_path, load_config

    path = Path(default_config_path())
    assert path.is_file() and path.name == "cpu.yaml"
    assert load_config(path).resources.device == "cpu"
