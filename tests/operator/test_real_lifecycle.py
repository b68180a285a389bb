"""An RLRun's life on a real control plane (tests/kube): the chart installed with Helm, the real `rawmm
operator` running as the chart's ServiceAccount with the chart's RBAC, kube-controller-manager's
StatefulSet, Job and garbage-collector controllers, kube-scheduler and kwok's fake GPU nodes. The
operator watches every namespace, as the chart deploys it by default.

RLRun -> children (owned by the run) -> pods scheduled and Running -> phase Running -> the Jobs' pods
exit -> Succeeded or Failed with its reason, engines released; suspend and resume; delete -> the garbage
collector removes every child; an operator restart mid-run duplicates nothing."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube.cluster import NODES, KubeCluster, OperatorProcess, wait_for
from kube.installs import RELEASE_NAMESPACE, helm_release
from operator_samples import merged

from rawmm_operator.builders import RUN_LABEL, RunRef, build_children
from rawmm_operator.spec import parse_spec

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
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


@pytest.fixture(scope="module")
def chart_release(kube_cluster: KubeCluster) -> Iterator[ChartRelease]:
    """The chart installed (on a cluster with the prometheus-operator CRDs), and a kubeconfig of its
    ServiceAccount, so the operator has exactly the chart's grants."""
    kube_cluster.monitoring_crds(True)
    with helm_release(kube_cluster) as release:
        (account,) = [
            doc["metadata"]["name"]
            for doc in _documents(release["manifest"])
            if doc["kind"] == "ServiceAccount"
        ]
        yield ChartRelease(
            release["manifest"],
            f"system:serviceaccount:{RELEASE_NAMESPACE}:{account}",
            kube_cluster.service_account_kubeconfig(RELEASE_NAMESPACE, account),
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


@pytest.fixture
def run(kube_cluster: KubeCluster, chart_release: ChartRelease) -> Iterator[Run]:
    namespace = kube_cluster.namespace("life")
    yield Run(kube_cluster, namespace)
    # The operator is gone by now: lift its finalizer so the run, its children and their pods (and the
    # GPUs they hold on the fake nodes) go away with the namespace.
    kube_cluster.kubectl("delete", "rlrun", "--all", "-n", namespace, "--wait=false")
    kube_cluster.kubectl(
        "patch",
        "rlrun",
        "exp",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"metadata":{"finalizers":null}}',
        check=False,
    )
    kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def test_a_run_is_created_runs_and_succeeds(
    run: Run, kube_cluster: KubeCluster, chart_release: ChartRelease
) -> None:
    with kube_cluster.operator(chart_release.kubeconfig) as operator:
        run.create(SPEC)
        run.wait_running(operator)
        uid = run.body()["metadata"]["uid"]
        for (kind, name), child in run.children().items():
            owners = [o["uid"] for o in child["metadata"].get("ownerReferences", [])]
            assert owners == [uid], f"{kind}/{name} is not owned by the run"
        for pod in run.pods():
            assert pod["spec"]["nodeName"] in NODES
        (trainer,) = run.running_pods("trainer")
        assert trainer["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
        status = run.status()
        assert {c["type"]: c["status"] for c in status["conditions"]} == {
            "OffloadVolumeReady": "True",
            "InferenceReady": "True",
            "OrchestratorRunning": "True",
            "TrainerRunning": "True",
            "Complete": "False",
            "Failed": "False",
            "Reconciled": "True",
        }
        assert status["engines"] == {"replicas": 2, "readyReplicas": 2}
        assert status["observedGeneration"] == 1 and status["startTime"]
        wait_for(
            lambda: {"ChildrenCreated", "Running"} <= run.event_reasons(), "the run's events", TIMEOUT, 0.3
        )

        run.finish("orchestrator", 0)
        run.finish("trainer", 0)
        status = run.wait_phase("Succeeded", operator)
        assert run.condition("Complete")["status"] == "True" and status.get("completionTime")
        wait_for(run.engines_released, "engines scaled to 0 after success", TIMEOUT, 0.3)


def test_a_failed_trainer_pod_fails_the_run_with_its_reason(
    run: Run, kube_cluster: KubeCluster, chart_release: ChartRelease
) -> None:
    with kube_cluster.operator(chart_release.kubeconfig) as operator:
        run.create(SPEC)
        run.wait_running(operator)
        run.finish("trainer", 1)
        status = run.wait_phase("Failed", operator)
        assert status["reason"] == "TrainerFailed", status
        assert run.condition("Failed")["status"] == "True"
        # Nothing keeps its accelerators: engines at 0, the orchestrator's pod stopped.
        wait_for(run.engines_released, "engines scaled to 0 after failure", TIMEOUT, 0.3)
        wait_for(lambda: not run.running_pods("orchestrator"), "the orchestrator stopped", TIMEOUT, 0.3)


def test_suspend_stops_every_pod_and_resume_restarts_them(
    run: Run, kube_cluster: KubeCluster, chart_release: ChartRelease
) -> None:
    with kube_cluster.operator(chart_release.kubeconfig) as operator:
        run.create(SPEC)
        run.wait_running(operator)
        run.patch({"suspend": True})
        run.wait_phase("Suspended", operator)
        wait_for(lambda: not run.pods(), "every pod gone while suspended", TIMEOUT, 0.3)
        jobs = [c for (kind, _), c in run.children().items() if kind == "Job"]
        assert len(jobs) == 2 and all(job["spec"]["suspend"] for job in jobs)
        run.patch({"suspend": False})
        run.wait_running(operator)


def test_deleting_a_run_collects_every_child_but_a_retained_volume(
    run: Run, kube_cluster: KubeCluster, chart_release: ChartRelease
) -> None:
    with kube_cluster.operator(chart_release.kubeconfig) as operator:
        run.create(merged(SPEC, {"offload": {"retainOnDelete": True}}))
        run.wait_running(operator)
        kube_cluster.kubectl("delete", "rlrun", run.name, "-n", run.namespace, "--wait=false")
        claim = ("PersistentVolumeClaim", f"{run.name}-offload")
        wait_for(
            lambda: set(run.children()) == {claim} and not run.pods(),
            "every other child and pod collected",
            TIMEOUT,
            0.3,
        )
        gone = kube_cluster.kubectl("get", "rlrun", run.name, "-n", run.namespace, check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr, operator.log()[-3000:]
        assert "ownerReferences" not in run.children()[claim]["metadata"]


def test_an_operator_restart_mid_run_duplicates_nothing(
    run: Run, kube_cluster: KubeCluster, chart_release: ChartRelease
) -> None:
    with kube_cluster.operator(chart_release.kubeconfig) as operator:
        run.create(SPEC)
        run.wait_running(operator)
    before = {key: child["metadata"]["uid"] for key, child in run.children().items()}
    pods_before = {p["metadata"]["uid"] for p in run.pods()}
    with kube_cluster.operator(chart_release.kubeconfig) as operator:
        # The new operator notices the orchestrator finishing: it has reconciled the run.
        run.finish("orchestrator", 0)
        wait_for(
            lambda: (run.status().get("orchestrator") or {}).get("state") == "Succeeded",
            "the restarted operator reconciling",
            TIMEOUT,
            0.3,
        )
        after = {key: child["metadata"]["uid"] for key, child in run.children().items()}
        assert after == before, operator.log()[-3000:]
        assert {p["metadata"]["uid"] for p in run.pods()} == pods_before
        assert len(run.pods("trainer")) == 1 and len(run.pods("engine")) == 2


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


def test_the_operator_needs_exactly_the_charts_grants(
    kube_cluster: KubeCluster, chart_release: ChartRelease
) -> None:
    """Runs through everything the operator does, with it watching every namespace as the chart deploys
    it: no request is denied, and every verb the chart grants is used (or listed above with its reason).
    One run is created, changed (its Jobs recreated), loses its PodMonitor, succeeds and expires
    (ttlSecondsAfterFinished prunes its children); another waits on a claim that cannot bind."""
    run = Run(kube_cluster, kube_cluster.namespace("rbac"))
    stuck = Run(kube_cluster, kube_cluster.namespace("rbac"))
    offset = kube_cluster.audit_log.stat().st_size
    with kube_cluster.operator(chart_release.kubeconfig) as operator:
        run.create({**SPEC, "ttlSecondsAfterFinished": 1})
        stuck.create(merged(SPEC, {"offload": {"storageClassName": "absent"}}))
        run.wait_running(operator)
        run.patch({"inference": {"replicas": 1}})
        run.wait_running(operator, engines=1)
        run.patch({"monitoring": {"podMonitor": False}})
        wait_for(
            lambda: not [k for k in run.children() if k[0] == "PodMonitor"],
            "the PodMonitor pruned",
            TIMEOUT,
            0.3,
        )
        run.finish("orchestrator", 0)
        run.finish("trainer", 0)
        run.wait_phase("Succeeded", operator)
        wait_for(
            lambda: {k for k, _ in run.children()} == {"PersistentVolumeClaim"},
            "an expired run's children pruned",
            TIMEOUT,
            0.3,
        )
        wait_for(
            lambda: "not found" in stuck.condition("OffloadVolumeReady").get("message", ""),
            "the pending claim's event in its condition",
            TIMEOUT,
            0.3,
        )
        kube_cluster.kubectl("delete", "rlrun", "--all", "-n", run.namespace, "--wait=false")
        wait_for(lambda: not run.children(), "every child collected", TIMEOUT, 0.3)
    events = kube_cluster.audit_events(chart_release.user, since=offset)
    denied = sorted({(e["verb"], e["requestURI"]) for e in events if e["responseStatus"]["code"] == 403})
    assert not denied, denied
    unused = granted(chart_release.manifest) - used(events) - UNOBSERVED_GRANTS
    assert not unused, f"granted by the chart, never used: {sorted(unused)}"
    for namespace in (run.namespace, stuck.namespace):
        kube_cluster.kubectl("delete", "rlrun", "--all", "-n", namespace, "--wait=false")
        kube_cluster.kubectl(
            "patch",
            "rlrun",
            "exp",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
        kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false")
