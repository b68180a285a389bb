"""The offload volume: the PersistentVolumeClaim every pod of the run mounts (unless the spec names one)."""

from __future__ import annotations

from rawmm_operator.objects import Manifest, RunRef, claim_name, metadata
from rawmm_operator.spec import RLRunSpec


def build_offload_claim(run: RunRef, spec: RLRunSpec) -> Manifest:
    """The run's own claim; `retainOnDelete` leaves it unowned, so it outlives the RLRun."""
    offload = spec.offload
    claim: Manifest = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(run, claim_name(run, spec), "offload", owned=not offload.retain_on_delete),
        "spec": {
            "accessModes": [offload.access_mode],
            "resources": {"requests": {"storage": offload.size}},
        },
    }
    if offload.storage_class_name is not None:
        claim["spec"]["storageClassName"] = offload.storage_class_name
    return claim
