"""A small JSON client for the few kinds the operator touches, over the official client's transport
(it brings kubeconfig / in-cluster auth), plus the create-or-patch that converges one child.

Patches are JSON merge patches computed three-way (previous desired -> new desired, the previous one
kept in an annotation, as `kubectl apply` does), so fields the operator stopped setting are removed
and fields set by others (controllers' defaults) are left alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client as k8s

from rawmm_operator.spec import API_GROUP

LAST_APPLIED = f"{API_GROUP}/last-applied"


@dataclass(frozen=True)
class Kind:
    group_version: str  # "v1", "apps/v1", ...
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        root = "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"
        path = f"{root}/namespaces/{quote(namespace)}/{self.plural}"
        if name is not None:
            path += f"/{quote(name)}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


KINDS: dict[str, Kind] = {
    "PersistentVolumeClaim": Kind("v1", "persistentvolumeclaims"),
    "ConfigMap": Kind("v1", "configmaps"),
    "Service": Kind("v1", "services"),
    "Pod": Kind("v1", "pods"),
    "StatefulSet": Kind("apps/v1", "statefulsets"),
    "Job": Kind("batch/v1", "jobs"),
    "PodMonitor": Kind("monitoring.coreos.com/v1", "podmonitors"),
    "RLRun": Kind(f"{API_GROUP}/v1alpha1", "rlruns"),
}

# What may change on an existing child. Jobs are immutable apart from `suspend`; a claim's class and
# modes are fixed (its size may grow). Everything else converges whole.
MUTABLE_SPEC_FIELDS: dict[str, frozenset[str] | None] = {
    "Job": frozenset({"suspend"}),
    "PersistentVolumeClaim": frozenset({"resources"}),
}


class ApiError(Exception):
    """A Kubernetes API error: `status` is the HTTP status (0 when the server was not reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status == 0 or self.status == 409 or self.status == 429 or self.status >= 500


class KubeApi:
    def __init__(self, api_client: k8s.ApiClient, *, timeout: float = 30.0) -> None:
        self._api = api_client
        self._timeout = timeout

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
    ) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        if query:
            path = f"{path}?{urlencode(query)}"
        method, url, headers, body, _ = self._api.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            response = self._api.call_api(method, url, headers, body, _request_timeout=self._timeout)
            response.read()
        except k8s.ApiException as exc:
            raise ApiError(exc.status or 0, str(exc.reason or exc)) from exc
        except Exception as exc:  # urllib3 connection errors: the server was not reached
            raise ApiError(0, f"{type(exc).__name__}: {exc}") from exc
        if not 200 <= response.status < 300:
            raise ApiError(response.status, _error_message(response.data))
        return json.loads(response.data) if response.data else None

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", KINDS[kind].path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        items = self._request("GET", KINDS[kind].path(namespace), query={"labelSelector": selector})["items"]
        # Match here too: not every server (or emulator) honours the selector.
        return [
            i
            for i in items
            if all(i.get("metadata", {}).get("labels", {}).get(k) == v for k, v in labels.items())
        ]

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        return self._request("POST", KINDS[manifest["kind"]].path(meta["namespace"]), body=manifest)

    def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        path = KINDS[kind].path(namespace, name, subresource)
        return self._request("PATCH", path, body=patch, content_type="application/merge-patch+json")


def _error_message(data: bytes | None) -> str:
    try:
        return json.loads(data or b"{}").get("message") or "request failed"
    except (ValueError, AttributeError):
        return (data or b"").decode(errors="replace")[:200]


_ABSENT = object()


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key, _ABSENT)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif before != value:
            patch[key] = value
    return patch


def _restrict_spec(kind: str, patch: dict[str, Any]) -> dict[str, Any]:
    allowed = MUTABLE_SPEC_FIELDS.get(kind)
    if allowed is None or "spec" not in patch:
        return patch
    spec = {k: v for k, v in patch["spec"].items() if k in allowed}
    rest = {k: v for k, v in patch.items() if k != "spec"}
    return {**rest, "spec": spec} if spec else rest


def _last_applied(live: dict[str, Any]) -> dict[str, Any]:
    text = live.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED)
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def _with_last_applied(manifest: dict[str, Any]) -> dict[str, Any]:
    meta = manifest["metadata"]
    annotations = {
        **meta.get("annotations", {}),
        LAST_APPLIED: json.dumps(manifest, sort_keys=True, separators=(",", ":")),
    }
    return {**manifest, "metadata": {**meta, "annotations": annotations}}


@dataclass(frozen=True)
class Applied:
    object: dict[str, Any]
    action: str  # "created", "patched" or "unchanged"


def apply(api: KubeApi, manifest: dict[str, Any], live: dict[str, Any] | None) -> Applied:
    """Converge one child to `manifest`, given its live state (None = absent)."""
    desired = _with_last_applied(manifest)
    if live is None:
        return Applied(api.create(desired), "created")
    previous = _last_applied(live)
    # An object without our annotation (made by hand, or adopted) gets every desired field merged in.
    old = _with_last_applied(previous) if previous else {}
    patch = _restrict_spec(manifest["kind"], merge_patch(old, desired))
    if not patch:
        return Applied(live, "unchanged")
    meta = manifest["metadata"]
    return Applied(api.patch(manifest["kind"], meta["namespace"], meta["name"], patch), "patched")
