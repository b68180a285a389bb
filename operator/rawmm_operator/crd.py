"""The RLRun CustomResourceDefinition, generated from the pydantic spec and status models.

Pydantic emits JSON Schema (draft 2020-12); Kubernetes wants a *structural* OpenAPI v3 schema: no
$refs, no nullable unions, free-form maps marked `x-kubernetes-preserve-unknown-fields`, int-or-string
marked as such, boolean exclusive bounds. `structural_schema` does that translation.
`crd_manifest()` is the one source for `manifests/crds/` and the Helm chart.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from rawmm_operator.spec import (
    API_GROUP,
    API_VERSION,
    KIND,
    MAX_RUN_NAME,
    PLURAL,
    RUN_NAME_PATTERN,
    RLRunSpec,
)
from rawmm_operator.status import RLRunStatus

SHORT_NAME = "rlr"
CRD_NAME = f"{PLURAL}.{API_GROUP}"

_DROPPED_KEYS = {"title", "additionalProperties", "$defs"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline a `$ref` (keeping the sibling keys, e.g. a field's description or CEL rules)."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        merged = {**node["allOf"][0], **{k: v for k, v in node.items() if k != "allOf"}}
        return _resolve(merged, defs)
    return node


def structural_schema(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    if "anyOf" in node:
        options = [_resolve(o, defs) for o in node["anyOf"] if o.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            del rest["default"]  # an unset optional field is simply absent
        if len(options) == 1:
            return structural_schema({**options[0], **rest}, defs)
        if sorted(str(o.get("type")) for o in options) == ["integer", "string"]:
            return {**_clean(rest), "x-kubernetes-int-or-string": True}
        raise ValueError(f"no structural form for the union {node['anyOf']}")

    out = _clean(node)
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True

    if node.get("type") == "object":
        properties = node.get("properties")
        extra = node.get("additionalProperties")
        if properties:
            out["properties"] = {name: structural_schema(sub, defs) for name, sub in properties.items()}
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural_schema(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif node.get("type") == "array":
        out["items"] = structural_schema(node["items"], defs)
    return out


def _clean(node: dict[str, Any]) -> dict[str, Any]:
    skipped = _DROPPED_KEYS | {"properties", "items", "exclusiveMinimum", "exclusiveMaximum"}
    return {k: copy.deepcopy(v) for k, v in node.items() if k not in skipped}


def _model_schema(model: type[BaseModel], mode: JsonSchemaMode) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode=mode)
    return structural_schema(schema, schema.get("$defs", {}))


def _filled(schema: dict[str, Any]) -> dict[str, Any]:
    """The value the server stores for an absent object: every property with a default, recursively."""
    value: dict[str, Any] = {}
    for name, sub in schema.get("properties", {}).items():
        if "default" in sub:
            value[name] = copy.deepcopy(sub["default"])
    return value


def _with_default_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """Give every optional object property a default that is the object with its nested defaults applied,
    so the stored spec is complete and CEL rules see every field. (Not `default: {}`: the server checks
    each default against the schema and its CEL rules as written, without applying the nested defaults
    first, so a rule reading `self.engine` would fail on `{}` and the CRD be refused.)"""
    required = set(schema.get("required", []))
    for name, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object" and "properties" in sub:
            _with_default_objects(sub)  # inner objects first: their defaults go into this one's
            if name not in required and "default" not in sub:
                sub["default"] = _filled(sub)
    return schema


def spec_schema() -> dict[str, Any]:
    return _with_default_objects(_model_schema(RLRunSpec, "validation"))


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def status_schema() -> dict[str, Any]:
    # Only the operator writes the status, always whole: defaults there would only mask its bugs.
    return _without_defaults(_model_schema(RLRunStatus, "serialization"))


def crd_manifest() -> dict[str, Any]:
    printer_columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.trainerStep"},
        {"name": "Cache Hit Rate", "type": "number", "format": "float", "jsonPath": ".status.cacheHitRate"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.engines.readyReplicas", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    root = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # The server allows restricting metadata.name: a DNS-1035 label short enough for the children's
            # names (`<run>-engine-headless`), so a name the operator cannot use never gets stored.
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": MAX_RUN_NAME, "pattern": RUN_NAME_PATTERN}
                },
            },
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "rawmm"}},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": [SHORT_NAME],
                "categories": ["rawmm"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `rawmm manifests` from rawmm_operator.spec and .status: do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)
