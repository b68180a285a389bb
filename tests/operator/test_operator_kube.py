from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kube.emulator import Cluster, emulated_cluster
from operator_samples import ISSUE_EXAMPLE, rlrun

from rawmm_operator.catalogue import build_children
from rawmm_operator.kube import ApiError, KubeApi, merge_patch
from rawmm_operator.objects import RunRef
from rawmm_operator.spec import parse_spec

pytestmark = pytest.mark.cluster


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as running:
        yield running


@pytest.fixture
async def run(cluster: Cluster) -> RunRef:
    """The owner of the children (the emulator collects children whose owner does not exist)."""
    response = await cluster.emulator.post(
        "/apis/rawmm.dev/v1alpha1/namespaces/ml/rlruns", json=rlrun("exp", ISSUE_EXAMPLE)
    )
    body = await response.json()
    return RunRef(name="exp", namespace="ml", uid=body["metadata"]["uid"])


@pytest.fixture
def api(cluster: Cluster) -> KubeApi:
    return KubeApi(cluster.api_client())


def child(run: RunRef, kind: str, name: str, spec: dict[str, Any] = ISSUE_EXAMPLE) -> dict[str, Any]:
    (manifest,) = [
        m
        for m in build_children(run, parse_spec(run.name, spec))
        if (m["kind"], m["metadata"]["name"]) == (kind, name)
    ]
    return manifest


@pytest.mark.parametrize(
    ("old", "new", "patch"),
    [
        ({"a": 1}, {"a": 1}, {}),
        ({"a": 1, "b": 2}, {"a": 1}, {"b": None}),
        ({"a": {"x": 1, "y": 2}}, {"a": {"x": 1, "y": 3}}, {"a": {"y": 3}}),
        ({"a": [1, 2]}, {"a": [1]}, {"a": [1]}),
        ({"a": {"x": 1}}, {"a": 5}, {"a": 5}),
        ({}, {"a": {"x": 1}}, {"a": {"x": 1}}),
    ],
)
def test_merge_patch(old: dict, new: dict, patch: dict) -> None:
    assert merge_patch(old, new) == patch


async def test_api_errors(cluster: Cluster, api: KubeApi, run: RunRef) -> None:
    assert await asyncio.to_thread(api.get, "ConfigMap", "ml", "absent") is None
    config_map = child(run, "ConfigMap", "exp-config")
    await asyncio.to_thread(api.create, config_map)
    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(api.create, config_map)
    assert info.value.status == 409 and info.value.transient
    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(api.patch, "ConfigMap", "ml", "absent", {"data": {}})
    assert info.value.status == 404 and not info.value.transient
    unreachable = KubeApi(Cluster(cluster.emulator, "http://127.0.0.1:9").api_client(), timeout=2)
    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(unreachable.get, "ConfigMap", "ml", "x")
    assert info.value.status == 0 and info.value.transient


async def test_list_matches_labels_even_if_the_server_does_not(
    cluster: Cluster, api: KubeApi, run: RunRef
) -> None:
    for manifest in build_children(run, parse_spec(run.name, ISSUE_EXAMPLE)):
        await asyncio.to_thread(api.create, manifest)
    other = child(run, "ConfigMap", "exp-config")
    other["metadata"] = {**other["metadata"], "name": "unrelated", "labels": {"app": "x"}}
    await asyncio.to_thread(api.create, other)
    services = await asyncio.to_thread(api.list, "Service", "ml", {"rawmm.dev/run": "exp"})
    assert sorted(s["metadata"]["name"] for s in services) == ["exp-engine", "exp-engine-headless"]
    config_maps = await asyncio.to_thread(api.list, "ConfigMap", "ml", {"rawmm.dev/run": "exp"})
    assert [c["metadata"]["name"] for c in config_maps] == ["exp-config"]
