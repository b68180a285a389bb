"""The example manifests: RLRuns valid against the CRD and the operator's spec model (CEL rules included),
every other object valid Kubernetes, the children the operator builds from them valid too, and only
released rawmm images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import KUBE_VERSIONS, REPO, crd_validator, validate_object

EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def rlruns(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in documents(path) if doc["kind"] == "RLRun"]


def operator_children(run: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator's builders make of an RLRun."""
    from rawmm_operator.catalogue import build_children
    from rawmm_operator.objects import RunRef
    from rawmm_operator.reconcile import parse_spec

    ref = RunRef(name=run["metadata"]["name"], namespace="ml-research", uid="0000-example")
    return build_children(ref, parse_spec(ref.name, run["spec"]))


def test_the_examples_the_issue_asks_for_exist() -> None:
    runs = {path.stem: rlruns(path) for path in EXAMPLES}
    (gpu,) = runs["qwen3-vl-gpu"]
    assert gpu["spec"]["model"]["preset"] == "qwen3_vl" and gpu["spec"]["inference"]["gpus"] >= 1
    assert (
        gpu["spec"]["offload"]["accessMode"] == "ReadWriteMany" and gpu["spec"]["offload"]["storageClassName"]
    )
    (cpu,) = runs["tiny-cpu"]
    assert cpu["spec"]["inference"]["gpus"] == 0 and cpu["spec"]["trainer"]["gpusPerNode"] == 0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rlruns_validate_against_the_crd_schema_and_the_spec_model(path: Path) -> None:
    from rawmm_operator.crd import crd_manifest
    from rawmm_operator.reconcile import parse_spec

    validator = crd_validator(crd_manifest())
    for run in rlruns(path):
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(run)]
        assert not errors, errors
        parse_spec(run["metadata"]["name"], run["spec"])


def test_the_crd_schema_validator_rejects_what_the_api_server_would() -> None:
    from rawmm_operator.crd import crd_manifest

    validator = crd_validator(crd_manifest())
    (run,) = rlruns(REPO / "manifests" / "examples" / "tiny-cpu.yaml")
    assert validator.is_valid(run)
    misspelt = {**run, "spec": {**run["spec"], "inferance": {}}}
    negative = {**run, "spec": {**run["spec"], "inference": {**run["spec"]["inference"], "replicas": 0}}}
    bad_policy = {**run, "spec": {**run["spec"], "trainer": {"missingImagePolicy": "ignore"}}}
    for bad in (misspelt, negative, bad_policy):
        assert not validator.is_valid(bad)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_other_objects_and_the_operators_children_validate_strictly(path: Path, kube_version: str) -> None:
    for doc in documents(path):
        for obj in operator_children(doc) if doc["kind"] == "RLRun" else [doc]:
            validate_object(obj, kube_version)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_use_released_rawmm_images(path: Path) -> None:
    import rawmm

    objects = [
        obj
        for doc in documents(path)
        for obj in (operator_children(doc) if doc["kind"] == "RLRun" else [doc])
    ]
    pods = [obj["spec"]["template"] for obj in objects if "template" in obj.get("spec", {})]
    images = [container["image"] for pod in pods for container in pod["spec"]["containers"]]
    assert images
    for image in images:
        repository, tag = image.rsplit(":", 1)
        assert repository in {f"ghcr.io/rawmm/rawmm-{c}" for c in ("inference", "trainer")}, image
        assert tag == rawmm.__version__, image
