"""The RLRun status: its model (also the CRD's status schema) and the pure function that derives it
from the observed children, plus the transitions worth an event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Provisioning", "Running", "Succeeded", "Failed", "Suspended"]
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})
INVALID_SPEC = "InvalidSpec"
# Container waiting reasons of a pod that will not start by itself: the kubelet's words for what blocks it.
STUCK_CONTAINER_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)
UNSCHEDULABLE = "Unschedulable"
# Condition reasons that are a warning event when they appear.
WARNING_REASONS = frozenset({"Failed", "ChildRejected", UNSCHEDULABLE, *STUCK_CONTAINER_REASONS})
TIMESTAMP: dict[str, Any] = {"format": "date-time"}


class StatusModel(BaseModel):
    # Lenient on read (a status written by another operator version must not break reconciliation).
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Condition(StatusModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str = Field(json_schema_extra=TIMESTAMP)
    observed_generation: int | None = None


class ReplicaSummary(StatusModel):
    replicas: int = 0
    ready_replicas: int = 0


class JobSummary(StatusModel):
    state: Literal["NotCreated", "Pending", "Running", "Suspended", "Stopped", "Succeeded", "Failed"] = (
        "NotCreated"
    )
    active: int = 0
    succeeded: int = 0
    failed: int = 0


class OffloadUsage(StatusModel):
    """The volume's usage as the run's GC process (`offload.retention`) last reported it."""

    bytes: int | None = Field(default=None, description="bytes of the stored images after the last GC pass")
    files: int | None = Field(default=None, description="stored images after the last GC pass")
    gc_freed_bytes: int | None = Field(default=None, description="bytes the GC passes freed so far")
    last_gc_time: str | None = Field(default=None, json_schema_extra=TIMESTAMP)


class OffloadSummary(OffloadUsage):
    claim_name: str
    phase: str | None = None


class RLRunStatus(StatusModel):
    phase: Phase = "Pending"
    observed_generation: int | None = None
    reason: str | None = Field(default=None, description="why the run failed")
    message: str | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    offload: OffloadSummary | None = None
    engines: ReplicaSummary | None = None
    orchestrator: JobSummary | None = None
    trainer: JobSummary | None = None
    trainer_step: int | None = Field(default=None, description="newest step the trainer reported")
    cache_hit_rate: float | None = Field(
        default=None, description="engines' materialize-cache hit rate between the two latest scrapes"
    )
    start_time: str | None = Field(default=None, json_schema_extra=TIMESTAMP)
    completion_time: str | None = Field(default=None, json_schema_extra=TIMESTAMP)

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


# The children the status reads (`Observed`'s fields): `rawmm_operator.catalogue` says which child is which.
ObservedAs = Literal["claim", "engines", "orchestrator", "trainer"]


Pods = tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Observed:
    """The children the status is derived from, as read from the API (None = not found), and the pods of
    each: a role runs only when its pods do, and they say why they do not."""

    claim_name: str
    claim: dict[str, Any] | None
    engines: dict[str, Any] | None
    orchestrator: dict[str, Any] | None
    trainer: dict[str, Any] | None
    claim_event: str | None = None  # the newest event of a claim that is not bound ("reason: message")
    pods: dict[ObservedAs, Pods] = field(default_factory=dict)
    # Why the claim of the run's name is not the one its spec asks for (one an earlier run left), if it is not.
    claim_conflict: str | None = None

    def pods_of(self, role: ObservedAs) -> Pods:
        return self.pods.get(role, ())


@dataclass(frozen=True)
class Applying:
    """How the last pass went with the children: what the server refused (child -> its message), the
    Jobs being replaced, and children left out because their API is not served."""

    rejected: dict[str, str] = field(default_factory=dict)
    recreating: tuple[str, ...] = ()
    unavailable: tuple[str, ...] = ()


@dataclass(frozen=True)
class Progress:
    """What the run's pods report about themselves (None = not known)."""

    trainer_step: int | None = None
    cache_hit_rate: float | None = None
    offload_usage: OffloadUsage | None = None


