"""values.schema.json is the committed output of helm/generate_schema.py, and values.yaml documents it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import jsonschema
import yaml
from pydantic import BaseModel

from kvtide.config import KvtideConfig
from kvtide.config.model import RENAMED_SECTIONS
from helm.generate_schema import REGENERATE_HINT, SCHEMA_PATH, build_schema, render

REPO_ROOT = Path(__file__).resolve().parents[2]
VALUES_PATH = REPO_ROOT / "helm" / "kvtide" / "values.yaml"


def test_committed_schema_matches_the_generator() -> None:
    """The committed values.schema.json equals a fresh generation (rerun the generator after model changes)."""
    committed = SCHEMA_PATH.read_text()
    fresh = render(build_schema())
    assert committed == fresh, f"{SCHEMA_PATH} is stale: run `{REGENERATE_HINT}` and commit the result"


def test_generator_check_mode_runs_as_a_script() -> None:
    """`python helm/generate_schema.py --check` works from a plain checkout and passes when in sync."""
    result = subprocess.run(
        [sys.executable, "helm/generate_schema.py", "--check"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_schema_is_self_contained() -> None:
    """No $ref/$defs remain: the kvtide subtree is inlined so any validator resolves it."""
    text = SCHEMA_PATH.read_text()
    assert "$ref" not in text and "$defs" not in text


def test_schema_accepts_the_chart_defaults() -> None:
    """values.yaml validates against values.schema.json (Draft 2020-12, as Helm 4 reads it)."""
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(VALUES_PATH.read_text()))


def test_schema_kvtide_subtree_follows_the_model() -> None:
    """Every KvtideConfig section (plus the old names of renamed ones) and enum is in the schema, closed to unknown keys."""
    kvtide = json.loads(SCHEMA_PATH.read_text())["properties"]["kvtide"]
    assert kvtide["additionalProperties"] is False
    assert set(kvtide["properties"]) == set(KvtideConfig.model_fields) | set(RENAMED_SECTIONS)
    policy = kvtide["properties"]["routing"]["properties"]["policy"]
    # pydantic writes a one-value Literal as `const`, several as `enum`.
    assert policy.get("enum", [policy.get("const")]) == ["prefix_aware", "pow2", "round_robin", "ray_prefix"]


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaf_fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_values_yaml_documents_every_config_field() -> None:
    """Each KvtideConfig field is in values.yaml's kvtide section (set or commented) under a comment."""
    text = VALUES_PATH.read_text()
    section = text[text.index("\nkvtide:\n") : text.index("\nupgradeStrategy:")]
    lines = section.splitlines()
    missing = []
    for dotted in _leaf_fields(KvtideConfig):
        name = dotted.rsplit(".", 1)[-1]
        pattern = re.compile(rf"^\s*(# )?{name}:")
        hits = [i for i, line in enumerate(lines) if pattern.match(line)]
        if not hits or not any(lines[i - 1].lstrip().startswith("#") for i in hits):
            missing.append(dotted)
    assert not missing, f"document these kvtide fields in {VALUES_PATH} (a `# --` comment above each): {missing}"


def test_values_yaml_documents_every_top_level_key() -> None:
    """Each top-level key of values.yaml has a comment right above it."""
    lines = VALUES_PATH.read_text().splitlines()
    undocumented = [
        line.split(":")[0]
        for i, line in enumerate(lines)
        if re.match(r"^[A-Za-z]\w*:", line) and not lines[i - 1].startswith("#")
    ]
    assert not undocumented, undocumented
