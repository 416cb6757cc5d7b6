"""The metric names a PromQL expression reads, and the names Freight's /metrics defines: what the
alert rules' and dashboards' tests compare. A small lexer, not a PromQL parser: it drops strings,
label matchers, range and offset durations and Grafana's ``$variables``, then keeps the
identifiers that are neither a function call, a keyword nor a label list's names."""

from __future__ import annotations

import re
from dataclasses import fields

from api.budget_metrics import budget_families
from api.metrics import dependency_family, families, operations_families
from api.services.monitoring import MetricsSnapshot
from api.services.operations_metrics import OperationsSnapshot

KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}
)
_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_VARIABLES = re.compile(r"\$\{?\w+\}?")
_IDENT = re.compile(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    text = _VARIABLES.sub("1", _STRINGS.sub('""', expr))
    text = _LABEL_LISTS.sub(" ", _MATCHERS.sub(" ", text))
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.groups()
        if not call and name not in KEYWORDS and not re.fullmatch(r"\d+\w*", name):
            names.add(name)
    return names


def defined_metrics() -> set[str]:
    """Every sample name /metrics can serve, from its family definitions (empty snapshots)."""
    snap = MetricsSnapshot(**{f.name: {} for f in fields(MetricsSnapshot)})
    ops = OperationsSnapshot(**{f.name: {} for f in fields(OperationsSnapshot)})
    metrics = [*families(snap), *operations_families(ops), dependency_family({}), *budget_families([])]
    return {
        m.name + ("_total" if m.type == "counter" and not m.name.endswith("_total") else "") for m in metrics
    }
