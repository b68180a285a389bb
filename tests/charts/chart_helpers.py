"""Helpers of the chart tests: the chart's generator module (it renders the chart) and strict validators.

A module of its own (not conftest.py): test modules import it by a name no other test folder uses."""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
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


def load_generate() -> ModuleType:
    """manifests/generate.py, which renders the chart for the generated files and for these tests."""
    name = "rawmm_chart_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "manifests" / "generate.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is created
        spec.loader.exec_module(module)
    return sys.modules[name]


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
