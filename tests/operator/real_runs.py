"""Helpers of the real-cluster operator tests (tests/kube): the chart installed for an operator to run as
its ServiceAccount, an RLRun read back through kubectl, and the chart's grants against the audit log.

A module of its own (not conftest.py): test modules import it by a name no other test folder uses."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kube.cluster import KubeCluster, OperatorProcess, wait_for
from kube.installs import RELEASE_NAMESPACE, helm_release

from rawmm_operator.catalogue import build_children
from rawmm_operator.objects import RUN_LABEL, RunRef
from rawmm_operator.spec import parse_spec

SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen3-VL-4B-Instruct", "preset": "qwen3_vl"},
    "offload": {"size": "20Gi", "retainOnDelete": False},
    "inference": {"replicas": 2, "gpus": 1, "materializeCacheSize": "4Gi"},
    "trainer": {"gpusPerNode": 8, "steps": 10},
}
CHILD_KINDS = "persistentvolumeclaims,configmaps,services,statefulsets,jobs,podmonitors"
TIMEOUT = 60


@dataclass(frozen=True)
class ChartRelease:
    manifest: str  # what Helm created
    user: str  # the operator's ServiceAccount, as the API server names it
    kubeconfig: Path  # a token of that ServiceAccount


@contextlib.contextmanager
def installed_chart(cluster: KubeCluster, values: dict[str, Any] | None = None) -> Iterator[ChartRelease]:
    """The chart installed (on a cluster with the prometheus-operator CRDs), and a kubeconfig of its
    ServiceAccount, so an operator has exactly the chart's grants."""
    cluster.monitoring_crds(True)
    with helm_release(cluster, values) as release:
        (account,) = [
            doc["metadata"]["name"]
            for doc in _documents(release["manifest"])
            if doc["kind"] == "ServiceAccount"
        ]
        yield ChartRelease(
            release["manifest"],
            f"system:serviceaccount:{RELEASE_NAMESPACE}:{account}",
            cluster.service_account_kubeconfig(RELEASE_NAMESPACE, account),
        )


