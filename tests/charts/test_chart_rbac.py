"""The chart's RBAC against the real operator: kopf and the reconciler run on the API emulator (kmock) through
an RLRun's life, every request they make is checked against the rendered (Cluster)Roles and bindings, and
every rule the chart grants is either used there or listed below with the reason it cannot be observed."""

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

# Granted but not exercised on the emulator, each for a reason.
UNOBSERVED_GRANTS = {
    # kopf discovers CRDs at run time; the emulator's resources are fixed (scanning is disabled there).
    ("list", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("watch", "apiextensions.k8s.io", "customresourcedefinitions"),
    # kopf follows which watched namespaces exist (namespaced installs); also scanning.
    ("list", "", "namespaces"),
    ("watch", "", "namespaces"),
    # blockOwnerDeletion on children needs it where OwnerReferencesPermissionEnforcement is enabled.
    ("update", "rawmm.dev", "rlruns/finalizers"),
    # Children are written with server-side apply: a PATCH, which the server authorizes as `create`
    # too when the object is absent (the emulator sees only the PATCH).
    ("create", "", "configmaps"),
    ("create", "", "persistentvolumeclaims"),
    ("create", "", "services"),
    ("create", "apps", "statefulsets"),
    ("create", "batch", "jobs"),
    ("create", "monitoring.coreos.com", "podmonitors"),
    # Pruning (a child no longer built), replacing a Job whose template changed, and deleting an expired
    # run's children: not in this scenario (tests/operator/test_real_operator_* do them on a real server).
    ("delete", "", "configmaps"),
    ("delete", "", "services"),
    ("delete", "", "secrets"),
    ("delete", "apps", "statefulsets"),
    ("delete", "batch", "jobs"),
    ("delete", "monitoring.coreos.com", "podmonitors"),
}


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
def lives() -> tuple[set[Access], set[Access]]:
    """What a cluster-wide and a namespaced operator requested (run side by side: kopf's shutdown is slow)."""

    from kube.emulator import emulated_cluster

    async def both() -> list[set[Access]]:
        # Nested, not gathered, contexts: kmock's servers patch a resolver that must unwind in order.
        async with emulated_cluster() as first, emulated_cluster() as second:
            return await asyncio.gather(
                _run_life(first, namespaces=[]), _run_life(second, namespaces=[RUN_NAMESPACE])
            )

    cluster_wide, namespaced = asyncio.run(both())
    return cluster_wide, namespaced


@pytest.fixture(scope="module")
def cluster_wide_accesses(lives: tuple[set[Access], set[Access]]) -> set[Access]:
    return lives[0]


@pytest.fixture(scope="module")
def namespaced_accesses(lives: tuple[set[Access], set[Access]]) -> set[Access]:
    return lives[1]


@pytest.mark.slow
def test_default_install_allows_every_request_of_the_operator(cluster_wide_accesses: set[Access]) -> None:
    allows = chart_permissions(None)
    denied = sorted(a for a in cluster_wide_accesses if not allows(a))
    assert not denied, denied
    # The scenario exercised the operator for real: it watched cluster-wide and wrote children.
    assert Access("watch", "rawmm.dev", "rlruns", None) in cluster_wide_accesses
    assert Access("patch", "apps", "statefulsets", RUN_NAMESPACE) in cluster_wide_accesses


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


@pytest.mark.slow
def test_every_grant_is_used_or_explained(cluster_wide_accesses: set[Access]) -> None:
    used = {(a.verb, a.group, a.resource) for a in cluster_wide_accesses}
    unused = granted(None) - used - UNOBSERVED_GRANTS
    assert not unused, f"granted but never requested: {sorted(unused)}"
    # And the explanations stay true: nothing listed as unobservable is in fact observed.
    assert not (UNOBSERVED_GRANTS & used), sorted(UNOBSERVED_GRANTS & used)


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
