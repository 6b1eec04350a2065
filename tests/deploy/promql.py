"""The PromQL the dashboard and the alert rules hold, parsed (promql-parser, the Rust parser's bindings), and the
metric names it reads. Shared by tests/deploy/test_prometheus.py (against the metric definitions) and
tests/integration/test_mesh.py (against a live mesh's /metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import promql_parser
import yaml

from kvmesh import dashboards

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_OWN = {"up"}  # series Prometheus itself writes for every target
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def expressions() -> dict[str, str]:
    """Where each expression is (for messages) -> the expression, Grafana's $__rate_interval made a duration."""
    found = {f"dashboard: {expr[:60]}": expr for expr in dashboards.expressions()}
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            found[f"alert {rule['alert']}"] = rule["expr"]
    return {where: expr.replace("$__rate_interval", "5m") for where, expr in found.items()}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects. Raises ValueError when it is not PromQL."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if type(node).__name__ == "VectorSelector":
            names.add(node.name)
            return
        for attribute in ("expr", "lhs", "rhs", "param", "vector_selector"):
            child = getattr(node, attribute, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for child in getattr(node, "args", None) or ():
            walk(child)

    walk(promql_parser.parse(expr))
    return names


def family(sample_name: str, families: set[str]) -> str | None:
    """The metric family a series name belongs to (a histogram's `_bucket`, a counter's `_total`), if any."""
    if sample_name in families:
        return sample_name
    for suffix in SUFFIXES:
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in families:
            return sample_name[: -len(suffix)]
    return None
