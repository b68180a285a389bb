"""The chart's RBAC as rendered: no wildcard or read-secrets grant, PodMonitor rights follow their switch, and
a namespaced install (operator.watchNamespaces) allows every request of an operator watching that namespace,
checked on the API emulator (kmock), which records each request. The default, cluster-wide install is proved
on kube-apiserver with the operator running as the chart's ServiceAccount (no 403, every grant used):
tests/operator/test_real_lifecycle.py."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from chart_generate import load_generate
from chart_helpers import REPO
from kubernetes import client as k8s

generate = load_generate()
RUN_NAMESPACE = "ml-research"
TEST_AGENT = "rawmm-chart-rbac-test"


@dataclass(frozen=True)
class Access:
    verb: str
    group: str
    resource: str  # with "/subresource"
    namespace: str | None  # None: a cluster-scope request (cluster-wide list/watch or a cluster object)


def _verb(method: str, name: str | None, params: dict[str, str]) -> str:
    if method == "GET":
        return "watch" if params.get("watch") in ("true", "1") else ("get" if name else "list")
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]


def operator_accesses(emulator: Any) -> set[Access]:
    """Every request the operator made (the test's own requests carry TEST_AGENT)."""
    accesses = set()
    for request in emulator.served:
        # Discovery (no plural) needs no RBAC: every authenticated user may read the API groups.
        if (
            request.resource is None
            or request.resource.plural is None
            or request.headers.get("User-Agent") == TEST_AGENT
        ):
            continue
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        verb = _verb(str(request.method.value).upper(), request.name, request.params)
        accesses.add(Access(verb, request.resource.group or "", resource, request.namespace))
    return accesses


def _grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (verb, group, resource)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def chart_permissions(values: dict[str, Any] | None) -> Callable[[Access], bool]:
    """Whether the rendered RBAC allows an access to the operator's service account."""
    docs = generate.render_chart(values)
    roles = {doc.name: _grants(doc.body) for doc in docs if doc.kind == "ClusterRole"}
    cluster_wide: set[tuple[str, str, str]] = set()
    per_namespace: dict[str, set[tuple[str, str, str]]] = {}
    for doc in docs:
        if doc.kind == "ClusterRoleBinding":
            cluster_wide |= roles[doc.body["roleRef"]["name"]]
        elif doc.kind == "RoleBinding":
            per_namespace.setdefault(doc.body["metadata"]["namespace"], set()).update(
                roles[doc.body["roleRef"]["name"]]
            )

    def allows(access: Access) -> bool:
        key = (access.verb, access.group, access.resource)
        return key in cluster_wide or key in per_namespace.get(access.namespace or "", set())

    return allows


def granted(values: dict[str, Any] | None) -> set[tuple[str, str, str]]:
    return set().union(
        *(_grants(doc.body) for doc in generate.render_chart(values) if doc.kind == "ClusterRole")
    )


async def _wait_for(condition: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    """Poll an in-process condition (the emulator's state) until it holds."""
    async with asyncio.timeout(timeout):
        while not (result := condition()):
            await asyncio.sleep(0.05)
    assert result, what
    return result


def _example_run() -> dict[str, Any]:
    """The GPU example (it creates every kind of child but a trainer rendezvous Service), on 2 trainer nodes."""
    import yaml

    run = yaml.safe_load((REPO / "manifests" / "examples" / "qwen3-vl-gpu.yaml").read_text())
    run = copy.deepcopy(run)
    run["metadata"]["namespace"] = RUN_NAMESPACE
    run["spec"]["trainer"]["nodes"] = 2
    return run


async def _run_life(cluster: Any, namespaces: list[str]) -> set[Access]:
    """An RLRun's life under the real operator on `cluster`: create, children appear and report status,
    spec change, suspension, deletion. Returns what the operator requested."""
    from kube.emulator import FAST_TIMING, fast_settings

    from rawmm_operator.builders import PodMonitorSettings
    from rawmm_operator.kube import KubeApi
    from rawmm_operator.main import run_operator

    test_client = cluster.api_client()
    test_client.user_agent = TEST_AGENT
    api = KubeApi(test_client)
    stop, ready = asyncio.Event(), asyncio.Event()
    operator_client = cluster.api_client()
    task = asyncio.create_task(
        run_operator(
            operator_client,
            login=cluster.login,
            namespaces=namespaces,
            timing=FAST_TIMING,
            settings=fast_settings(),
            pod_monitor=PodMonitorSettings(enabled=True, labels=(("release", "prometheus"),)),
            stop_flag=stop,
            ready_flag=ready,
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout=30)
        run = _example_run()
        name = run["metadata"]["name"]
        await asyncio.to_thread(api.create, run)
        engines = f"{name}-engine"
        await _wait_for(lambda: cluster.object("apps/v1/statefulsets", RUN_NAMESPACE, engines), "engines")
        await _wait_for(
            lambda: cluster.object("monitoring.coreos.com/v1/podmonitors", RUN_NAMESPACE, name), "monitor"
        )
        await asyncio.to_thread(
            api.patch,
            "StatefulSet",
            RUN_NAMESPACE,
            engines,
            {"status": {"readyReplicas": 2}},
            subresource="status",
        )
        await _wait_for(
            lambda: (cluster.object("rawmm.dev/v1alpha1/rlruns", RUN_NAMESPACE, name) or {}).get("status"),
            "status",
        )
        await asyncio.to_thread(
            api.patch,
            "RLRun",
            RUN_NAMESPACE,
            name,
            {"spec": {"inference": {"materializeCacheSize": "16Gi"}}},
        )

        def cache_rolled() -> bool:
            engine = cluster.object("apps/v1/statefulsets", RUN_NAMESPACE, engines)
            env = engine["spec"]["template"]["spec"]["containers"][0]["env"]
            return {"name": "RAWMM_MATERIALIZE_CACHE_SIZE", "value": "16Gi"} in env

        await _wait_for(cache_rolled, "the cache size change reaches the engines")
        await asyncio.to_thread(api.patch, "RLRun", RUN_NAMESPACE, name, {"spec": {"suspend": True}})
        await _wait_for(
            lambda: (cluster.object("batch/v1/jobs", RUN_NAMESPACE, f"{name}-trainer") or {})["spec"][
                "suspend"
            ],
            "suspending the run suspends its Jobs",
        )
        await asyncio.to_thread(
            k8s.CustomObjectsApi(test_client).delete_namespaced_custom_object,
            "rawmm.dev", "v1alpha1", RUN_NAMESPACE, "rlruns", name,
        )  # fmt: skip
        await _wait_for(
            lambda: cluster.object("rawmm.dev/v1alpha1/rlruns", RUN_NAMESPACE, name) is None,
            "the RLRun is gone (it carries no finalizer)",
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        operator_client.close()
        test_client.close()
    return operator_accesses(cluster.emulator)


@pytest.fixture(scope="module")
def namespaced_accesses() -> set[Access]:
    """What an operator watching one namespace requested."""
    from kube.emulator import emulated_cluster

    async def life() -> set[Access]:
        async with emulated_cluster() as cluster:
            return await _run_life(cluster, namespaces=[RUN_NAMESPACE])

    return asyncio.run(life())


@pytest.mark.slow
def test_namespaced_install_allows_every_request_of_a_namespaced_operator(
    namespaced_accesses: set[Access],
) -> None:
    allows = chart_permissions({"operator": {"watchNamespaces": [RUN_NAMESPACE]}})
    denied = sorted(a for a in namespaced_accesses if not allows(a))
    assert not denied, denied
    assert all(a.namespace == RUN_NAMESPACE for a in namespaced_accesses), (
        "a namespaced operator stays in its namespaces"
    )
    # The same chart denies what the operator would need for another namespace.
    assert not allows(Access("patch", "apps", "statefulsets", "elsewhere"))


def test_no_grant_is_broader_than_named_verbs_on_named_resources() -> None:
    for values in (None, {"operator": {"watchNamespaces": ["a", "b"]}}):
        for verb, group, resource in granted(values):
            assert "*" not in (verb, group, resource)
            assert verb in {"get", "list", "watch", "create", "patch", "update", "delete"}
            assert resource not in {"pods/exec", "serviceaccounts/token"}
            # The run's weights token is created and deleted, never read: no Secret of the cluster is exposed.
            if resource == "secrets":
                assert verb in {"create", "delete"}


def test_pod_monitor_rights_follow_the_pod_monitor_switch() -> None:
    assert ("create", "monitoring.coreos.com", "podmonitors") in granted(None)
    assert not any(
        g[1] == "monitoring.coreos.com" for g in granted({"runs": {"podMonitor": {"enabled": False}}})
    )