def _documents(manifest: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


@dataclass
class Run:
    """One RLRun in its own namespace, read back through the admin's kubectl."""

    cluster: KubeCluster
    namespace: str
    name: str = "exp"

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.cluster.kubectl("get", "-n", self.namespace, "-o", "json", *args).stdout)

    def create(self, spec: dict[str, Any]) -> None:
        body = {
            "apiVersion": "rawmm.dev/v1alpha1",
            "kind": "RLRun",
            "metadata": {"name": self.name},
            "spec": spec,
        }
        self.cluster.kubectl("apply", "-n", self.namespace, "-f", "-", input=json.dumps(body))

    def patch(self, spec: dict[str, Any]) -> None:
        self.cluster.kubectl(
            "patch",
            "rlrun",
            self.name,
            "-n",
            self.namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": spec}),
        )

    def body(self) -> dict[str, Any]:
        return self.get("rlrun", self.name)

    def status(self) -> dict[str, Any]:
        return self.body().get("status") or {}

    def condition(self, type_: str) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions", []) if c["type"] == type_), {})

    def expected_children(self) -> set[tuple[str, str]]:
        body = self.body()
        built = build_children(
            RunRef(self.name, self.namespace, body["metadata"]["uid"]), parse_spec(self.name, body["spec"])
        )
        return {(m["kind"], m["metadata"]["name"]) for m in built}

    def children(self) -> dict[tuple[str, str], dict[str, Any]]:
        items = self.get(CHILD_KINDS, "-l", f"{RUN_LABEL}={self.name}")["items"]
        return {(item["kind"], item["metadata"]["name"]): item for item in items}

    def pods(self, component: str | None = None) -> list[dict[str, Any]]:
        pods = self.get("pods", "-l", f"{RUN_LABEL}={self.name}")["items"]
        return [
            p
            for p in pods
            if component is None or p["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]

    def running_pods(self, component: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(component) if p["status"].get("phase") == "Running"]

    def wait(self, check: Callable[[], Any], what: str, operator: OperatorProcess) -> Any:
        """wait_for, failing with the run's status and the operator's log (a 403 shows there)."""
        try:
            return wait_for(check, what, TIMEOUT, 0.3)
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}; status {self.status()}\n--- operator log ---\n{operator.log()[-4000:]}"
            ) from None

    def wait_phase(self, phase: str, operator: OperatorProcess) -> dict[str, Any]:
        return self.wait(
            lambda: self.status() if self.status().get("phase") == phase else None, f"phase {phase}", operator
        )

    def wait_running(self, operator: OperatorProcess, engines: int = SPEC["inference"]["replicas"]) -> None:
        """Every child made, every pod on a fake node and Running, and the run's phase Running."""
        expected = self.expected_children()
        self.wait(lambda: expected <= set(self.children()), f"children {sorted(expected)}", operator)
        for component, count in (
            ("engine", engines),
            ("orchestrator", 1),
            ("trainer", 1),
        ):
            wait_for(
                lambda c=component, n=count: len(self.running_pods(c)) == n,
                f"{count} {component} pod(s) Running",
                TIMEOUT,
                0.3,
            )
        self.wait_phase("Running", operator)

    def event_reasons(self) -> set[str]:
        events = self.get("events", f"--field-selector=involvedObject.name={self.name}")["items"]
        return {e["reason"] for e in events if e["involvedObject"]["kind"] == "RLRun"}

    def finish(self, component: str, exit_code: int) -> None:
        (pod,) = self.running_pods(component)
        self.cluster.finish_pod(self.namespace, pod["metadata"]["name"], exit_code)

    def engines_released(self) -> bool:
        (statefulset,) = [c for (kind, _), c in self.children().items() if kind == "StatefulSet"]
        return statefulset["spec"]["replicas"] == 0 and not self.pods("engine")


# Granted by the chart but never a request of their own, each for a reason.
UNOBSERVED_GRANTS = {
    # OwnerReferencesPermissionEnforcement checks it on every child created with blockOwnerDeletion (a
    # missing grant is a 403 on that create): an authorization check, not a request.
    ("update", "rawmm.dev", "rlruns/finalizers"),
    # Pruning children no longer built and deleting an expired run's children (ttlSecondsAfterFinished):
    # not in this scenario; test_real_operator_reconcile.py makes (and checks) them as the same account.
    ("delete", "", "configmaps"),
    ("delete", "", "services"),
    ("delete", "", "secrets"),
    ("delete", "apps", "statefulsets"),
    ("delete", "monitoring.coreos.com", "podmonitors"),
    # Stopping a failed run's other pods (an active deadline): this scenario's run succeeds; the failed-run
    # tests of test_real_operator_reconcile.py patch them as the same account.
    ("patch", "", "pods"),
}


def granted(manifest: str) -> set[tuple[str, str, str]]:
    """(verb, API group, resource[/subresource]) of every rule of the chart's ClusterRoles."""
    return {
        (verb, group, resource)
        for doc in _documents(manifest)
        if doc["kind"] == "ClusterRole"
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def used(events: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(verb, API group, resource[/subresource]) of every request; a server-side apply that created its
    object (201) needed `create` as well as `patch`."""
    accesses = set()
    for event in events:
        ref = event.get("objectRef")
        if ref and ref.get("resource"):  # discovery (/api, /apis) needs no grant
            resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            accesses.add((event["verb"], ref.get("apiGroup", ""), resource))
            if event["verb"] == "patch" and event["responseStatus"]["code"] == 201:
                accesses.add(("create", ref.get("apiGroup", ""), resource))
    return accesses


def remove_runs(cluster: KubeCluster, namespace: str) -> None:
    """Delete the namespace with its runs, their children and pods (and the GPUs those hold)."""
    cluster.kubectl("delete", "rlrun", "--all", "-n", namespace, "--wait=false")
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
