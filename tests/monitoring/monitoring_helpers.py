"""Helpers of the monitoring tests: Prometheus binaries, the chart's rules and dashboards.

A module of its own (not conftest.py): test modules import it by a name no other test folder uses.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
# Debian's prometheus package, unpacked by `make install` (no system install).
PROMETHEUS_BIN = REPO / ".tools" / "prometheus" / "usr" / "bin"
DASHBOARDS_DIR = REPO / "charts" / "rawmm" / "dashboards"
# Grafana's interval variables, replaced the way Grafana would for a short time range and a 1 s scrape.
GRAFANA_INTERVALS = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "5m"}


def tool(name: str) -> Path:
    path = PROMETHEUS_BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: `make install` unpacks Debian's prometheus package there")
    return path


def load_generate() -> ModuleType:
    """manifests/generate.py, which renders the chart."""
    name = "rawmm_chart_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "manifests" / "generate.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is created
        spec.loader.exec_module(module)
    return sys.modules[name]


def rule_groups(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The alert rule groups of the chart's PrometheusRule, rendered with `values`."""
    (rule,) = [d.body for d in load_generate().render_chart(values) if d.kind == "PrometheusRule"]
    return rule["spec"]["groups"]


def write_rules_file(path: Path, groups: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(DASHBOARDS_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every query target of every panel."""
    for panel in panels(dashboard):
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def variable_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(variable name, series selector, label) of every `label_values(selector, label)` variable."""
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
            assert match, f"unsupported variable query {variable['query']['query']!r}"
            yield variable["name"], match[1], match[2]


def as_prometheus_query(expr: str, variables: dict[str, str]) -> str:
    """A dashboard query as Grafana sends it: variables and interval macros substituted."""
    for name, value in {**GRAFANA_INTERVALS, **{f"${k}": v for k, v in variables.items()}}.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


METRIC_NAME = re.compile(r"\b(rawmm_[a-z0-9_]+)")


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))
