"""The Grafana dashboards, statically: a datasource variable and no hard-coded datasource UIDs, queries on
metric names the code really exports, counters only through rate(), and the panels the issue asks for.
(tests/monitoring/test_live_prometheus.py runs every query against a live Prometheus.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from monitoring_helpers import dashboards, metric_names, panel_queries, panels, rule_groups, variable_queries

DASHBOARDS = dashboards()


def exported_metric_names() -> set[str]:
    """Every sample name the code's metric objects export (counters as `_total`, histograms as
    `_bucket`/`_sum`/`_count`), read from the objects themselves."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from rawmm.materialize import metrics as materialize_metrics
    from rawmm.rl.orchestrator.metrics import OrchestratorMetrics
    from rawmm.rl.retention import metrics as retention_metrics
    from rawmm.rl.trainer import metrics as trainer_metrics
    from rawmm.serving import metrics as engine_metrics
    from rawmm_operator import metrics as operator_metrics

    owners = (
        materialize_metrics,
        engine_metrics,
        trainer_metrics,
        retention_metrics,
        operator_metrics,
        OrchestratorMetrics(CollectorRegistry()),
    )
    collectors = [
        value for owner in owners for value in vars(owner).values() if isinstance(value, MetricWrapperBase)
    ]
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for collector in collectors:
        for family in collector.describe():
            names |= {family.name + suffix for suffix in suffixes[family.type]}
    return names


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_datasource_is_a_variable_never_a_hard_coded_uid(name: str) -> None:
    dashboard = DASHBOARDS[name]
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    references = [value for key, value in _walk(dashboard) if key == "datasource"]
    assert references
    assert all(ref == {"type": "prometheus", "uid": "${datasource}"} for ref in references), references
    uids = [value for key, value in _walk(dashboard) if key == "uid"]
    assert set(uids) == {dashboard["uid"], "${datasource}"}


def test_dashboards_have_distinct_uids_and_panel_layouts_fit_the_grid() -> None:
    assert len({d["uid"] for d in DASHBOARDS.values()}) == len(DASHBOARDS)
    for dashboard in DASHBOARDS.values():
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        cells: set[tuple[int, int]] = set()
        for panel in dashboard["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24
            area = {
                (x, y)
                for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])
            }
            assert not cells & area, f"{panel['title']} overlaps another panel"
            cells |= area


def test_every_query_uses_metric_names_the_code_exports() -> None:
    exported = exported_metric_names()
    used = {
        (name, metric)
        for name, dashboard in DASHBOARDS.items()
        for _, expr in panel_queries(dashboard)
        for metric in metric_names(expr)
    }
    used |= {
        (name, metric)
        for name, dashboard in DASHBOARDS.items()
        for _, selector, _ in variable_queries(dashboard)
        for metric in metric_names(selector)
    }
    used |= {
        ("alerts", metric)
        for group in rule_groups()
        for rule in group["rules"]
        for metric in metric_names(rule["expr"])
    }
    unknown = sorted((where, metric) for where, metric in used if metric not in exported)
    assert not unknown, unknown


def test_counters_and_histograms_appear_only_inside_rate() -> None:
    # A cumulative counter plotted raw says nothing about now; the hit rate must come from rate()s.
    cumulative = re.compile(r"(rawmm_[a-z0-9_]+_(?:total|bucket|sum|count))\b")
    for name, dashboard in DASHBOARDS.items():
        for title, expr in panel_queries(dashboard):
            for match in cumulative.finditer(expr):
                assert re.search(r"rate\(\s*$", expr[: match.start()]), (
                    f"{name}/{title}: {match[1]} outside rate()"
                )


def test_each_panel_has_a_title_a_description_and_queries() -> None:
    for dashboard in DASHBOARDS.values():
        for panel in panels(dashboard):
            assert panel["title"] and panel["description"] and panel["targets"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


REQUIRED_METRICS = {
    "materialization": {
        "rawmm_materialize_cache_hits_total",
        "rawmm_materialize_cache_misses_total",
        "rawmm_materialize_cache_inflight_joins_total",
        "rawmm_materialize_cache_evictions_total",
        "rawmm_materialize_cache_bytes",
        "rawmm_materialize_cache_capacity_bytes",
        "rawmm_materialize_seconds_bucket",
        "rawmm_invalid_mm_image_ref_total",
        "rawmm_images_materialized_total",
    },
    "rl-run": {
        "rawmm_trainer_step",
        "rawmm_reward_mean",
        "rawmm_trainer_loss",
        "rawmm_rollouts_total",
        "rawmm_samples_dropped_total",
        "rawmm_materialize_seconds_bucket",
        "rawmm_offload_volume_available_bytes",
        "rawmm_offload_volume_capacity_bytes",
        "rawmm_offload_bytes",
        "rawmm_offload_gc_freed_bytes_total",
    },
    "operator": {
        "rawmm_operator_reconciles_total",
        "rawmm_operator_reconcile_seconds_bucket",
        "rawmm_rlruns",
    },
}


@pytest.mark.parametrize("name", sorted(REQUIRED_METRICS))
def test_dashboard_shows_what_the_issue_asks_for(name: str) -> None:
    used = {metric for _, expr in panel_queries(DASHBOARDS[name]) for metric in metric_names(expr)}
    assert REQUIRED_METRICS[name] <= used, REQUIRED_METRICS[name] - used
    if name == "materialization":
        expressions = [expr for _, expr in panel_queries(DASHBOARDS[name])]
        quantiles = {q for expr in expressions for q in re.findall(r"histogram_quantile\((0\.\d+)", expr)}
        assert quantiles == {"0.5", "0.95", "0.99"}
        assert any("by (reason)" in e and "invalid_mm_image_ref" in e for e in expressions)
        assert any("by (side)" in e and "images_materialized" in e for e in expressions)
