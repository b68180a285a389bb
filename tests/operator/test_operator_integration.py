"""The real operator (kopf, cluster-wide) against the kmock-based API emulator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kube.emulator import Cluster, emulated_cluster, running_operator
from operator_samples import (
    CPU_ONLY,
    ISSUE_EXAMPLE,
    RLRUNS,
    RLRUNS_URL,
    eventually,
    merged,
    rlrun,
    run_status,
)
from prometheus_client import REGISTRY

from rawmm_operator.handlers import LoopTiming

pytestmark = pytest.mark.cluster

CHILDREN = {
    ("v1/persistentvolumeclaims", "exp-offload"),
    ("v1/configmaps", "exp-config"),
    ("v1/services", "exp-engine"),
    ("v1/services", "exp-engine-headless"),
    ("apps/v1/statefulsets", "exp-engine"),
    ("batch/v1/jobs", "exp-orchestrator"),
    ("batch/v1/jobs", "exp-trainer"),
    ("monitoring.coreos.com/v1/podmonitors", "exp"),
}
OWNED = CHILDREN - {("v1/persistentvolumeclaims", "exp-offload")}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as running:
        yield running


async def create(cluster: Cluster, spec: dict[str, Any], name: str = "exp") -> dict[str, Any]:
    response = await cluster.emulator.post(RLRUNS_URL, json=rlrun(name, spec))
    assert response.status < 300, await response.text()
    return await response.json()


async def patch(cluster: Cluster, url: str, body: dict[str, Any]) -> None:
    headers = {"Content-Type": "application/merge-patch+json"}
    response = await cluster.emulator.patch(url, json=body, headers=headers)
    assert response.status < 300, await response.text()


def phase_is(cluster: Cluster, phase: str, name: str = "exp") -> Callable[[], bool]:
    return lambda: run_status(cluster, name).get("phase") == phase


def condition(cluster: Cluster, type_: str) -> str | None:
    return next((c["status"] for c in run_status(cluster).get("conditions", []) if c["type"] == type_), None)


def present(cluster: Cluster, keys: set[tuple[str, str]]) -> bool:
    return all(cluster.object(resource, "ml", name) is not None for resource, name in keys)


def engine_env(cluster: Cluster) -> dict[str, str]:
    statefulset = cluster.object("apps/v1/statefulsets", "ml", "exp-engine") or {}
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def event_reasons(cluster: Cluster) -> list[str]:
    return [e.get("reason") for e in cluster.objects("v1/events", "ml")]


async def test_rlrun_lifecycle(cluster: Cluster) -> None:
    spec = merged(ISSUE_EXAMPLE, {"offload": {"retainOnDelete": True}})
    async with running_operator(cluster):
        run = await create(cluster, spec)
        await eventually(lambda: present(cluster, CHILDREN), what="every child")
        for resource, name in OWNED:
            owners = cluster.object(resource, "ml", name)["metadata"]["ownerReferences"]  # type: ignore[index]
            assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [
                ("RLRun", "exp", run["metadata"]["uid"])
            ]
        assert (
            "ownerReferences"
            not in cluster.object("v1/persistentvolumeclaims", "ml", "exp-offload")["metadata"]
        )  # type: ignore[index]
        await eventually(phase_is(cluster, "Pending"))
        assert condition(cluster, "OffloadVolumeReady") == "False"

        # The children come up: the volume binds, the engines get ready, the Jobs' pods run.
        await patch(
            cluster,
            "/api/v1/namespaces/ml/persistentvolumeclaims/exp-offload/status",
            {"status": {"phase": "Bound"}},
        )
        await eventually(phase_is(cluster, "Provisioning"))
        await patch(
            cluster,
            "/apis/apps/v1/namespaces/ml/statefulsets/exp-engine/status",
            {"status": {"readyReplicas": 2}},
        )
        await eventually(lambda: condition(cluster, "InferenceReady") == "True")
        for job in ("exp-orchestrator", "exp-trainer"):
            await patch(cluster, f"/apis/batch/v1/namespaces/ml/jobs/{job}/status", {"status": {"active": 1}})
        await eventually(phase_is(cluster, "Running"))
        status = run_status(cluster)
        assert status["engines"] == {"replicas": 2, "readyReplicas": 2}
        assert {c["type"]: c["status"] for c in status["conditions"]} == {
            "OffloadVolumeReady": "True",
            "InferenceReady": "True",
            "OrchestratorRunning": "True",
            "TrainerRunning": "True",
            "Complete": "False",
            "Failed": "False",
            "Reconciled": "True",
        }
        assert status["observedGeneration"] == 1 and "startTime" in status
        await eventually(lambda: {"ChildrenCreated", "Running"} <= set(event_reasons(cluster)), what="events")

        # A cache size change rolls the engines (new pod template) and rewrites the run config.
        template_before = cluster.object("apps/v1/statefulsets", "ml", "exp-engine")["spec"]["template"]  # type: ignore[index]
        await patch(cluster, f"{RLRUNS_URL}/exp", {"spec": {"inference": {"materializeCacheSize": "8Gi"}}})
        await eventually(
            lambda: engine_env(cluster).get("RAWMM_MATERIALIZE_CACHE_SIZE") == "8Gi", what="new cache size"
        )
        template_after = cluster.object("apps/v1/statefulsets", "ml", "exp-engine")["spec"]["template"]  # type: ignore[index]
        assert template_after != template_before
        assert (
            "materialize_cache_size: 8Gi"
            in cluster.object("v1/configmaps", "ml", "exp-config")["data"]["run.yaml"]
        )  # type: ignore[index]
        await eventually(lambda: run_status(cluster).get("observedGeneration") == 2)

        # Suspend: engines to 0, Jobs suspended; resume brings them back.
        await patch(cluster, f"{RLRUNS_URL}/exp", {"spec": {"suspend": True}})
        await eventually(phase_is(cluster, "Suspended"))
        assert cluster.object("apps/v1/statefulsets", "ml", "exp-engine")["spec"]["replicas"] == 0  # type: ignore[index]
        for job in ("exp-orchestrator", "exp-trainer"):
            assert cluster.object("batch/v1/jobs", "ml", job)["spec"]["suspend"] is True  # type: ignore[index]
        await patch(cluster, f"{RLRUNS_URL}/exp", {"spec": {"suspend": False}})
        await eventually(
            lambda: cluster.object("apps/v1/statefulsets", "ml", "exp-engine")["spec"]["replicas"] == 2
        )  # type: ignore[index]
        await eventually(phase_is(cluster, "Running"))

        # The trainer finishes: the run succeeds and releases the engines' GPUs.
        await patch(
            cluster,
            "/apis/batch/v1/namespaces/ml/jobs/exp-trainer/status",
            {"status": {"active": 0, "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}},
        )
        await eventually(phase_is(cluster, "Succeeded"))
        assert "completionTime" in run_status(cluster)
        await eventually(
            lambda: cluster.object("apps/v1/statefulsets", "ml", "exp-engine")["spec"]["replicas"] == 0
        )  # type: ignore[index]

        # Deletion: the finalizer is released, owned children are collected, the retained volume stays.
        response = await cluster.emulator.delete(f"{RLRUNS_URL}/exp")
        assert response.status < 300
        await eventually(lambda: cluster.object(RLRUNS, "ml", "exp") is None, what="the RLRun to go")
        await eventually(
            lambda: not any(cluster.object(r, "ml", n) for r, n in OWNED), what="owned children to go"
        )
        assert cluster.object("v1/persistentvolumeclaims", "ml", "exp-offload") is not None


async def test_failed_job_fails_the_run_with_its_reason(cluster: Cluster) -> None:
    async with running_operator(cluster):
        await create(cluster, CPU_ONLY)
        await eventually(lambda: cluster.object("batch/v1/jobs", "ml", "exp-orchestrator"))
        failed = {
            "conditions": [
                {"type": "Failed", "status": "True", "message": "Job has reached the specified backoff limit"}
            ]
        }
        await patch(cluster, "/apis/batch/v1/namespaces/ml/jobs/exp-orchestrator/status", {"status": failed})
        await eventually(phase_is(cluster, "Failed"))
        status = run_status(cluster)
        assert (status["reason"], status["message"]) == (
            "OrchestratorFailed",
            "Job has reached the specified backoff limit",
        )
        await eventually(lambda: "OrchestratorFailed" in event_reasons(cluster))
        warnings = [e for e in cluster.objects("v1/events", "ml") if e.get("type") == "Warning"]
        assert any("backoff limit" in e.get("message", "") for e in warnings)


async def test_operator_restart_resumes_without_duplicating_children(cluster: Cluster) -> None:
    async with running_operator(cluster):
        await create(cluster, ISSUE_EXAMPLE)
        await eventually(lambda: present(cluster, CHILDREN) and run_status(cluster).get("phase"))
    posts = len(cluster.requests("POST"))
    uids = {key: cluster.object(*key[:1], "ml", key[1])["metadata"]["uid"] for key in CHILDREN}  # type: ignore[index]

    # While no operator runs, the volume binds and the engines get ready.
    await patch(
        cluster,
        "/api/v1/namespaces/ml/persistentvolumeclaims/exp-offload/status",
        {"status": {"phase": "Bound"}},
    )
    await patch(
        cluster,
        "/apis/apps/v1/namespaces/ml/statefulsets/exp-engine/status",
        {"status": {"readyReplicas": 2}},
    )

    async with running_operator(cluster):
        await eventually(
            lambda: condition(cluster, "InferenceReady") == "True", what="the resumed run's status"
        )
    # The weights Secret is created if absent (the operator may not read Secrets): a 409 says it exists.
    child_posts = [
        r for r in cluster.requests("POST")[posts:] if not ("/events" in str(r.url) or "/secrets" in str(r.url))
    ]
    assert child_posts == []
    assert {key: cluster.object(*key[:1], "ml", key[1])["metadata"]["uid"] for key in CHILDREN} == uids  # type: ignore[index]


async def test_a_deleted_child_is_recreated(cluster: Cluster) -> None:
    async with running_operator(cluster):
        await create(cluster, CPU_ONLY)
        await eventually(lambda: cluster.object("v1/configmaps", "ml", "exp-config"))
        first_uid = cluster.object("v1/configmaps", "ml", "exp-config")["metadata"]["uid"]  # type: ignore[index]
        await cluster.emulator.delete("/api/v1/namespaces/ml/configmaps/exp-config")
        recreated = await eventually(
            lambda: cluster.object("v1/configmaps", "ml", "exp-config"), what="recreation"
        )
        assert recreated["metadata"]["uid"] != first_uid


async def test_invalid_spec_is_reported_then_fixed(cluster: Cluster) -> None:
    resync = 0.2
    invalid_before = metric("rawmm_operator_reconciles_total", result="invalid")
    async with running_operator(cluster, timing=LoopTiming(resync_seconds=resync, error_backoffs=(0.1,))):
        # CEL would reject this at the API server; the emulator does not, so the operator must.
        await create(cluster, merged(CPU_ONLY, {"inference": {"engine": "vllm", "gpus": 0}}))
        await eventually(phase_is(cluster, "Failed"))
        status = run_status(cluster)
        assert status["reason"] == "InvalidSpec"
        assert "the vllm engine needs gpus >= 1" in status["message"]
        assert not cluster.objects("apps/v1/statefulsets", "ml")
        await eventually(lambda: "InvalidSpec" in event_reasons(cluster))
        # Several resync periods pass without another attempt on the same generation.
        await asyncio.sleep(5 * resync)
        assert metric("rawmm_operator_reconciles_total", result="invalid") == invalid_before + 1

        await patch(cluster, f"{RLRUNS_URL}/exp", {"spec": {"inference": {"engine": "transformers"}}})
        await eventually(
            lambda: cluster.object("apps/v1/statefulsets", "ml", "exp-engine"), what="children after the fix"
        )
        await eventually(phase_is(cluster, "Pending"))
        assert run_status(cluster).get("reason") is None


async def test_transient_api_errors_are_retried(cluster: Cluster) -> None:
    errors_before = metric("rawmm_operator_reconciles_total", result="error")
    cluster.emulator.fail_next("PATCH", "statefulsets", times=2)  # server-side apply creates it
    async with running_operator(cluster):
        await create(cluster, CPU_ONLY)
        await eventually(
            lambda: present(
                cluster, {("apps/v1/statefulsets", "exp-engine"), ("batch/v1/jobs", "exp-trainer")}
            )
        )
        await eventually(lambda: "ReconcileError" in event_reasons(cluster))
    assert metric("rawmm_operator_reconciles_total", result="error") >= errors_before + 2


async def test_phase_gauge_counts_runs(cluster: Cluster) -> None:
    async with running_operator(cluster):
        for name in ("one", "two"):
            await create(cluster, CPU_ONLY, name=name)
        await eventually(lambda: metric("rawmm_rlruns", phase="Pending") == 2, what="two Pending runs")
        await patch(
            cluster,
            "/api/v1/namespaces/ml/persistentvolumeclaims/one-offload/status",
            {"status": {"phase": "Bound"}},
        )
        await eventually(lambda: metric("rawmm_rlruns", phase="Provisioning") == 1)
        assert metric("rawmm_rlruns", phase="Pending") == 1
        assert metric("rawmm_operator_reconcile_seconds_count") > 0
