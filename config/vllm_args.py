"""The installed vLLM's engine-argument names, read without importing vLLM.

`engine.extra_args` passes any vLLM engine argument through; a misspelt name must fail when
the config loads, not minutes later inside a replica. Importing vLLM would load torch into
every process that reads a config (the CLI, Serve's controller, the chart's schema build),
so the names are read from the source of `vllm.engine.arg_utils`: the fields of the
`EngineArgs` and `AsyncEngineArgs` dataclasses. Without vLLM installed (a controller-only
environment) there is nothing to check against, and the replica's own start is the check.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def engine_arg_names() -> frozenset[str] | None:
    """Field names of the installed vLLM's EngineArgs/AsyncEngineArgs; None when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")  # locates the package; runs none of its code
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    if not source.is_file():
        return None
    return frozenset(_dataclass_fields(ast.parse(source.read_text()), ("EngineArgs", "AsyncEngineArgs")))


def _dataclass_fields(module: ast.Module, class_names: tuple[str, ...]) -> set[str]:
    names = set()
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name in class_names:
            for stmt in node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and not stmt.target.id.startswith("_") and "ClassVar" not in ast.unparse(stmt.annotation)):
                    names.add(stmt.target.id)
    return names
