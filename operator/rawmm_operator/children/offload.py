"""The offload volume: the PersistentVolumeClaim every pod of the run mounts (unless the spec names one)."""

from __future__ import annotations

from rawmm_operator.objects import RUN_UID_ANNOTATION, Manifest, RunRef, claim_name, metadata
from rawmm_operator.spec import RLRunSpec


def build_offload_claim(run: RunRef, spec: RLRunSpec) -> Manifest:
    """The run's own claim; `retainOnDelete` leaves it unowned, so it outlives the RLRun, and names the run
    in an annotation instead."""
    offload = spec.offload
    meta = metadata(run, claim_name(run, spec), "offload", owned=not offload.retain_on_delete)
    if offload.retain_on_delete:
        meta["annotations"] = {RUN_UID_ANNOTATION: run.uid}
    claim: Manifest = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta,
        "spec": {
            "accessModes": [offload.access_mode],
            "resources": {"requests": {"storage": offload.size}},
        },
    }
    if offload.storage_class_name is not None:
        claim["spec"]["storageClassName"] = offload.storage_class_name
    return claim
