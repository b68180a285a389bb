"""The labels dashboards and alerts select run metrics by are the ones the operator's PodMonitor gives
them: prometheus-operator labels every target with namespace, pod, container and job, where job is
"<namespace>/<PodMonitor name>" (no jobLabel) and the PodMonitor is named after the run."""

from __future__ import annotations

import yaml
from monitoring_helpers import REPO, dashboards, rule_groups


def _children() -> list[dict]:
    from rawmm_operator.catalogue import build_children
    from rawmm_operator.children.monitoring import PodMonitorSettings
    from rawmm_operator.objects import RunRef
    from rawmm_operator.reconcile import parse_spec

    run = yaml.safe_load((REPO / "manifests" / "examples" / "qwen3-vl-gpu.yaml").read_text())
    ref = RunRef(name=run["metadata"]["name"], namespace="ml", uid="0000")
    return build_children(ref, parse_spec(ref.name, run["spec"]), pod_monitor=PodMonitorSettings())


def test_run_pod_monitor_names_jobs_after_the_run_and_scrapes_every_exporter() -> None:
    children = _children()
    (monitor,) = [c for c in children if c["kind"] == "PodMonitor"]
    assert "jobLabel" not in monitor["spec"] and monitor["metadata"]["name"] == "qwen3-vl-8b-shapes"
    scraped_ports = {endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]}
    pods = [c["spec"]["template"]["spec"] for c in children if "template" in c.get("spec", {})]
    containers = {
        c["name"]: {p["name"] for p in c.get("ports", [])} for pod in pods for c in pod["containers"]
    }
    assert set(containers) == {"engine", "orchestrator", "trainer"}
    for name, ports in containers.items():
        assert ports & scraped_ports, f"{name} exposes no port the PodMonitor scrapes"


def test_engine_down_alert_selects_the_engine_container() -> None:
    (engine_down,) = [r for g in rule_groups() for r in g["rules"] if r["alert"] == "RawmmEngineDown"]
    statefulset = next(c for c in _children() if c["kind"] == "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert f'container="{container["name"]}"' in engine_down["expr"]


def test_run_variable_reads_the_job_label() -> None:
    for name in ("materialization", "rl-run"):
        (run,) = [v for v in dashboards()[name]["templating"]["list"] if v["name"] == "run"]
        assert run["query"]["query"].endswith(", job)")
