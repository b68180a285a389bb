"""An RLRun's life on a real control plane (tests/kube): the chart installed with Helm, the real `rawmm
operator` running as the chart's ServiceAccount with the chart's RBAC, kube-controller-manager's
StatefulSet, Job and garbage-collector controllers, kube-scheduler and kwok's fake GPU nodes. The
operator watches every namespace, as the chart deploys it by default.

RLRun -> children (owned by the run) -> pods scheduled and Running -> phase Running -> the Jobs' pods
exit -> Succeeded or Failed with its reason, engines released; suspend and resume; delete -> the garbage
collector removes every child; an operator restart mid-run duplicates nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kube.cluster import NODES, KubeCluster, wait_for
from operator_samples import merged
from real_runs import (
    SPEC,
    TIMEOUT,
    UNOBSERVED_GRANTS,
    ChartRelease,
    Run,
    granted,
    installed_chart,
    remove_runs,
    used,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def chart_release(kube_cluster: KubeCluster) -> Iterator[ChartRelease]:
    with installed_chart(kube_cluster) as release:
        yield release


@pytest.fixture
def run(kube_cluster: KubeCluster, chart_release: ChartRelease) -> Iterator[Run]:
    namespace = kube_cluster.namespace("life")
    yield Run(kube_cluster, namespace)
    remove_runs(kube_cluster, namespace)


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
        # Nothing keeps its accelerators: engines at 0, the orchestrator's pod stopped in place (an active
        # deadline already past, which a real kubelet acts on: tests/kube/test_node_rlrun.py).
        wait_for(run.engines_released, "engines scaled to 0 after failure", TIMEOUT, 0.3)
        wait_for(
            lambda: [p["spec"].get("activeDeadlineSeconds") for p in run.pods("orchestrator")] == [1],
            "the orchestrator's pod stopped",
            TIMEOUT,
            0.3,
        )


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
        remove_runs(kube_cluster, namespace)
