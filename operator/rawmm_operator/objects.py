"""What every child of an RLRun carries: the run it is built for, its labels, its owner reference.

Every child is labelled with its run and component and owned by the RLRun (garbage collected with it),
except a PVC kept by `retainOnDelete` and a claim the user brought.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rawmm_operator.names import child_name
from rawmm_operator.spec import API_GROUP, API_VERSION, KIND, RLRunSpec

RUN_LABEL = f"{API_GROUP}/run"
COMPONENT_LABEL = "app.kubernetes.io/component"
# On a claim that outlives its run (`retainOnDelete`): the uid of the RLRun that last applied it, which tells
# an earlier run's claim from this run's (creation times have whole seconds only).
RUN_UID_ANNOTATION = f"{API_GROUP}/run-uid"
# Kueue admits a Job that carries this label; copied from the RLRun to its Jobs.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

Manifest = dict[str, Any]


@dataclass(frozen=True)
class RunRef:
    name: str
    namespace: str
    uid: str
    queue_name: str | None = None  # the RLRun's Kueue queue label, if any


def run_ref(metadata: dict[str, Any], *, namespace: str, uid: str) -> RunRef:
    """The RunRef of the RLRun with ``metadata`` in ``namespace``: its name and its Kueue queue label."""
    queue = (metadata.get("labels") or {}).get(QUEUE_LABEL)
    return RunRef(name=metadata["name"], namespace=namespace, uid=uid, queue_name=queue)


def claim_name(run: RunRef, spec: RLRunSpec) -> str:
    """The offload volume's claim: the one the spec names, else the run's own."""
    return spec.offload.existing_claim or child_name(run.name, "offload")


def labels(run: RunRef, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "rawmm",
        "app.kubernetes.io/instance": run.name,
        "app.kubernetes.io/managed-by": "rawmm-operator",
        COMPONENT_LABEL: component,
        RUN_LABEL: run.name,
    }


def selector(run: RunRef, component: str) -> dict[str, str]:
    return {RUN_LABEL: run.name, COMPONENT_LABEL: component}


def owner_reference(run: RunRef) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": run.name,
        "uid": run.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(run: RunRef, name: str, component: str, *, owned: bool = True) -> dict[str, Any]:
    """A child's metadata: in the run's namespace, labelled, and (unless it outlives the run) owned."""
    meta: dict[str, Any] = {"name": name, "namespace": run.namespace, "labels": labels(run, component)}
    if owned:
        meta["ownerReferences"] = [owner_reference(run)]
    return meta


def owned_by(child: dict[str, Any], run: RunRef) -> bool:
    """Whether the live `child` belongs to this very run (not to an earlier RLRun of the same name)."""
    return any(ref.get("uid") == run.uid for ref in child.get("metadata", {}).get("ownerReferences") or [])
