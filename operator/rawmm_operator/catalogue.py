"""The children of an RLRun, declared once: what each is, when it exists, and how the reconciler and the
status treat it. `reconcile.py` iterates this table to build, apply, prune and observe the children;
adding a child is one entry here (and a builder in `rawmm_operator.children`).

A run goes through three stages (`Stage`): active; finished (Succeeded or Failed: its engines stay at 0
replicas, releasing their accelerators, and its Jobs' pods stay, stopped in place, for their logs); expired
(`ttlSecondsAfterFinished` passed: only its volume stays).
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from rawmm.config import RunConfig
from rawmm_operator.children.config import build_config_map, build_weights_secret
from rawmm_operator.children.engines import (
    build_engine_headless_service,
    build_engine_service,
    build_engine_statefulset,
    engine_replicas,
)
from rawmm_operator.children.jobs import (
    build_gc_job,
    build_orchestrator_job,
    build_trainer_job,
    build_trainer_service,
)
from rawmm_operator.children.monitoring import DEFAULT_POD_MONITOR, PodMonitorSettings, build_pod_monitor
from rawmm_operator.children.offload import build_offload_claim
from rawmm_operator.names import Child as NameKey
from rawmm_operator.names import child_name
from rawmm_operator.objects import Manifest, RunRef, claim_name
from rawmm_operator.spec import RLRunSpec, run_config
from rawmm_operator.status import ObservedAs

Stage = Literal["active", "finished", "expired"]
EVERY_STAGE: frozenset[Stage] = frozenset(get_args(Stage))
UNTIL_EXPIRED: frozenset[Stage] = frozenset({"active", "finished"})
ACTIVE: frozenset[Stage] = frozenset({"active"})
FINISHED: frozenset[Stage] = frozenset({"finished"})


@dataclass(frozen=True)
class Build:
    """What a builder gets: the run, its spec, the stage it is in, the operator's PodMonitor settings."""

    run: RunRef
    spec: RLRunSpec
    stage: Stage
    pod_monitor: PodMonitorSettings

    @functools.cached_property
    def config(self) -> RunConfig:
        """The run config its pods read (derived once per build, only for the children that need it)."""
        return run_config(self.run.name, self.run.namespace, self.spec, uid=self.run.uid)


def _always(_: Build) -> bool:
    return True


def _always_on(_: PodMonitorSettings) -> bool:
    return True


@dataclass(frozen=True)
class Child:
    """One child of a run. Applied children are server-side applied every pass in their `stages`;
    `created_once` ones are created and never written again."""

    kind: str
    key: NameKey  # its name, through `rawmm_operator.names`
    build: Callable[[Build], Manifest]
    stages: frozenset[Stage]  # where it exists
    wanted: Callable[[Build], bool] = _always  # whether the run's spec asks for it at all
    # Deleted once no longer built; a kind is pruned when any child of it is (never the volume: the data).
    pruned: bool = True
    # Stages where it is no longer applied but left, suspended, for its logs and counts (Jobs only).
    left_suspended: frozenset[Stage] = frozenset()
    # Created once, never rewritten nor listed (the operator may not list Secrets); deleted by name when
    # the run leaves `stages`.
    created_once: bool = False
    # Its API may not be served (a CRD of another operator): skipped and reported, never a rejection.
    optional_api: bool = False
    # Whether the operator's installation makes it at all; when it does not, its kind is never listed
    # (the chart then grants no right to).
    enabled: Callable[[PodMonitorSettings], bool] = _always_on
    # The `Observed` field the status reads it as, if any.
    observed_as: ObservedAs | None = None
    # Its name when the spec may choose it (a claim the user brought); else `names.child_name`.
    named: Callable[[RunRef, RLRunSpec], str] | None = None

    def name(self, run: RunRef, spec: RLRunSpec) -> str:
        return self.named(run, spec) if self.named else child_name(run.name, self.key)

    def exists(self, build: Build) -> bool:
        """Whether the run has this child now."""
        return build.stage in self.stages and self.enabled(build.pod_monitor) and self.wanted(build)