@dataclass(frozen=True)
class Transition:
    """A change worth a Kubernetes event on the RLRun."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def pod_problem(pods: Pods) -> tuple[str, str] | None:
    """(reason, message) of the first pod (by name) that cannot run by itself, in the scheduler's or the
    kubelet's words: not schedulable, or a container stuck waiting (image pull, config, crash loop)."""
    for pod in sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("name"))):
        name = (pod.get("metadata") or {}).get("name")
        status = pod.get("status") or {}
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                reason = condition.get("reason") or UNSCHEDULABLE
                return reason, f"pod {name}: {condition.get('message') or reason}"
        containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        for container in containers:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_CONTAINER_REASONS:
                detail = f": {waiting['message']}" if waiting.get("message") else ""
                return waiting[
                    "reason"
                ], f"pod {name} container {container.get('name')}: {waiting['reason']}{detail}"
    return None


# The active deadline the operator gives a failed run's surviving pods so their kubelet stops them in place
# (their logs stay): 1 s from their start, already past. Pod templates never carry one, so a pod with it was
# stopped by the operator.
STOP_DEADLINE_SECONDS = 1
# After a success, what a surviving pod (the orchestrator telling the engines about the last checkpoint, the
# offload GC's last pass) gets to finish on its own before its kubelet stops it; it keeps its logs either way.
FINISH_GRACE_SECONDS = 120
# Marks a pod given that grace: should its kubelet stop it at the deadline, the failure is the operator's.
FINISH_GRACE_ANNOTATION = "rawmm.dev/finish-grace-seconds"


def stopped_by_operator(pods: Pods) -> bool:
    return any((pod.get("spec") or {}).get("activeDeadlineSeconds") == STOP_DEADLINE_SECONDS for pod in pods)


def given_grace(pods: Pods) -> bool:
    return any(
        FINISH_GRACE_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {}) for pod in pods
    )


def _pods_in(pods: Pods, *phases: str) -> int:
    """How many of `pods` are in one of `phases` (a pod being deleted counts in none)."""
    return sum(
        1
        for pod in pods
        if (pod.get("status") or {}).get("phase") in phases
        and not (pod.get("metadata") or {}).get("deletionTimestamp")
    )


def job_summary(job: dict[str, Any] | None, pods: Pods = ()) -> tuple[JobSummary, str, str]:
    """The Job's state, the reason a condition gives for it, and a message (the failure message when it
    failed). Running only when as many of its pods run as it runs at once; otherwise the pods' own
    problem when they have one."""
    if job is None:
        return JobSummary(), "NotCreated", "not created yet"
    status = job.get("status") or {}
    spec = job.get("spec") or {}
    counts = {key: int(status.get(key) or 0) for key in ("active", "succeeded", "failed")}
    true_conditions = {
        c.get("type"): c.get("message") or c.get("reason") or ""
        for c in status.get("conditions") or []
        if c.get("status") == "True"
    }
    if stopped_by_operator(pods):  # its own outcome (a failure, once its pods are stopped) is ours, not its
        return JobSummary(state="Stopped", **counts), "Stopped", "stopped"
    # The Job controller says FailureTarget / SuccessCriteriaMet first, Failed / Complete once its pods are
    # gone: the outcome is known at the first (a finished run never goes back to waiting in between).
    for condition in ("Failed", "FailureTarget"):
        if condition in true_conditions:
            if given_grace(pods):  # still running when its grace ran out: stopped by the operator
                return JobSummary(state="Stopped", **counts), "Stopped", "stopped"
            return (
                JobSummary(state="Failed", **counts),
                "Failed",
                true_conditions[condition] or "the Job failed",
            )
    completions = int(spec.get("completions") or 1)
    # A pod that ended is counted by the Job controller a moment later: its pods say it first.
    succeeded = max(counts["succeeded"], _pods_in(pods, "Succeeded"))
    if {"Complete", "SuccessCriteriaMet"} & set(true_conditions) or succeeded >= completions:
        return JobSummary(state="Succeeded", **counts), "Succeeded", "completed"
    if spec.get("suspend"):
        return JobSummary(state="Suspended", **counts), "Suspended", "suspended"
    at_once = min(int(spec.get("parallelism") or 1), completions - succeeded)
    running, ended = _pods_in(pods, "Running"), _pods_in(pods, "Succeeded", "Failed")
    if counts["active"] and running >= at_once:
        return JobSummary(state="Running", **counts), "Running", f"{running} pod(s) running"
    if counts["active"] and running + ended >= at_once and not _pods_in(pods, "Pending"):
        # Its pods ran and some ended; the Job controller has yet to say what that means (a retry, a failure).
        message = f"{running} pod(s) running, {ended} ended"
        return JobSummary(state="Running", **counts), "Running", message
    if (problem := pod_problem(pods)) is not None:
        return JobSummary(state="Pending", **counts), *problem
    if counts["active"]:
        message = f"{running}/{at_once} pod(s) running; waiting for the others to start"
        return JobSummary(state="Pending", **counts), "Pending", message
    return JobSummary(state="Pending", **counts), "Pending", "waiting for its pods"


