"""The real operator (kopf, cluster-wide) against the kmock-based API emulator, for what the real control
plane cannot stage (a spec the API server would refuse, injected 503s) or stages slower (a deleted child, the
phase gauge). The lifecycle itself is proved on kube-apiserver: tests/operator/test_real_lifecycle.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kube.emulator import Cluster, emulated_cluster, running_operator
from operator_samples import (
    CPU_ONLY,
    RLRUNS_URL,
    eventually,
    merged,
    rlrun,
    run_status,
)
from prometheus_client import REGISTRY

from rawmm_operator.handlers import LoopTiming

pytestmark = pytest.mark.cluster


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


def present(cluster: Cluster, keys: set[tuple[str, str]]) -> bool:
    return all(cluster.object(resource, "ml", name) is not None for resource, name in keys)


def event_reasons(cluster: Cluster) -> list[str]:
    return [e.get("reason") for e in cluster.objects("v1/events", "ml")]


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
