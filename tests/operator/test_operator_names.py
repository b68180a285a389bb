"""Child names come from one table (`rawmm_operator.names`): renaming a child renames it for every consumer,
the builders' cross-references, the engines' URLs, the reconciler and the status alike."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml
from kube.emulator import Cluster, emulated_cluster
from operator_samples import MULTI_NODE, RLRUNS_URL, merged, rlrun
from test_operator_builders import pod_spec

from rawmm.config import RunConfig
from rawmm_operator import names
from rawmm_operator.catalogue import build_children
from rawmm_operator.children.config import build_weights_secret
from rawmm_operator.kube import KubeApi
from rawmm_operator.names import SUFFIXES, Child, child_name, engine_pod
from rawmm_operator.objects import RunRef
from rawmm_operator.reconcile import Reconciler
from rawmm_operator.spec import MAX_RUN_NAME, parse_spec

RUN = RunRef(name="exp", namespace="ml", uid="u-1")
RETAINED = merged(MULTI_NODE, {"offload": {"retention": {"enabled": True}}})


@pytest.fixture(params=["as shipped", "renamed"])
def table(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[Child, str]:
    if request.param == "renamed":
        renamed = {child: f"r{i}" for i, child in enumerate(SUFFIXES)}
        monkeypatch.setattr(names, "SUFFIXES", renamed)
    return names.SUFFIXES


def env_ref(container: dict[str, Any], variable: str) -> str:
    (entry,) = [e for e in container["env"] if e["name"] == variable]
    return str(entry["valueFrom"]["secretKeyRef"]["name"])


def test_every_child_and_every_reference_to_one_uses_the_derived_name(table: dict[Child, str]) -> None:
    built = {(m["kind"], m["metadata"]["name"]): m for m in build_children(RUN, parse_spec("exp", RETAINED))}
    name = {child: child_name("exp", child) for child in table}
    assert set(built) == {
        ("PersistentVolumeClaim", name["offload"]),
        ("ConfigMap", name["config"]),
        ("Service", name["engine_headless"]),
        ("Service", name["engine"]),
        ("StatefulSet", name["engine"]),
        ("Service", name["trainer"]),
        ("Job", name["orchestrator"]),
        ("Job", name["trainer"]),
        ("Job", name["offload_gc"]),
        ("PodMonitor", name["pod_monitor"]),
    }
    engines = built[("StatefulSet", name["engine"])]
    assert engines["spec"]["serviceName"] == name["engine_headless"]
    trainer = pod_spec(built[("Job", name["trainer"])])
    assert trainer["subdomain"] == name["trainer"]
    assert f"--master-addr={name['trainer']}-0.{name['trainer']}.ml.svc" in trainer["containers"][0]["args"]
    for manifest in built.values():
        if manifest["kind"] in ("StatefulSet", "Job"):
            volumes = {v["name"]: v for v in pod_spec(manifest)["volumes"]}
            assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == name["offload"]
            if "config" in volumes:
                assert volumes["config"]["configMap"]["name"] == name["config"]
    secret = build_weights_secret(RUN, "t")["metadata"]["name"]
    assert secret == name["weights"] == env_ref(pod_spec(engines)["containers"][0], "RAWMM_WEIGHTS_TOKEN")
    config = RunConfig.from_mapping(yaml.safe_load(built[("ConfigMap", name["config"])]["data"]["run.yaml"]))
    assert config.inference.urls == [
        f"http://{engine_pod('exp', i)}.{name['engine_headless']}.ml.svc:8000" for i in range(4)
    ]
    assert engine_pod("exp", 0) == f"{name['engine']}-0"


def test_the_longest_run_name_leaves_every_child_a_dns_label() -> None:
    run = "r" * MAX_RUN_NAME
    assert max(len(child_name(run, child)) for child in SUFFIXES) <= 63


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as running:
        yield running


@pytest.mark.cluster
async def test_the_reconciler_finds_the_children_it_made_under_their_derived_names(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(names, "SUFFIXES", {child: f"renamed-{i}" for i, child in enumerate(SUFFIXES)})
    spec = merged(MULTI_NODE, {"inference": {"replicas": 3}})
    response = await cluster.emulator.post(RLRUNS_URL, json=rlrun("exp", spec))
    assert response.status < 300, await response.text()
    reconciler = Reconciler(KubeApi(cluster.api_client()), progress_interval=3600)
    await asyncio.to_thread(reconciler.reconcile, "ml", "exp")
    outcome = await asyncio.to_thread(reconciler.reconcile, "ml", "exp")
    assert outcome is not None
    assert cluster.object("v1/secrets", "ml", child_name("exp", "weights")) is not None
    status = outcome.status
    assert status.offload is not None and status.offload.claim_name == child_name("exp", "offload")
    assert status.engines is not None and status.engines.replicas == 3  # the StatefulSet it found
    assert status.trainer is not None and status.trainer.state != "NotCreated"
    assert status.orchestrator is not None and status.orchestrator.state != "NotCreated"
    assert cluster.object("apps/v1/statefulsets", "ml", child_name("exp", "engine")) is not None