def trainer_succeeded(job: dict[str, Any] | None, pods: Pods = ()) -> bool:
    """Whether the trainer Job succeeded, read as the run's status reads it (its pods first)."""
    return job_summary(job, pods)[0].state == "Succeeded"


class _Check(NamedTuple):
    type: str
    ok: bool
    reason: str
    message: str


def _reconciled(applying: Applying) -> _Check:
    if applying.rejected:
        detail = "; ".join(f"{child}: {message}" for child, message in sorted(applying.rejected.items()))
        return _Check("Reconciled", False, "ChildRejected", f"the API server rejected {detail} (retrying)")
    if applying.recreating:
        jobs = ", ".join(applying.recreating)
        return _Check("Reconciled", False, "RecreatingJobs", f"replacing {jobs}: its spec changed")
    if applying.unavailable:
        missing = ", ".join(applying.unavailable)
        return _Check("Reconciled", True, "ApiUnavailable", f"{missing} skipped: its API is not served")
    return _Check("Reconciled", True, "Applied", "every child is as the spec says")


def _ending(
    orchestrator: JobSummary,
    orchestrator_message: str,
    trainer: JobSummary,
    trainer_message: str,
    deadline_exceeded: bool,
) -> tuple[_Check, bool]:
    """The `Failed` condition and whether the trainer succeeded: what ends a run."""
    succeeded = trainer.state == "Succeeded"
    if trainer.state == "Failed":
        failed = _Check("Failed", True, "TrainerFailed", trainer_message)
    elif deadline_exceeded and not succeeded:
        failed = _Check(
            "Failed", True, "DeadlineExceeded", "the run did not finish within activeDeadlineSeconds"
        )
    elif orchestrator.state == "Failed":
        failed = _Check("Failed", True, "OrchestratorFailed", orchestrator_message)
    else:
        failed = _Check("Failed", False, "NoFailure", "")
    return failed, succeeded


def _sticky(previous: RLRunStatus) -> bool:
    """A terminal phase stays, unless it was an invalid spec (fixed by the next generation)."""
    return previous.phase in TERMINAL_PHASES and previous.reason != INVALID_SPEC


def run_ended(*, observed: Observed, previous: RLRunStatus, deadline_exceeded: bool) -> bool:
    """Whether `derive_status` would give a terminal phase (Succeeded or Failed) for these children:
    what the reconciler needs before it converges them, without deriving the whole status twice."""
    orchestrator, _, orchestrator_message = job_summary(
        observed.orchestrator, observed.pods_of("orchestrator")
    )
    trainer, _, trainer_message = job_summary(observed.trainer, observed.pods_of("trainer"))
    failed, succeeded = _ending(
        orchestrator, orchestrator_message, trainer, trainer_message, deadline_exceeded
    )
    return _sticky(previous) or failed.ok or succeeded


