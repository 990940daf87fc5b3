"""PromQL text, built only from catalogued names, and read back for the static checks.

Why a module: the dashboards (Grafana variables in their selectors) and the alert rules
(a release's job selector, or none) write the same queries with different base label
matchers. `Selectors` holds that base and is the only way queries name a metric, so a
name outside the catalog fails at build time; `metric_names()` re-reads finished query
text so the committed JSON/YAML is checked too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvtide.dashboards.catalog import Kind, metric

# Series Prometheus makes up itself; queries may use them beside the catalog's.
PROMETHEUS_SYNTHETIC = frozenset({"up"})


@dataclass(frozen=True)
class Selectors:
    """Base label matchers put into every selector, plus how `$model` filtering applies.

    base:  matchers as PromQL text, e.g. 'namespace=~"$namespace",SessionName=~"$cluster"'
           for dashboards, 'KVTIDE_SELECTOR' for the Helm chart's rules, '' for a plain file.
    model: a value/regex for each metric's model label (None: no model filter).
    """

    base: str = ""
    model: str | None = None
    extra: dict[str, str] = field(default_factory=dict)  # label -> regex, on every selector

    def __call__(self, name: str, suffix: str = "", **matchers: str) -> str:
        """`name{base,model,matchers}`: a catalogued family's selector; suffix for _bucket etc."""
        entry = metric(name)
        if suffix and (entry.kind is not Kind.HISTOGRAM or suffix not in ("_bucket", "_sum", "_count")):
            raise ValueError(f"{name} is a {entry.kind.value}: no {suffix} series")
        if not suffix and entry.kind is Kind.HISTOGRAM:
            raise ValueError(f"{name} is a histogram: select _bucket, _sum or _count")
        parts = [self.base] if self.base else []
        if self.model is not None and entry.model_label:
            parts.append(f'{entry.model_label}=~"{self.model}"')
        parts += [f'{label}=~"{value}"' for label, value in self.extra.items() if label in entry.labels]
        parts += [_matcher(label, value) for label, value in matchers.items()]
        return f"{name}{suffix}{{{','.join(parts)}}}" if parts else f"{name}{suffix}"

    def up(self) -> str:
        return f"up{{{self.base}}}" if self.base else "up"


def _matcher(label: str, value: str) -> str:
    # A value with regex metacharacters is a regex match; a plain one an equality.
    return f'{label}=~"{value}"' if re.search(r"[.*+?|()\[\]^$\\]", value) else f'{label}="{value}"'


def quantile(q: float, sel: Selectors, name: str, by: str, window: str) -> str:
    """p-quantile of a catalogued histogram over `window`, aggregated `by` (le is added)."""
    by_le = ", ".join(["le", *[b.strip() for b in by.split(",") if b.strip()]])
    return f"histogram_quantile({q}, sum by ({by_le}) (rate({sel(name, '_bucket')}[{window}])))"


def rate_sum(sel: Selectors, name: str, window: str, by: str = "", **matchers: str) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({sel(name, **matchers)}[{window}]))"


# --- reading query text back -----------------------------------------------------------

_KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w$.])([a-zA-Z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (function names, labels, keywords dropped).

    Grafana's `label_values(metric{...}, label)` is read as a selector of `metric`.
    """
    text = _STRING.sub('""', expr)
    text = _BRACES.sub("", text)
    text = _BRACKETS.sub("", text)
    text = _GROUPING.sub("", text)
    text = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", text)
    names = set()
    for match in _IDENT.finditer(text):
        ident, call = match.group(1), match.group(2)
        if call or ident.lower() in _KEYWORDS or re.fullmatch(r"\d.*", ident):
            continue
        names.add(ident)
    return names


# Values a Grafana variable takes when the test evaluates a panel query on Prometheus itself.
GRAFANA_DEFAULTS = {
    "$__rate_interval": "2m",
    "$__interval": "15s",
    "$__range": "5m",
    "$namespace": ".*",
    "$cluster": ".*",
    "$model": ".*",
    "$replica": ".*",
}


def resolve_grafana_vars(expr: str, values: dict[str, str] | None = None) -> str:
    """`expr` with Grafana's template variables replaced, longest name first."""
    table = {**GRAFANA_DEFAULTS, **(values or {})}
    for var in sorted(table, key=len, reverse=True):
        expr = expr.replace(var, table[var])
    if "$" in expr:
        raise ValueError(f"unresolved Grafana variable in {expr!r}")
    return expr
