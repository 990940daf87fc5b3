"""Packaging and layering: one `kvtide` import name, and packages that only import downwards."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Each package and the kvtide packages it may import (besides itself). Bottom to top:
# config <- autoscaling <- deployments <- cluster; dashboards and benchmarks beside cluster.
ALLOWED_IMPORTS = {
    "config": set(),
    "autoscaling": {"config"},
    "deployments": {"config", "autoscaling"},
    "dashboards": {"config"},
    "benchmarks": {"config", "deployments", "cluster"},
    "cluster": {"config", "autoscaling", "deployments", "dashboards", "benchmarks"},
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
                   "kvtide/cluster/configs/cpu.yaml", "kvtide/dashboards/generated/alerts.rules.yaml",
                   "kvtide/autoscaling/control_law.py", "kvtide/benchmarks/loadgen.py"):
        assert module in names


def test_the_embedded_default_config_resolves_to_a_file():
    """`kvtide serve` with no --config finds its packaged cpu.yaml through the kvtide namespace."""
    from kvtide.cluster.cli import default_config_path
    from kvtide.config import load_config

    path = Path(default_config_path())
    assert path.is_file() and path.name == "cpu.yaml"
    assert load_config(path).resources.device == "cpu"
