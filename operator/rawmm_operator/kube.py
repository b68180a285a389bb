"""A small JSON client for the few kinds the operator touches, over the official client's transport
(it brings kubeconfig / in-cluster auth), plus the apply that converges one child.

Children are written with server-side apply under the field manager `rawmm-operator`, forced: the
server reverts drift on every field the operator sets, removes fields it stopped setting, and leaves
fields owned by others (controllers' defaults, Kueue's `suspend`) alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client as k8s

from rawmm_operator.spec import API_GROUP

FIELD_MANAGER = "rawmm-operator"


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
    "Secret": Kind("v1", "secrets"),
    "Event": Kind("v1", "events"),
    "StatefulSet": Kind("apps/v1", "statefulsets"),
    "Job": Kind("batch/v1", "jobs"),
    "PodMonitor": Kind("monitoring.coreos.com/v1", "podmonitors"),
    "RLRun": Kind(f"{API_GROUP}/v1alpha1", "rlruns"),
}


class ApiError(Exception):
    """A Kubernetes API error: `status` is the HTTP status (0 when the server was not reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status

    @property
    def transient(self) -> bool:
        # Server-side apply answers a list it cannot build a patch from (two env entries of one name) with a
        # 500: the object's fault, not the server's, so no retry will ever pass.
        if "failed to create typed patch object" in str(self):
            return False
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

    def list(
        self, kind: str, namespace: str, labels: dict[str, str], *, fields: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())}
        if fields:
            query["fieldSelector"] = ",".join(f"{k}={v}" for k, v in fields.items())
        items = self._request("GET", KINDS[kind].path(namespace), query=query)["items"]
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

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of `manifest` (creates it when absent), taking over conflicting fields."""
        meta = manifest["metadata"]
        return self._request(
            "PATCH",
            KINDS[manifest["kind"]].path(meta["namespace"], meta["name"]),
            # JSON is YAML; a string body goes out as it is.
            body=json.dumps(manifest, sort_keys=True),
            content_type="application/apply-patch+yaml",
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
        )

    def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> None:
        """Delete in the foreground (the object stays, marked, until its dependents are gone); `uid`
        makes sure it is the object that was read. Absent already counts as done."""
        body: dict[str, Any] = {"propagationPolicy": "Foreground"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            self._request("DELETE", KINDS[kind].path(namespace, name), body=body)
        except ApiError as exc:
            if exc.status != 404:
                raise


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


@dataclass(frozen=True)
class Applied:
    object: dict[str, Any]
    action: str  # "created", "patched" or "unchanged"


def apply(api: KubeApi, manifest: dict[str, Any], live: dict[str, Any] | None) -> Applied:
    """Converge one child to `manifest`, given its live state (None = absent). A no-op apply leaves the
    resourceVersion as it was: that is how "unchanged" is told from "patched"."""
    applied = api.apply(manifest)
    if live is None:
        return Applied(applied, "created")
    before = live.get("metadata", {}).get("resourceVersion")
    changed = applied.get("metadata", {}).get("resourceVersion") != before
    return Applied(applied, "patched" if changed else "unchanged")
