"""The catalogue declares every child once (`rawmm_operator.catalogue`): what the reconciler builds, prunes,
leaves and observes follows from its entries, so a new child is one entry."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import get_args

import pytest
from kube.emulator import Cluster, emulated_cluster
from operator_samples import ISSUE_EXAMPLE, MULTI_NODE, RLRUNS_URL, merged, rlrun

from rawmm_operator import catalogue
from rawmm_operator.catalogue import CATALOGUE, Child, build, build_children, pruned_kinds, suspended_kinds
from rawmm_operator.children.monitoring import PodMonitorSettings
from rawmm_operator.kube import KubeApi
from rawmm_operator.objects import Manifest, RunRef, metadata
from rawmm_operator.reconcile import Reconciler
from rawmm_operator.spec import parse_spec
from rawmm_operator.status import Observed, ObservedAs

RUN = RunRef(name="exp", namespace="ml", uid="u-1")
EVERYTHING = merged(MULTI_NODE, {"offload": {"retention": {"enabled": True}}})


def test_each_child_is_declared_once() -> None:
    keys = [(child.kind, child.key) for child in CATALOGUE]
    assert len(keys) == len(set(keys))


def test_the_status_reads_each_of_its_children_from_exactly_one_entry() -> None:
    # What the pass derives besides the children it reads: the claim's name and event, pods, a kept claim's conflict.
    derived = {"claim_name", "claim_event", "pods", "claim_conflict"}
    fields = {f.name for f in dataclasses.fields(Observed)} - derived
    assert set(get_args(ObservedAs)) == fields
    read = [role for role, _ in catalogue.observed()]
    assert sorted(read) == sorted(fields)


def test_only_jobs_are_left_suspended() -> None:
    assert {child.kind for child in CATALOGUE if child.left_suspended} == {"Job"}


@pytest.mark.parametrize("stage", ["active", "finished", "expired"])
def test_every_built_child_has_its_entrys_kind_and_name(stage: catalogue.Stage) -> None:
    spec = parse_spec("exp", EVERYTHING)
    for created_once in (False, True):
        for built in build(
            RUN, spec, stage=stage, pod_monitor=PodMonitorSettings(), created_once=created_once
        ):
            assert built.key == (built.child.kind, built.child.name(RUN, spec))
            assert built.child.created_once is created_once


def test_the_weights_secret_is_created_once_never_applied() -> None:
    spec = parse_spec("exp", EVERYTHING)
    once = build(RUN, spec, stage="active", pod_monitor=PodMonitorSettings(), created_once=True)
    assert [b.key for b in once] == [("Secret", "exp-weights")]
    assert all(m["kind"] != "Secret" for m in build_children(RUN, spec))
    assert build(RUN, spec, stage="expired", pod_monitor=PodMonitorSettings(), created_once=True) == []
    assert [c.key for c in catalogue.removed_once("expired")] == ["weights"]
    assert catalogue.removed_once("finished") == ()


def test_which_kinds_are_pruned_and_left_in_each_stage() -> None:
    on, off = PodMonitorSettings(), PodMonitorSettings(enabled=False)
    assert pruned_kinds("active", on) == ("ConfigMap", "Service", "StatefulSet", "Job", "PodMonitor")
    assert pruned_kinds("expired", on) == ("ConfigMap", "Service", "StatefulSet", "Job", "PodMonitor")
    # a finished run's Jobs stay for their logs, suspended
    assert pruned_kinds("finished", on) == ("ConfigMap", "Service", "StatefulSet", "PodMonitor")
    assert suspended_kinds("finished") == ("Job",)
    assert suspended_kinds("active") == suspended_kinds("expired") == ()
    # without PodMonitors the chart grants no right to list them
    assert pruned_kinds("active", off) == ("ConfigMap", "Service", "StatefulSet", "Job")


def test_a_finished_or_expired_run_observes_its_jobs_as_the_catalogue_says() -> None:
    observed = dict(catalogue.observed())
    assert not catalogue.gone_in(observed["trainer"], "finished")  # left, suspended: still read
    assert catalogue.gone_in(observed["trainer"], "expired")
    assert catalogue.gone_in(observed["engines"], "expired")
    assert not catalogue.gone_in(observed["claim"], "expired")  # the volume stays


def test_a_claim_the_user_brought_is_observed_but_not_built() -> None:
    spec = parse_spec("exp", merged(ISSUE_EXAMPLE, {"offload": {"existingClaim": "theirs"}}))
    observed = dict(catalogue.observed())
    assert observed["claim"].name(RUN, spec) == "theirs"
    assert all(m["kind"] != "PersistentVolumeClaim" for m in build_children(RUN, spec))


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as running:
        yield running


def build_extra(build: catalogue.Build) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(build.run, "exp-extra", "extra")}


@pytest.mark.cluster
async def test_a_new_child_is_one_entry(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry the reconciler has never heard of is applied, then pruned once it is no longer wanted."""
    wanted = {"extra": True}
    extra = Child(
        "ConfigMap",
        "config",
        build_extra,
        stages=catalogue.UNTIL_EXPIRED,
        wanted=lambda _: wanted["extra"],
        named=lambda run, _: f"{run.name}-extra",
    )
    monkeypatch.setattr(catalogue, "CATALOGUE", (*CATALOGUE, extra))
    response = await cluster.emulator.post(RLRUNS_URL, json=rlrun("exp", ISSUE_EXAMPLE))
    assert response.status < 300, await response.text()
    reconciler = Reconciler(KubeApi(cluster.api_client()), progress_interval=3600)
    outcome = await asyncio.to_thread(reconciler.reconcile, "ml", "exp")
    assert outcome is not None and outcome.actions["ConfigMap/exp-extra"] == "created"
    assert cluster.object("v1/configmaps", "ml", "exp-extra") is not None
    wanted["extra"] = False
    outcome = await asyncio.to_thread(reconciler.reconcile, "ml", "exp")
    assert outcome is not None and outcome.actions["ConfigMap/exp-extra"] == "deleted"
    assert cluster.object("v1/configmaps", "ml", "exp-extra") is None
    assert cluster.object("v1/configmaps", "ml", "exp-config") is not None  # the run's own stays
