"""`helm lint --strict` passes for every values set, and values.schema.json refuses bad values at install
time with a message that names the offending key."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from chart_generate import load_generate
from chart_helpers import KUBE_VERSIONS, read_values, values_files

CHART_DIR = load_generate().CHART_DIR


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_path", [None, *values_files()], ids=lambda p: p.stem if p else "defaults")
def test_lint_strict_passes(values_path: Any, kube_version: str) -> None:
    values = read_values(values_path) if values_path else None
    report = helm.lint(
        CHART_DIR, values, strict=True, namespace="rawmm-system", kube_version=f"v{kube_version}.0"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("values_path", values_files(), ids=lambda p: p.stem)
def test_values_files_pass_the_schema(values_path: Any) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(read_values(values_path))


BAD_VALUES = [
    ({"operator": {"healthPort": 0}}, "/operator/healthPort"),
    ({"operator": {"metricsPort": "9100"}}, "/operator/metricsPort"),
    ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"resources": {"requests": {"memory": "lots"}}}}, "/operator/resources/requests/memory"),
    ({"image": {"tag": "latest"}}, "/image/tag"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"crds": {"install": "yes"}}, "/crds/install"),
    ({"dashboards": {"labels": {"grafana_dashboard": 1}}}, "/dashboards/labels/grafana_dashboard"),
    ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "/metrics/serviceMonitor/interval"),
    (
        {"prometheusRule": {"cacheHitRateLow": {"threshold": 1.5}}},
        "/prometheusRule/cacheHitRateLow/threshold",
    ),
    ({"prometheusRule": {"trainerStalled": {"for": "soon"}}}, "/prometheusRule/trainerStalled/for"),
    ({"runs": {"podMonitor": {"labels": {"release": 3}}}}, "/runs/podMonitor/labels/release"),
    # Prometheus durations run from the largest unit down, as the PodMonitor CRD's own pattern says.
    ({"runs": {"podMonitor": {"interval": "30s1m"}}}, "/runs/podMonitor/interval"),
    ({"metrics": {"serviceMonitor": {"scrapeTimeout": "10ms1s"}}}, "/metrics/serviceMonitor/scrapeTimeout"),
    ({"operatr": {}}, "operatr"),
    ({"operator": {"replicas": 2}}, "replicas"),
]


@pytest.mark.parametrize(("values", "named"), BAD_VALUES, ids=[named for _, named in BAD_VALUES])
def test_schema_rejects_bad_values_naming_them(values: dict[str, Any], named: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        with pytest.raises(helm.HelmValuesError) as schema_error:
            chart.validate_schema(values)
        # An install validates the same way before rendering anything.
        with pytest.raises(helm.HelmValuesError) as render_error:
            chart.render(values, name="rawmm", namespace="rawmm-system", is_install=True)
    assert named in str(schema_error.value)
    assert named in str(render_error.value)


def test_every_documented_value_is_in_the_schema_and_the_defaults_pass_it() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        defaults, schema = chart.values, chart.schema
        chart.validate_schema(defaults)

    def walk(values: dict[str, Any], node: dict[str, Any], path: str) -> None:
        for key, value in values.items():
            assert key in node.get("properties", {}), f"{path}{key} is missing from values.schema.json"
            child = node["properties"][key]
            if isinstance(value, dict) and "properties" in child:
                walk(value, child, f"{path}{key}.")

    walk(defaults, schema, "")
