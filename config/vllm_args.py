"""The installed vLLM's engine- and server-argument names, read without importing vLLM.

`engine.extra_args` passes any vLLM engine argument through; a misspelt name must fail when
the config loads, not minutes later inside a replica. Importing vLLM would load torch into
every process that reads a config (the CLI, Serve's controller, the chart's schema build),
so the names are read from the source of `vllm.engine.arg_utils`: the fields of the
`EngineArgs` and `AsyncEngineArgs` dataclasses (and, for `serving.extra_args`, of the OpenAI
server's `FrontendArgs`, wherever the installed vLLM keeps them). Without vLLM installed (a controller-only
environment) there is nothing to check against, and the replica's own start is the check.
"""

from __future__ import annotations

import ast
import importlib.util
import difflib
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping


# Where vLLM versions keep the OpenAI server's FrontendArgs (the newer place first).
_FRONTEND_ARGS_SOURCES = ("entrypoints/launchers/cli_args.py", "entrypoints/openai/cli_args.py")


def _vllm_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # locates the package; runs none of its code
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def engine_arg_names() -> frozenset[str] | None:
    """Field names of the installed vLLM's EngineArgs/AsyncEngineArgs; None when vLLM is not installed."""
    root = _vllm_dir()
    source = root / "engine" / "arg_utils.py" if root else None
    if source is None or not source.is_file():
        return None
    return frozenset(_dataclass_fields(ast.parse(source.read_text()), ("EngineArgs", "AsyncEngineArgs")))


@lru_cache(maxsize=1)
def frontend_arg_names() -> frozenset[str] | None:
    """Field names of the installed vLLM's OpenAI-server FrontendArgs; None when vLLM is not installed."""
    root = _vllm_dir()
    if root is None:
        return None
    for relative in _FRONTEND_ARGS_SOURCES:
        source = root / relative
        if source.is_file():
            return frozenset(_dataclass_fields(ast.parse(source.read_text()), ("BaseFrontendArgs", "FrontendArgs")))
    return None


def _dataclass_fields(module: ast.Module, class_names: tuple[str, ...]) -> set[str]:
    names = set()
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name in class_names:
            for stmt in node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and not stmt.target.id.startswith("_") and "ClassVar" not in ast.unparse(stmt.annotation)):
                    names.add(stmt.target.id)
    return names


def check_extra_args(section: str, names: Iterable[str], exposed: Iterable[str], owned: Mapping[str, str],
                     known: frozenset[str] | None, kind: str) -> None:
    """ValueError for the first of `section`.extra_args' `names` that cannot work, naming the fix:
    a name the section exposes itself, one kvtide sets (`owned`: name → where from), or one the
    installed vLLM does not know (`known`; None: vLLM not installed, nothing to check), e.g.
    kind = "an engine argument of the installed vLLM"."""
    exposed = set(exposed)
    for name in names:
        if name in exposed:
            raise ValueError(f"{section}.extra_args.{name}: kvtide exposes it; set {section}.{name} instead")
        if name in owned:
            raise ValueError(f"{section}.extra_args.{name}: kvtide sets this itself ({owned[name]}); remove it")
        if known is not None and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"{section}.extra_args.{name}: not {kind}{hint}")

