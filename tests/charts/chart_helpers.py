"""Helpers of the chart tests: the chart's generator module (it renders the chart) and strict validators.

A module of its own (not conftest.py): test modules import it by a name no other test folder uses."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
VALUES_DIR = Path(__file__).parent / "values"
MONITORING_SCHEMAS = Path(__file__).parent / "schemas"
# Kubernetes versions every rendered object must validate against: the oldest the chart supports in
# tests and the newest schema kubernetes-validate ships.
KUBE_VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())


def values_files() -> list[Path]:
    return sorted(VALUES_DIR.glob("*.yaml"))


def read_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


@cache
def _monitoring_validator(kind: str) -> jsonschema.Validator:
    schema = json.loads((MONITORING_SCHEMAS / f"{kind.lower()}-monitoring-v1.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def validate_object(body: dict[str, Any], kube_version: str) -> None:
    """Strict validation: Kubernetes kinds with kubernetes-validate, prometheus-operator kinds with the
    checked-in schemas (tests/charts/schemas). Raises on an invalid object or an unknown kind."""
    if body["apiVersion"].startswith("monitoring.coreos.com/"):
        errors = sorted(_monitoring_validator(body["kind"]).iter_errors(body), key=lambda e: list(e.path))
        if errors:
            raise AssertionError(
                f"{body['kind']}/{body['metadata']['name']}: "
                + "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)
            )
        return
    kubernetes_validate.validate(body, kube_version, strict=True)


def crd_validator(crd: dict[str, Any]) -> jsonschema.Validator:
    """A validator of custom resources against the CRD's openAPIV3Schema, strict the way
    `kubectl apply --validate=strict` is: unknown fields are errors (the API server would otherwise drop
    them silently). CEL rules are not evaluated here."""
    (version,) = crd["spec"]["versions"]
    # OpenAPI v3 schemas use draft 4's boolean exclusiveMinimum/exclusiveMaximum.
    return jsonschema.Draft4Validator(_strict_openapi(version["schema"]["openAPIV3Schema"]))


def _strict_openapi(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
    if "properties" in node:
        out["properties"] = {name: _strict_openapi(sub) for name, sub in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict_openapi(node["additionalProperties"])
    if "items" in node:
        out["items"] = _strict_openapi(node["items"])
    return out
