"""A Kubernetes API for tests and benchmarks: kmock's emulator with the server-side behaviour the
operator relies on, and a helper that runs the real operator (kopf) against it.

kmock 0.8 stores objects as clients send them; a real API server also assigns uid, resourceVersion,
creationTimestamp and generation, fills the namespace from the URL, answers lists with kind and
apiVersion, and garbage-collects objects whose owners are gone. `KubeEmulator` adds exactly that.
Needs the dev extra (kmock).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import attrs
import jsonpatch
import kmock
import kopf
from kmock._internal import dicts as kmock_dicts
from kubernetes import client as k8s

from rawmm_operator.handlers import LoopTiming, operator_settings
from rawmm_operator.main import run_operator
from rawmm_operator.spec import API_GROUP, API_VERSION, KIND, PLURAL

# group/version/plural -> (kind, has a status subresource); kopf also waits to discover the two
# cluster-scoped kinds at the end.
RESOURCES: dict[str, tuple[str, bool]] = {
    f"{API_GROUP}/{API_VERSION}/{PLURAL}": (KIND, True),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True),
    "v1/configmaps": ("ConfigMap", False),
    "v1/services": ("Service", True),
    "v1/pods": ("Pod", True),
    "v1/events": ("Event", False),
    "events.k8s.io/v1/events": ("Event", False),
    "apps/v1/statefulsets": ("StatefulSet", True),
    "batch/v1/jobs": ("Job", True),
    "monitoring.coreos.com/v1/podmonitors": ("PodMonitor", False),
    "v1/namespaces": ("Namespace", True),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", True),
}
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition"}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    # (HTTP method, plural) -> how many of the next such requests fail with 503 (see `fail_next`)
    _failures: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)
    # Every request served, for assertions. kmock's own request list is kept to the requests in flight:
    # its dispatch scans that list on every request, which gets quadratic over a long test or benchmark.
    served: list[kmock.Request] = attrs.field(factory=list, init=False)
    _in_flight: set[int] = attrs.field(factory=set, init=False)

    def fail_next(self, method: str, plural: str, times: int = 1) -> None:
        """Answer the next `times` requests of this method on this resource with 503, storing nothing."""
        self._failures[(method.upper(), plural)] = times

    def declare(self, resources: dict[str, tuple[str, bool]] = RESOURCES) -> None:
        for key, (kind, has_status) in resources.items():
            self.resources[key] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=kind not in CLUSTER_SCOPED,
                verbs=VERBS,
                subresources={"status"} if has_status else set(),
            )

    def _kind(self, resource: Any) -> str | None:
        for key in self.resources:
            if key == resource:
                return self.resources[key].kind
        return None

    async def _handle(self, request: kmock.Request) -> Any:
        self.served.append(request)
        self._in_flight.add(id(request))
        self._requests[:] = [r for r in self._requests if id(r) in self._in_flight]
        try:
            return await self._emulate(request)
        finally:
            self._in_flight.discard(id(request))

    async def _emulate(self, request: kmock.Request) -> Any:
        failure = (str(request.method.value), request.resource.plural if request.resource else "")
        if self._failures.get(failure, 0) > 0:
            self._failures[failure] -= 1
            return await self._render_error(kmock.KubernetesError(status=503, reason="ServiceUnavailable"))
        if request.resource is not None:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._on_create(request)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                self._on_apply_of_absent(request)
                self._on_patch(request)
        try:
            return await super()._handle(request)
        finally:
            if request.resource is not None and request.action in (kmock.action.DELETE, kmock.action.UPDATE):
                await self._collect_garbage()

    def _on_create(self, request: kmock.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if request.namespace:
            meta["namespace"] = request.namespace
        if "name" not in meta and "generateName" in meta:
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self._versions))
        meta.setdefault("creationTimestamp", _now())
        meta["generation"] = 1
        request.data.setdefault("kind", self._kind(request.resource))

    def _on_apply_of_absent(self, request: kmock.Request) -> None:
        """Server-side apply creates an absent object (emulated as create + merge; no field ownership)."""
        key = (request.resource, request.namespace, request.name)
        applying = "apply-patch" in request.headers.get("Content-Type", "")
        if applying and (key not in self.objects or self.objects[key].deleted):
            self._on_create(request)
            self.objects[key] = copy.deepcopy(request.data)

    def _on_patch(self, request: kmock.Request) -> None:
        """Bump resourceVersion (and generation on spec changes); fail a JSON patch's `test` with 422."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        current = self.objects[key].raw
        try:
            patched = kmock_dicts.patch_dict(copy.deepcopy(current), copy.deepcopy(request.data))
        except jsonpatch.JsonPatchTestFailed as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        changes = {"resourceVersion": str(next(self._versions))}
        if request.subresource is None and patched.get("spec") != current.get("spec"):
            changes["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        if isinstance(request.data, dict):
            request.data.setdefault("metadata", {}).update(changes)
        else:  # a JSON patch (kopf's finalizers)
            request.data.extend(
                {"op": "add", "path": f"/metadata/{k}", "value": v} for k, v in changes.items()
            )

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        group = request.resource.group
        payload["apiVersion"] = f"{group}/{request.resource.version}" if group else request.resource.version
        payload["kind"] = f"{self._kind(request.resource)}List"
        return payload

    async def _collect_garbage(self) -> None:
        """Delete objects all of whose owners are gone (cascading), as the garbage collector does."""
        while True:
            async with self._lock:
                alive = {
                    obj.raw.get("metadata", {}).get("uid"): obj
                    for obj in self.objects.values()
                    if not obj.deleted
                }
                orphans = [
                    (key, obj)
                    for key, obj in self.objects.items()
                    if not obj.deleted
                    and (owners := obj.raw.get("metadata", {}).get("ownerReferences"))
                    and not any(owner.get("uid") in alive for owner in owners)
                ]
                for (resource, _, _), obj in orphans:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
            if not orphans:
                return


@dataclass
class Cluster:
    """A running emulator: its URL, an API client for it, and object access for assertions."""

    emulator: KubeEmulator
    url: str

    def api_client(self) -> k8s.ApiClient:
        return k8s.ApiClient(k8s.Configuration(host=self.url))

    def login(self, **_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=self.url)

    def object(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return copy.deepcopy(self.emulator.objects[key].raw)

    def requests(self, method: str) -> list[kmock.Request]:
        """Every request served so far with this HTTP method."""
        return [request for request in self.emulator.served if request.method == method]

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        wanted = kmock.resource(resource)
        return [
            copy.deepcopy(obj.raw)
            for (res, ns, _), obj in self.emulator.objects.items()
            if res == wanted and not obj.deleted and (namespace is None or ns == namespace)
        ]


@contextlib.asynccontextmanager
async def emulated_cluster() -> AsyncIterator[Cluster]:
    async with KubeEmulator() as emulator, kmock.Server(emulator) as server:
        emulator.declare()
        yield Cluster(emulator, str(server.url).rstrip("/"))


def fast_settings() -> kopf.OperatorSettings:
    """kopf settings for an in-process API: no waiting on network-scale timeouts."""
    settings = operator_settings()
    settings.posting.level = 0
    settings.scanning.disabled = True  # the emulator's resources are fixed: no CRD watching
    settings.watching.reconnect_backoff = 0.05
    settings.networking.error_backoffs = (0.1, 0.2, 0.5)
    settings.persistence.consistency_timeout = 1.0
    settings.queueing.idle_timeout = 0.5
    settings.queueing.exit_timeout = 1.0
    settings.background.instant_exit_timeout = 1.0
    return settings


FAST_TIMING = LoopTiming(resync_seconds=2.0, error_backoffs=(0.1, 0.2, 0.5), progress_seconds=0.0)


@contextlib.asynccontextmanager
async def running_operator(cluster: Cluster, *, timing: LoopTiming = FAST_TIMING) -> AsyncIterator[None]:
    """The real operator, cluster-wide, until the block exits.

    It runs in a thread with its own event loop, as in production: on exit kopf cancels every task
    created in its loop since it started, which would include the emulator's connection handlers.
    """
    stop, ready = threading.Event(), threading.Event()
    failures: list[BaseException] = []
    api_client = cluster.api_client()

    def run() -> None:
        try:
            asyncio.run(
                run_operator(
                    api_client,
                    login=cluster.login,
                    timing=timing,
                    settings=fast_settings(),
                    stop_flag=stop,
                    ready_flag=ready,
                )
            )
        except BaseException as exc:  # handed to the test below
            failures.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="rawmm-operator", daemon=True)
    thread.start()
    try:
        if not await asyncio.to_thread(ready.wait, 30) or failures:
            raise RuntimeError("the operator did not start") from (failures[0] if failures else None)
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
        api_client.close()
    if thread.is_alive():
        raise RuntimeError("the operator did not stop within 30 s")
    if failures:
        raise RuntimeError("the operator failed") from failures[0]