def derive_status(
    *,
    suspend: bool,
    generation: int | None,
    observed: Observed,
    previous: RLRunStatus,
    now: str,
    progress: Progress | None = None,
    applying: Applying = Applying(),
    deadline_exceeded: bool = False,
    steps: int | None = None,
) -> RLRunStatus:
    """The whole status from the observed children (and, when given, what the pods reported; else
    the previous values; a trainer that succeeded finished all `steps`). Terminal phases stick; transition times are kept for conditions whose
    status did not change. A rejected child is a condition, never a failed run."""
    progress = progress or Progress(previous.trainer_step, previous.cache_hit_rate)
    # The volume's usage: as the GC process reported it now, else as the previous status had it.
    usage_fields = set(OffloadUsage.model_fields)
    usage = progress.offload_usage or OffloadUsage.model_validate(
        previous.offload.model_dump(include=usage_fields) if previous.offload else {}
    )
    claim_phase = ((observed.claim or {}).get("status") or {}).get("phase")
    volume_ok = claim_phase == "Bound" and observed.claim_conflict is None
    if observed.claim_conflict is not None:
        volume = _Check("OffloadVolumeReady", False, "ClaimConflict", observed.claim_conflict)
    elif observed.claim is None:
        volume = _Check(
            "OffloadVolumeReady",
            False,
            "ClaimNotFound",
            f"PersistentVolumeClaim {observed.claim_name} not found",
        )
    else:
        # A claim that does not bind says why only in its events (no storage class, no provisioner...).
        hint = f": {observed.claim_event}" if observed.claim_event and not volume_ok else ""
        volume = _Check(
            "OffloadVolumeReady",
            volume_ok,
            "Bound" if volume_ok else "ClaimPending",
            f"PersistentVolumeClaim {observed.claim_name} is {claim_phase or 'Pending'}{hint}",
        )

    engines_spec = (observed.engines or {}).get("spec") or {}
    engines_status = (observed.engines or {}).get("status") or {}
    engines = ReplicaSummary(
        replicas=int(engines_spec.get("replicas") or 0),
        ready_replicas=int(engines_status.get("readyReplicas") or 0),
    )
    if observed.engines is None:
        inference = _Check("InferenceReady", False, "NotCreated", "the engine StatefulSet does not exist yet")
    elif engines.replicas == 0:
        reason = "Suspended" if suspend else "ScaledDown"
        inference = _Check("InferenceReady", False, reason, "the engines are scaled to 0")
    else:
        ready = engines.ready_replicas >= engines.replicas
        counted = f"{engines.ready_replicas}/{engines.replicas} engine replicas ready"
        problem = None if ready else pod_problem(observed.pods_of("engines"))
        inference = _Check(
            "InferenceReady",
            ready,
            "AllReplicasReady" if ready else problem[0] if problem else "ReplicasNotReady",
            f"{counted}: {problem[1]}" if problem else counted,
        )

    orchestrator, orchestrator_reason, orchestrator_message = job_summary(
        observed.orchestrator, observed.pods_of("orchestrator")
    )
    trainer, trainer_reason, trainer_message = job_summary(observed.trainer, observed.pods_of("trainer"))
    failed, succeeded = _ending(
        orchestrator, orchestrator_message, trainer, trainer_message, deadline_exceeded
    )
    if failed.ok or succeeded or _sticky(previous):
        # The operator itself stops (after a failure: pods kept for their logs) or suspends (their pods
        # released) a finished run's surviving Jobs.
        ended = f"the run {'failed' if failed.ok else 'ended'}"
        messages = {
            "Suspended": f"suspended by the operator: {ended}",
            "Stopped": f"stopped by the operator: {ended}; its pods are kept for their logs",
        }
        orchestrator_message = messages.get(orchestrator.state, orchestrator_message)
        trainer_message = messages.get(trainer.state, trainer_message)
    elif not suspend:
        # Suspended by someone else: a queue (Kueue) admits the Job by unsuspending it; the operator waits.
        external = "suspended by another controller: waiting for admission (e.g. a Kueue queue)"
        orchestrator_message = external if orchestrator.state == "Suspended" else orchestrator_message
        trainer_message = external if trainer.state == "Suspended" else trainer_message
    orchestrating = _Check(
        "OrchestratorRunning", orchestrator.state == "Running", orchestrator_reason, orchestrator_message
    )
    training = _Check("TrainerRunning", trainer.state == "Running", trainer_reason, trainer_message)
    complete = _Check(
        "Complete",
        succeeded,
        "TrainerSucceeded" if succeeded else "InProgress",
        "the trainer finished every step" if succeeded else "the run has not finished",
    )

    sticky = _sticky(previous)
    if sticky:
        phase: Phase = previous.phase
    elif failed.ok:
        phase = "Failed"
    elif succeeded:
        phase = "Succeeded"
    elif suspend:
        phase = "Suspended"
    elif volume_ok and inference.ok and training.ok:
        phase = "Running"
    elif volume_ok:
        phase = "Provisioning"
    else:
        phase = "Pending"

    status = RLRunStatus(
        phase=phase,
        observed_generation=generation,
        offload=OffloadSummary(claim_name=observed.claim_name, phase=claim_phase, **usage.model_dump()),
        engines=engines,
        orchestrator=orchestrator,
        trainer=trainer,
        # The trainer exits 0 only after its last step; its pod, gone by then, may not have been read since.
        trainer_step=steps if succeeded and steps is not None else progress.trainer_step,
        cache_hit_rate=progress.cache_hit_rate,
        start_time=previous.start_time or now,
        completion_time=previous.completion_time or (now if phase in TERMINAL_PHASES else None),
        conditions=[
            _merge_Check(previous, *c, generation=generation, now=now)
            for c in (volume, inference, orchestrating, training, complete, failed, _reconciled(applying))
        ],
    )
    if sticky:
        status.reason, status.message = previous.reason, previous.message
    elif phase == "Failed":
        status.reason, status.message = failed.reason, failed.message
    return status


