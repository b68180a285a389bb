"""The offload GC of an RLRun: its Job (built only with retention on) and the volume usage in the status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kube.emulator import Cluster, emulated_cluster, running_operator
from operator_samples import CPU_ONLY, RLRUNS_URL, eventually, merged, rlrun, run_status
from prometheus_client import REGISTRY, start_http_server
from test_operator_builders import KUBERNETES_VERSIONS, RUN, children, pod_spec
from test_operator_progress import PodList, pod

from rawmm.config import RunConfig
from rawmm.contract.gc import GCReport
from rawmm_operator.catalogue import build_children
from rawmm_operator.handlers import LoopTiming
from rawmm_operator.objects import RUN_LABEL
from rawmm_operator.pods import TEMPLATE_HASH
from rawmm_operator.progress import ProgressReader
from rawmm_operator.spec import InvalidSpec, parse_spec
from rawmm_operator.status import Observed, Progress, RLRunStatus, derive_status

RETAINED = merged(CPU_ONLY, {"offload": {"retention": {"enabled": True, "olderThan": "2h", "keepSteps": 3}}})
GC_JOB = ("Job", "exp-offload-gc")


def test_the_gc_job_exists_only_with_retention_on() -> None:
    assert GC_JOB not in children(CPU_ONLY)
    assert GC_JOB in children(RETAINED)
    finished = build_children(RUN, parse_spec(RUN.name, RETAINED), stage="finished")
    assert all(m["metadata"]["name"] != GC_JOB[1] for m in finished)  # it ends with the run's last step


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_gc_job_watches_the_run_with_the_volume_and_config_mounted(version: str) -> None:
    built = children(RETAINED)
    job = built[GC_JOB]
    kubernetes_validate.validate(job, version, strict=True)
    (container,) = pod_spec(job)["containers"]
    assert [container["command"][0], *container["args"]] == [
        "rawmm",
        "gc",
        "--config",
        "/etc/rawmm/run.yaml",
        "--watch",
    ]
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/shared", "/etc/rawmm"}
    assert container["ports"] == [{"name": "metrics", "containerPort": 9103, "protocol": "TCP"}]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels[RUN_LABEL] == "exp"  # the run's PodMonitor (port `metrics`) and the status scrape find it
    assert labels["app.kubernetes.io/component"] == "offload-gc"
    assert TEMPLATE_HASH in job["metadata"]["annotations"]
    config = RunConfig.model_validate(yaml.safe_load(built[("ConfigMap", "exp-config")]["data"]["run.yaml"]))
    retention = config.offload.retention
    assert (retention.enabled, retention.older_than, retention.keep_steps) == (True, "2h", 3)


def test_an_unsafe_bound_is_an_invalid_spec() -> None:
    with pytest.raises(InvalidSpec, match="offload.retention.olderThan: older-than must be at least 600s"):
        parse_spec("exp", merged(CPU_ONLY, {"offload": {"retention": {"olderThan": "5m"}}}))


def test_the_status_reports_the_volume_usage_the_gc_pod_exports(tmp_path: Path) -> None:
    from rawmm.rl.retention import metrics  # the GC process's own exporter

    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    try:
        freed_before = metrics.GC_FREED_BYTES._value.get()
        metrics.export(
            GCReport(dry_run=False, removed_bytes=700, remaining_files=12, remaining_bytes=3400), tmp_path
        )
        api = PodList()
        api.pods = [pod("exp-offload-gc-abcde", "offload-gc", "metrics", server.server_port)]
        progress = ProgressReader(api).read("ml", "exp", Progress())
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    usage = progress.offload_usage
    assert usage is not None
    assert (usage.bytes, usage.files, usage.gc_freed_bytes) == (3400, 12, int(freed_before) + 700)
    assert usage.last_gc_time is not None and usage.last_gc_time.endswith("Z")

    observed = Observed(claim_name="exp-offload", claim=None, engines=None, orchestrator=None, trainer=None)
    now = "2026-12-01T10:00:00Z"
    status = derive_status(
        suspend=False, generation=1, observed=observed, previous=RLRunStatus(), now=now, progress=progress
    )
    offload: dict[str, Any] = status.dump()["offload"]
    assert offload["bytes"] == 3400 and offload["files"] == 12 and offload["lastGcTime"] == usage.last_gc_time
    # A pass without a fresh scrape keeps what the status had.
    again = derive_status(suspend=False, generation=1, observed=observed, previous=status, now=now)
    assert again.dump()["offload"] == offload


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as running:
        yield running


@pytest.mark.cluster
async def test_the_operator_creates_the_gc_job_and_shows_the_volume_usage(
    cluster: Cluster, tmp_path: Path
) -> None:
    from rawmm.rl.retention import metrics  # the GC process's own exporter

    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    try:
        metrics.export(
            GCReport(dry_run=False, removed_bytes=10, remaining_files=5, remaining_bytes=640), tmp_path
        )
        body = pod("exp-offload-gc-abcde", "offload-gc", "metrics", server.server_port)
        assert (await cluster.emulator.post("/api/v1/namespaces/ml/pods", json=body)).status < 300
        timing = LoopTiming(resync_seconds=0.2, error_backoffs=(0.1,), progress_seconds=0.0)
        async with running_operator(cluster, timing=timing):
            assert (await cluster.emulator.post(RLRUNS_URL, json=rlrun("exp", RETAINED))).status < 300
            await eventually(
                lambda: cluster.object("batch/v1/jobs", "ml", "exp-offload-gc"), what="the GC Job"
            )
            await eventually(
                lambda: run_status(cluster).get("offload", {}).get("files") == 5, what="the usage"
            )
            offload = run_status(cluster)["offload"]
            assert offload["bytes"] == 640 and offload["claimName"] == "exp-offload" and offload["lastGcTime"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
