"""Helpers of the monitoring tests: Prometheus binaries, the chart's rules and dashboards.

A module of its own (not conftest.py): test modules import it by a name no other test folder uses.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from chart_generate import load_generate
from ports import free_port

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


@dataclass(frozen=True)
class ScrapeTarget:
    """A loopback exporter, labelled the way prometheus-operator labels a pod's target."""

    port: int
    labels: dict[str, str]


class Prometheus:
    """Debian's Prometheus on 127.0.0.1, scraping `targets` every second and evaluating `rule_groups`."""

    def __init__(self, workdir: Path, targets: list[ScrapeTarget], groups: list[dict[str, Any]]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        write_rules_file(workdir / "rules.yaml", groups)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {
                    "job_name": "rawmm-test",
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{t.port}"], "labels": t.labels} for t in targets
                    ],
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self._log = (workdir / "prometheus.log").open("w")
        self._process = subprocess.Popen(
            [
                str(tool("prometheus")),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._http = httpx.Client(base_url=self.url, timeout=10)

    def wait_ready(self, timeout: float = 30) -> None:
        wait_until(lambda: self._get("/-/ready") is not None, "Prometheus ready", timeout, self._process)

    def _get(self, path: str, **params: str) -> Any:
        try:
            response = self._http.get(path, params=params)
        except httpx.TransportError:
            return None
        return response if response.status_code == 200 else None

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar) `expr` evaluates to now; raises on a query error."""
        response = self._http.get("/api/v1/query", params={"query": expr})
        body = response.json()
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        result = body["data"]["result"]
        return [{"metric": {}, "value": result}] if body["data"]["resultType"] == "scalar" else result

    def label_values(self, label: str, selector: str) -> list[str]:
        body = self._http.get(f"/api/v1/label/{label}/values", params={"match[]": selector}).json()
        assert body["status"] == "success", f"{selector}: {body.get('error')}"
        return body["data"]

    def firing_alerts(self) -> list[dict[str, Any]]:
        alerts = self._http.get("/api/v1/alerts").json()["data"]["alerts"]
        return [alert for alert in alerts if alert["state"] == "firing"]

    def targets_up(self) -> dict[str, str]:
        active = self._http.get("/api/v1/targets").json()["data"]["activeTargets"]
        return {target["scrapeUrl"]: target["health"] for target in active}

    def stop(self) -> None:
        self._http.close()
        stop_process(self._process)
        self._log.close()


def wait_until(
    condition: Callable[[], Any], what: str, timeout: float, process: subprocess.Popen[Any] | None = None
) -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout` s or if `process` exits."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if process is not None and process.poll() is not None:
            pytest.fail(f"waiting for {what}: the process exited with {process.returncode}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def stop_process(process: subprocess.Popen[Any], timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
