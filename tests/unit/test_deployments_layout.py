"""deployments/ by role: few top-level modules, a pure routing policy, and imports that only go down."""

from __future__ import annotations

import ast
from pathlib import Path

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"
PREFIX = "kvtide.deployments."

# Each part of deployments/ and the parts it may import. "shared" is the top-level
# non-entry modules; engine and frontend are siblings: neither imports the other.
SHARED = {"messages", "names", "logs", "metric_sampling", "internal_auth", "tenancy"}
ENTRY_POINTS = {"server", "router_peer", "ingress"}
ALLOWED = {
    "shared": {"shared"},
    "routing": {"shared", "routing"},
    "engine": {"shared", "routing", "engine"},
    "frontend": {"shared", "routing", "frontend"},
    "entry": {"shared", "routing", "engine", "frontend"},
}


def _part(dotted: str) -> str:
    """The part of deployments/ a module (dotted, below kvtide.deployments) belongs to."""
    head = dotted.split(".")[0]
    if head in ("routing", "engine", "frontend"):
        return head
    return "entry" if head in ENTRY_POINTS else "shared"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_deployments_has_few_top_level_modules():
    """The top of deployments/ holds only the Serve entry points and the shared boundary modules."""
    top = {p.stem for p in DEPLOYMENTS.glob("*.py")} - {"__init__"}
    assert top == SHARED | ENTRY_POINTS


def test_parts_of_deployments_import_only_downwards():
    """shared ← routing ← engine, frontend ← entry points; no part imports a sibling or one above it."""
    violations = {}
    for path in sorted(DEPLOYMENTS.rglob("*.py")):
        rel = path.relative_to(DEPLOYMENTS).with_suffix("")
        if rel.name == "__init__":
            rel = rel.parent
        part = _part(".".join(rel.parts)) if rel.parts else "entry"
        used = {_part(m[len(PREFIX):]) for m in _imports(path) if m.startswith(PREFIX)}
        if bad := used - ALLOWED[part]:
            violations[str(rel)] = sorted(bad)
    assert violations == {}


def test_the_routing_policy_imports_no_ray():
    """Every routing module but the `ray_*` adapters is pure: no Ray import, so it is tested without Ray."""
    impure = {p.name: sorted(m for m in _imports(p) if m == "ray" or m.startswith("ray."))
              for p in sorted((DEPLOYMENTS / "routing").rglob("*.py")) if not p.name.startswith("ray_")}
    assert {name: mods for name, mods in impure.items() if mods} == {}
