"""One reconciliation pass of one RLRun: read it, converge its children, derive and write its status.

Synchronous and free of kopf, so it can be driven by the operator's per-run loop and by tests alike.

Which children a run has in each stage, and how each is treated, is declared in `catalogue.py`; this module
iterates it. Children are server-side applied every pass (drift on the operator's fields is reverted) and
those no longer built are deleted (pruned). A child the server refuses (quota, LimitRange, webhook, an
immutable field) becomes the `Reconciled` condition and a retry, never a failed run. A Job whose
template hash changed is deleted in the foreground and created anew once its pods are gone.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from rawmm_operator import catalogue
from rawmm_operator.catalogue import Built, Stage
from rawmm_operator.children.monitoring import DEFAULT_POD_MONITOR, PodMonitorSettings
from rawmm_operator.kube import ApiError, KubeApi, apply, merge_patch
from rawmm_operator.names import child_name
from rawmm_operator.objects import RUN_LABEL, RUN_UID_ANNOTATION, RunRef, owned_by, run_ref
from rawmm_operator.pods import job_finished, job_suspend, template_changed
from rawmm_operator.progress import ProgressReader
from rawmm_operator.spec import KIND, InvalidSpec, RLRunSpec, parse_spec
from rawmm_operator.status import (
    FINISH_GRACE_ANNOTATION,
    FINISH_GRACE_SECONDS,
    INVALID_SPEC,
    STOP_DEADLINE_SECONDS,
    TERMINAL_PHASES,
    Applying,
    Observed,
    ObservedAs,
    Pods,
    Progress,
    RLRunStatus,
    Transition,
    derive_status,
    invalid_spec_status,
    run_ended,
    trainer_succeeded,
    transitions,
)

TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


@dataclass
class Outcome:
    body: dict[str, Any]
    status: RLRunStatus
    transitions: list[Transition]
    actions: dict[str, str] = field(
        default_factory=dict
    )  # "Kind/name" -> created | patched | unchanged | deleted
    invalid: str | None = None
    applying: Applying = field(default_factory=Applying)
    retry_soon: bool = False  # a Job changed under the pass (409): apply it again shortly


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime(TIMESTAMP_FORMAT)


def seconds_between(earlier: str, later: str) -> float:
    parse = datetime.datetime.strptime
    return (parse(later, TIMESTAMP_FORMAT) - parse(earlier, TIMESTAMP_FORMAT)).total_seconds()


def _read_status(body: dict[str, Any]) -> RLRunStatus:
    try:
        return RLRunStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return RLRunStatus()  # unreadable (another version's?): derive afresh


def newest_event(events: list[dict[str, Any]]) -> str | None:
    """ "reason: message" of the newest event, or None."""

    def when(event: dict[str, Any]) -> str:
        return (
            event.get("lastTimestamp")
            or event.get("eventTime")
            or event.get("metadata", {}).get("creationTimestamp")
            or ""
        )

    if not events:
        return None
    event = max(events, key=when)
    return f"{event.get('reason', '')}: {event.get('message', '')}".strip(": ")


def stage_of(spec: RLRunSpec, ended: bool, stored: RLRunStatus, now: str) -> Stage:
    """Where the run is: `ended` is whether this pass sees it Succeeded or Failed, `stored` the status
    written before. A run expires only once its terminal phase is stored: the pass that deletes its
    children must not derive the phase from their absence."""
    if not ended:
        return "active"
    ttl = spec.ttl_seconds_after_finished
    recorded = stored.phase in TERMINAL_PHASES and stored.reason != INVALID_SPEC and stored.completion_time
    if ttl is not None and recorded and seconds_between(stored.completion_time or now, now) >= ttl:
        return "expired"
    return "finished"


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        *,
        pod_monitor: PodMonitorSettings = DEFAULT_POD_MONITOR,
        progress_interval: float = 15.0,
    ) -> None:
        self.api = api
        self.pod_monitor = pod_monitor
        self.progress = ProgressReader(api)
        # Scrape a run's pods at most this often: the hit rate is taken between two scrapes.
        self.progress_interval = progress_interval
        self._last_progress: dict[tuple[str, str], float] = {}
        # (namespace, run, uid, kind, name) of the created-once children (the weights Secret) made, and of
        # those deleted once the run left their stages.
        self._created: set[tuple[str, str, str, str, str]] = set()
        self._removed: set[tuple[str, str, str, str, str]] = set()

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is remembered about a run that is gone (or no longer ours)."""
        self._last_progress.pop((namespace, name), None)
        self.progress.forget(namespace, name)
        self._created = {key for key in self._created if key[:2] != (namespace, name)}
        self._removed = {key for key in self._removed if key[:2] != (namespace, name)}

    def _read_progress(self, run: RunRef, previous: RLRunStatus, *, last: bool = False) -> Progress | None:
        """What the run's pods report, at most once per `progress_interval` unless it is the `last` read."""
        key = (run.namespace, run.name)
        moment = time.monotonic()
        if not last and moment - self._last_progress.get(key, -math.inf) < self.progress_interval:
            return None
        self._last_progress[key] = moment
        return self.progress.read(
            run.namespace, run.name, Progress(previous.trainer_step, previous.cache_hit_rate), last=last
        )

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """Converge the run; None when it is gone or being deleted. Raises `ApiError` on API failures
        worth a retry (unreachable server, conflicts, 5xx)."""
        body = self.api.get(KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        meta = body["metadata"]
        generation = meta.get("generation")
        previous = _read_status(body)
        now = utc_now()
        try:
            spec = parse_spec(name, body.get("spec"))
            run = run_ref(meta, namespace=namespace, uid=meta["uid"])
            return self._converge(body, run, spec, generation, previous, now)
        except InvalidSpec as exc:
            status = invalid_spec_status(generation=generation, message=str(exc), previous=previous, now=now)
            self._write_status(body, status)
            return Outcome(body, status, transitions(previous, status), invalid=str(exc))

    def _claim_event(self, run: RunRef, claim: str, live: dict[str, Any] | None) -> str | None:
        if live is None or (live.get("status") or {}).get("phase") == "Bound":
            return None
        involved = {"involvedObject.kind": "PersistentVolumeClaim", "involvedObject.name": claim}
        events = self.api.list("Event", run.namespace, {}, fields=involved)
        # Matched here too, like labels in `KubeApi.list`.
        about = [
            e
            for e in events
            if {k.split(".")[1]: v for k, v in involved.items()}.items()
            <= (e.get("involvedObject") or {}).items()
        ]
        return newest_event(about)

    def _create_once(self, run: RunRef, spec: RLRunSpec, stage: Stage, outcome: Outcome) -> None:
        """Create the run's created-once children (its weights token): never rewritten (pods read it at
        start) nor read (the operator has no right to read Secrets)."""
        for built in catalogue.build(run, spec, stage=stage, pod_monitor=self.pod_monitor, created_once=True):
            key = (run.namespace, run.name, run.uid, *built.key)
            if key in self._created:
                continue
            try:
                self.api.create(built.manifest)
                outcome.actions["/".join(built.key)] = "created"
            except ApiError as exc:
                if exc.status != 409:  # 409: it exists already
                    raise
            self._created.add(key)

    def _converge(
        self,
        body: dict[str, Any],
        run: RunRef,
        spec: RLRunSpec,
        generation: int | None,
        previous: RLRunStatus,
        now: str,
    ) -> Outcome:
        observed_keys = {role: (c.kind, c.name(run, spec)) for role, c in catalogue.observed()}
        live: dict[tuple[str, str], dict[str, Any] | None] = {
            key: self.api.get(key[0], run.namespace, key[1]) for key in observed_keys.values()
        }
        claim = observed_keys["claim"][1]
        claim_event = self._claim_event(run, claim, live[observed_keys["claim"]])
        deadline = spec.active_deadline_seconds
        exceeded = bool(
            deadline and previous.start_time and seconds_between(previous.start_time, now) >= deadline
        )

        # Read once per pass: a role is Running only when its pods are, and they say why they are not.
        pods = self.api.list("Pod", run.namespace, {RUN_LABEL: run.name})

        conflict: list[str] = []  # set once the pass has tried to apply the claim

        def observed() -> Observed:
            children = {role: live[key] for role, key in observed_keys.items()}
            owned: dict[ObservedAs, Pods] = {role: _pods_of(child, pods) for role, child in children.items()}
            return Observed(
                claim_name=claim,
                claim_event=claim_event,
                pods=owned,
                claim_conflict=conflict[0] if conflict else None,
                **children,
            )

        ended = run_ended(observed=observed(), previous=previous, deadline_exceeded=exceeded)
        stage = stage_of(spec, ended, previous, now)
        # The pass that ends the run reads its pods once more before it scales the engines down: a short run
        # can end between two reads, and its status would keep the counters of the one before.
        final = ended and previous.phase not in TERMINAL_PHASES
        last_progress = self._read_progress(run, previous, last=True) if final else None
        outcome = Outcome(body, previous, [])  # its status and transitions once derived, below
        self._create_once(run, spec, stage, outcome)
        built = catalogue.build(run, spec, stage=stage, pod_monitor=self.pod_monitor)
        outcome.applying = self._apply(run, built, live, outcome)
        created = body["metadata"].get("creationTimestamp")
        claim_now = live[observed_keys["claim"]]
        conflict += filter(None, [_claim_conflict(run, created, spec, claim_now, outcome.applying)])
        for kind in catalogue.suspended_kinds(stage):
            self._release(run, kind, outcome)
        self._remove_once(run, spec, stage)
        self._prune(run, stage, {b.key for b in built}, outcome)
        for role, child in catalogue.observed():
            if catalogue.gone_in(child, stage):  # deleted in the foreground this pass: gone for the status
                live[observed_keys[role]] = None

        status = derive_status(
            suspend=spec.suspend,
            generation=generation,
            observed=observed(),
            previous=previous,
            now=now,
            progress=last_progress or (self._read_progress(run, previous) if stage == "active" else None),
            steps=spec.trainer.steps,
            applying=outcome.applying,
            deadline_exceeded=exceeded,
        )
        self._write_status(body, status)
        outcome.status = status
        outcome.transitions = [*_child_transitions(outcome.actions), *transitions(previous, status)]
        return outcome

    def _apply(
        self,
        run: RunRef,
        built: list[Built],
        live: dict[tuple[str, str], dict[str, Any] | None],
        outcome: Outcome,
    ) -> Applying:
        """Server-side apply every built child (`live` is updated); what the server refused, the Jobs
        being replaced and the children whose API is not served are how it went."""
        rejected: dict[str, str] = {}
        recreating: list[str] = []
        unavailable: list[str] = []
        for child in built:
            manifest, key = child.manifest, child.key
            name = "/".join(key)
            if key not in live:
                live[key] = self.api.get(key[0], run.namespace, key[1])
            current = live[key]
            is_job = child.child.kind == "Job"
            if is_job and current is not None:
                replacing = self._replacing(run, manifest, current)
                if replacing:
                    recreating.append(name)
                    if replacing == "deleted":
                        outcome.actions[name] = "deleted"
                    continue
                manifest["spec"]["suspend"] = job_suspend(manifest, current)
                # A precondition: if a queue changed the Job since it was read, the server says 409 (retried).
                manifest["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            try:
                applied = apply(self.api, manifest, current)
            except ApiError as exc:
                if child.child.optional_api and exc.status == 404:
                    unavailable.append(name)
                    continue
                if exc.status == 409 and is_job:
                    # The Job changed since it was read (its controller, a queue): the rest of the pass
                    # and the status go on; the Job is applied again on the next, soon.
                    outcome.retry_soon = True
                    continue
                if exc.transient:
                    raise
                rejected[name] = str(exc)
                continue
            live[key] = applied.object
            outcome.actions[name] = applied.action
        return Applying(rejected=rejected, recreating=tuple(recreating), unavailable=tuple(unavailable))

    def _replacing(self, run: RunRef, manifest: dict[str, Any], live: dict[str, Any]) -> str | None:
        """None for a Job that stays; "deleting" for one on its way out, "deleted" for one deleted now
        because what it runs changed (a Job's template is immutable). Foreground deletion keeps the Job
        until its pods are gone, so the new Job never runs beside the old one."""
        meta = live["metadata"]
        if meta.get("deletionTimestamp"):
            return "deleting"
        if not template_changed(manifest, live):
            return None
        self.api.delete("Job", run.namespace, meta["name"], uid=meta.get("uid"))
        return "deleted"

    def _release(self, run: RunRef, kind: str, outcome: Outcome) -> None:
        """A finished run's surviving Jobs (the trainer failed, the orchestrator still waits or makes its last
        weights sync, the offload GC watches), every one of the run's. Their running pods are never deleted
        (suspending a Job would, and the logs of what the other roles saw with them): each gets an active
        deadline, which its kubelet acts on, stopping the pod in place with its logs. After a failure the
        deadline has passed already (the Job then fails: backoffLimit 0); after a success it leaves the pod
        `FINISH_GRACE_SECONDS` to end on its own. Only a Job with no started pod is suspended."""
        jobs = [
            job for job in self.api.list(kind, run.namespace, {RUN_LABEL: run.name}) if owned_by(job, run)
        ]
        trainer = child_name(run.name, "trainer")
        pods = self.api.list("Pod", run.namespace, {RUN_LABEL: run.name})
        # As the status reads it: the trainer's pod Succeeded may come before the Job's Complete.
        failure = not any(
            job["metadata"]["name"] == trainer and trainer_succeeded(job, _pods_of(job, pods)) for job in jobs
        )
        now = utc_now()
        for job in jobs:
            if job_finished(job) or (job.get("spec") or {}).get("suspend"):
                continue
            name = job["metadata"]["name"]
            started = [p for p in _pods_of(job, pods) if (p.get("status") or {}).get("startTime")]
            if not started:
                self.api.patch(kind, run.namespace, name, {"spec": {"suspend": True}})
                outcome.actions[f"{kind}/{name}"] = "suspended"
                continue
            for pod in started:
                if _pod_ended(pod) or (pod.get("spec") or {}).get("activeDeadlineSeconds") is not None:
                    continue  # a pod's deadline may only come closer: the first one set stands
                if failure:
                    stop: dict[str, Any] = {"spec": {"activeDeadlineSeconds": STOP_DEADLINE_SECONDS}}
                else:  # its age so far (never below 0, whatever the clocks say), plus the grace
                    age = max(int(seconds_between(pod["status"]["startTime"], now)), 0)
                    stop = {
                        "metadata": {"annotations": {FINISH_GRACE_ANNOTATION: str(FINISH_GRACE_SECONDS)}},
                        "spec": {"activeDeadlineSeconds": age + FINISH_GRACE_SECONDS},
                    }
                self.api.patch("Pod", run.namespace, pod["metadata"]["name"], stop)
                outcome.actions[f"{kind}/{name}"] = "stopped" if failure else "finishing"

    def _remove_once(self, run: RunRef, spec: RLRunSpec, stage: Stage) -> None:
        """Delete, by name (the operator may not list Secrets), the created-once children of a run that
        left their stages: the weights Secret goes only with an expired run."""
        for child in catalogue.removed_once(stage):
            name = child.name(run, spec)
            key = (run.namespace, run.name, run.uid, child.kind, name)
            if key in self._removed:
                continue
            self.api.delete(child.kind, run.namespace, name)
            self._created.discard(key)
            self._removed.add(key)

    def _prune(self, run: RunRef, stage: Stage, built: set[tuple[str, str]], outcome: Outcome) -> None:
        """Delete the run's children of the pruned kinds that are no longer built (a finished run's Jobs
        stay, with their pods' logs)."""
        for kind in catalogue.pruned_kinds(stage, self.pod_monitor):
            try:
                children = self.api.list(kind, run.namespace, {RUN_LABEL: run.name})
            except ApiError as exc:
                if exc.status == 404:  # the kind is not served (no PodMonitor CRD)
                    continue
                raise
            for child in children:
                name = child["metadata"]["name"]
                if (kind, name) in built or not owned_by(child, run):
                    continue
                self.api.delete(kind, run.namespace, name, uid=child["metadata"].get("uid"))
                outcome.actions[f"{kind}/{name}"] = "deleted"

    def _write_status(self, body: dict[str, Any], status: RLRunStatus) -> None:
        patch = merge_patch(body.get("status") or {}, status.dump())
        if patch:
            meta = body["metadata"]
            self.api.patch(KIND, meta["namespace"], meta["name"], {"status": patch}, subresource="status")


def _claim_conflict(
    run: RunRef, created: str | None, spec: RLRunSpec, claim: dict[str, Any] | None, applying: Applying
) -> str | None:
    """Why the claim of the run's name, refused by the server, is not the one the spec asks for: a claim an
    earlier run of this name left (`retainOnDelete`) keeps its class, modes and size, and the server refuses
    to change them ("spec is immutable"), so without this the run would stay on it, saying only that."""
    if claim is None or spec.offload.existing_claim is not None or owned_by(claim, run):
        return None
    meta, claim_spec = claim["metadata"], claim.get("spec") or {}
    uid = (meta.get("annotations") or {}).get(RUN_UID_ANNOTATION)
    if uid is not None:  # the run that last applied it: an earlier run's claim made in the same second too
        earlier = uid != run.uid
    else:  # older than the RLRun (RFC 3339 UTC times compare as text): made for an earlier run of this name
        earlier = bool(created) and str(meta.get("creationTimestamp") or "") < str(created)
    if not earlier or f"PersistentVolumeClaim/{meta['name']}" not in applying.rejected:
        return None
    has = f"storageClassName {claim_spec.get('storageClassName')!r}, accessModes {claim_spec.get('accessModes')}"
    return (
        f"PersistentVolumeClaim {meta['name']} is left from an earlier run of this name (retainOnDelete) with "
        f"{has}, and a claim's class and modes cannot change: delete it (kubectl delete pvc {meta['name']} "
        f"-n {run.namespace}; its data goes with it) or set spec.offload to match it"
    )


def _pod_ended(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") or bool(
        (pod.get("metadata") or {}).get("deletionTimestamp")
    )


def _pods_of(owner: dict[str, Any] | None, pods: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The pods `owner` (a Job, the StatefulSet) controls: a replaced Job's last pods are not the new one's."""
    uid = ((owner or {}).get("metadata") or {}).get("uid")
    if uid is None:
        return ()
    return tuple(
        pod
        for pod in pods
        if any(ref.get("uid") == uid for ref in (pod.get("metadata") or {}).get("ownerReferences") or [])
    )


def _child_transitions(actions: dict[str, str]) -> list[Transition]:
    """One event per pass for each kind of change made (none for a pass that changed nothing)."""
    events = []
    for action, reason in (
        ("created", "ChildrenCreated"),
        ("patched", "ChildrenUpdated"),
        ("deleted", "ChildrenDeleted"),
        ("suspended", "JobsSuspended"),
        ("stopped", "JobsStopped"),
        ("finishing", "JobsFinishing"),
    ):
        children = [child for child, done in actions.items() if done == action]
        if children:
            events.append(Transition("Normal", reason, f"{action}: {', '.join(children)}"))
    return events
