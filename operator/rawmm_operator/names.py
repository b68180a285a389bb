"""The names of an RLRun's children, spelled here and nowhere else: the builders name what they make with
them, the reconciler and the status find the children by them, the engines' URLs and torchrun's
rendezvous address are built from them.
"""

from __future__ import annotations

from typing import Literal

Child = Literal[
    "offload", "config", "weights", "engine", "engine_headless", "orchestrator", "trainer", "offload_gc",
    "pod_monitor",
]  # fmt: skip
# Child -> its name after `<run>-` ("" for the run's own name).
SUFFIXES: dict[Child, str] = {
    "offload": "offload",  # the PersistentVolumeClaim, unless the spec names an existing claim
    "config": "config",  # the ConfigMap holding the run config
    "weights": "weights",  # the Secret holding the engines' weights-update token
    "engine": "engine",  # the StatefulSet (pods `<name>-<i>`) and its Service
    "engine_headless": "engine-headless",  # per-replica DNS names for sticky routing
    "orchestrator": "orchestrator",  # the Job
    "trainer": "trainer",  # the indexed Job, and its headless Service for torchrun's rendezvous
    "offload_gc": "offload-gc",  # the retention Job
    "pod_monitor": "",
}


def child_name(run: str, child: Child) -> str:
    """The name of the run's `child`."""
    suffix = SUFFIXES[child]
    return f"{run}-{suffix}" if suffix else run


def engine_pod(run: str, index: int) -> str:
    """The StatefulSet's pod of replica `index`."""
    return f"{child_name(run, 'engine')}-{index}"