CATALOGUE: tuple[Child, ...] = (
    Child(
        "PersistentVolumeClaim",
        "offload",
        lambda b: build_offload_claim(b.run, b.spec),
        stages=EVERY_STAGE,
        wanted=lambda b: b.spec.offload.existing_claim is None,
        pruned=False,
        observed_as="claim",
        named=claim_name,
    ),
    Child(
        "Secret",
        "weights",
        lambda b: build_weights_secret(b.run, secrets.token_urlsafe(32)),
        stages=UNTIL_EXPIRED,
        created_once=True,
    ),
    Child("ConfigMap", "config", lambda b: build_config_map(b.run, b.config), stages=UNTIL_EXPIRED),
    Child("Service", "engine_headless", lambda b: build_engine_headless_service(b.run), stages=UNTIL_EXPIRED),
    Child("Service", "engine", lambda b: build_engine_service(b.run), stages=UNTIL_EXPIRED),
    Child(
        "StatefulSet",
        "engine",
        lambda b: build_engine_statefulset(
            b.run, b.spec, b.config, replicas=engine_replicas(b.spec, finished=b.stage == "finished")
        ),
        stages=UNTIL_EXPIRED,
        observed_as="engines",
    ),
    Child(
        "Service",
        "trainer",
        lambda b: build_trainer_service(b.run),
        stages=ACTIVE,
        wanted=lambda b: b.spec.trainer.nodes > 1,
    ),
    Child(
        "Job",
        "orchestrator",
        lambda b: build_orchestrator_job(b.run, b.spec, b.config),
        stages=ACTIVE,
        left_suspended=FINISHED,
        observed_as="orchestrator",
    ),
    Child(
        "Job",
        "trainer",
        lambda b: build_trainer_job(b.run, b.spec, b.config),
        stages=ACTIVE,
        left_suspended=FINISHED,
        observed_as="trainer",
    ),
    Child(
        "Job",
        "offload_gc",
        lambda b: build_gc_job(b.run, b.spec, b.config),
        stages=ACTIVE,
        wanted=lambda b: b.spec.offload.retention.enabled,
        left_suspended=FINISHED,
    ),
    Child(
        "PodMonitor",
        "pod_monitor",
        lambda b: build_pod_monitor(b.run, b.pod_monitor),
        stages=UNTIL_EXPIRED,
        wanted=lambda b: b.spec.monitoring.pod_monitor,
        optional_api=True,
        enabled=lambda settings: settings.enabled,
    ),
)


@dataclass(frozen=True)
class Built:
    child: Child
    manifest: Manifest

    @property
    def key(self) -> tuple[str, str]:
        return self.manifest["kind"], self.manifest["metadata"]["name"]


def build(
    run: RunRef, spec: RLRunSpec, *, stage: Stage, pod_monitor: PodMonitorSettings, created_once: bool = False
) -> list[Built]:
    """The run's children that exist now, in catalogue order: the applied ones, or the `created_once`."""
    context = Build(run, spec, stage, pod_monitor)
    return [
        Built(child, child.build(context))
        for child in CATALOGUE
        if child.created_once == created_once and child.exists(context)
    ]


def build_children(
    run: RunRef,
    spec: RLRunSpec,
    *,
    stage: Stage = "active",
    pod_monitor: PodMonitorSettings = DEFAULT_POD_MONITOR,
) -> list[Manifest]:
    """Every child the run should have applied now, in creation order (volume and config before the pods
    that mount them). The weights Secret is not among them: it is created once (`build_weights_secret`)."""
    return [built.manifest for built in build(run, spec, stage=stage, pod_monitor=pod_monitor)]


def pruned_kinds(stage: Stage, pod_monitor: PodMonitorSettings) -> tuple[str, ...]:
    """The kinds whose children of the run are deleted when no longer built, in catalogue order: not those
    left suspended in this stage, nor those the operator's installation does not make."""
    left = set(suspended_kinds(stage))
    kinds = (c.kind for c in CATALOGUE if c.pruned and not c.created_once and c.enabled(pod_monitor))
    return tuple(dict.fromkeys(kind for kind in kinds if kind not in left))


def suspended_kinds(stage: Stage) -> tuple[str, ...]:
    """The kinds whose children are left, suspended, in this stage."""
    return tuple(dict.fromkeys(c.kind for c in CATALOGUE if stage in c.left_suspended))


def removed_once(stage: Stage) -> tuple[Child, ...]:
    """The created-once children deleted by name in this stage (the run left their stages)."""
    return tuple(c for c in CATALOGUE if c.created_once and stage not in c.stages)


def observed() -> tuple[tuple[ObservedAs, Child], ...]:
    """The children the status reads, each with the `Observed` field it is read as, in catalogue order."""
    return tuple((c.observed_as, c) for c in CATALOGUE if c.observed_as is not None)


def gone_in(child: Child, stage: Stage) -> bool:
    """Whether the child is pruned in this stage (neither built nor left): the status sees it as gone."""
    return stage not in child.stages | child.left_suspended