def invalid_spec_status(
    *, generation: int | None, message: str, previous: RLRunStatus, now: str
) -> RLRunStatus:
    """The run cannot be reconciled until its spec changes; the children are left as they are."""
    status = previous.model_copy(deep=True)
    status.phase = "Failed"
    status.observed_generation = generation
    status.reason, status.message = INVALID_SPEC, message
    others = [c for c in previous.conditions if c.type != "Failed"]
    status.conditions = [
        *others,
        _merge_Check(previous, "Failed", True, INVALID_SPEC, message, generation=generation, now=now),
    ]
    return status


def _merge_Check(
    previous: RLRunStatus,
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: str,
) -> Condition:
    status = "True" if ok else "False"
    before = previous.condition(type_)
    since = before.last_transition_time if before is not None and before.status == status else now
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def transitions(previous: RLRunStatus, current: RLRunStatus) -> list[Transition]:
    """Events for a changed phase and for every condition that changed status or reason."""
    events: list[Transition] = []
    if previous.phase != current.phase or (current.phase == "Failed" and previous.reason != current.reason):
        detail = f": {current.message}" if current.phase == "Failed" and current.message else ""
        events.append(
            Transition(
                "Warning" if current.phase == "Failed" else "Normal",
                current.phase,
                f"phase {previous.phase} -> {current.phase}{detail}",
            )
        )
    for condition in current.conditions:
        before = previous.condition(condition.type)
        if before is not None and (before.status, before.reason) == (condition.status, condition.reason):
            continue
        bad = (
            condition.type == "Failed" and condition.status == "True"
        ) or condition.reason in WARNING_REASONS
        if before is None and (condition.status == "False" or condition.type == "Reconciled") and not bad:
            continue  # on the first pass only what is already true is news (and trouble); the phase says the rest
        events.append(
            Transition(
                "Warning" if bad else "Normal",
                condition.reason,
                f"{condition.type}={condition.status}: {condition.message}".rstrip(": "),
            )
        )
    return events
