"""The reconciler's pure decisions: which stage a run is in, which `suspend` a Job gets, which event of a
claim says why it is pending. (The passes themselves run against a real server: test_real_operator_*.)"""

from __future__ import annotations

from typing import Any

import pytest
from operator_samples import CPU_ONLY, ISSUE_EXAMPLE, merged

from rawmm_operator.catalogue import build_children
from rawmm_operator.children.offload import build_offload_claim
from rawmm_operator.objects import RunRef
from rawmm_operator.pods import RUN_SUSPEND, job_suspend
from rawmm_operator.reconcile import Outcome, Reconciler, _claim_conflict, newest_event, stage_of
from rawmm_operator.spec import parse_spec
from rawmm_operator.status import FINISH_GRACE_SECONDS, STOP_DEADLINE_SECONDS, Applying, RLRunStatus

RUN = RunRef(name="exp", namespace="ml", uid="u-1")
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:10:00Z"


def trainer_job(spec: dict[str, Any], run: RunRef = RUN) -> dict[str, Any]:
    (job,) = [
        m for m in build_children(run, parse_spec("exp", spec)) if m["metadata"]["name"] == "exp-trainer"
    ]
    return job


def live(carried: str, suspended: bool) -> dict[str, Any]:
    return {"metadata": {"annotations": {RUN_SUSPEND: carried}}, "spec": {"suspend": suspended}}


@pytest.mark.parametrize(
    ("run_suspend", "carried", "live_suspend", "expected"),
    [
        (False, "false", True, True),  # a queue suspended (or has not admitted) the Job: left so
        (False, "false", False, False),  # a queue admitted it: left so
        (True, "false", False, True),  # the run was suspended since: carried over
        (False, "true", True, False),  # the run was resumed since: carried over
        (True, "true", False, False),  # suspended run, Job admitted by hand or a queue: left so
    ],
)
def test_a_jobs_suspend_changes_only_when_the_runs_does(
    run_suspend: bool, carried: str, live_suspend: bool, expected: bool
) -> None:
    spec = merged(ISSUE_EXAMPLE, {"suspend": run_suspend})
    manifest = trainer_job(spec)
    assert manifest["metadata"]["annotations"][RUN_SUSPEND] == str(run_suspend).lower()
    assert job_suspend(manifest, live(carried, live_suspend)) is expected


def test_resuming_a_queued_run_leaves_its_jobs_for_the_queue_to_admit() -> None:
    queued = RunRef(name="exp", namespace="ml", uid="u-1", queue_name="team-a")
    resumed = trainer_job(merged(ISSUE_EXAMPLE, {"suspend": False}), queued)
    assert job_suspend(resumed, live("true", True)) is True  # not unsuspended by the operator
    suspended = trainer_job(merged(ISSUE_EXAMPLE, {"suspend": True}), queued)
    assert job_suspend(suspended, live("false", False)) is True  # the run's suspend still reaches it


def test_stage_follows_the_phase_and_the_ttl() -> None:
    spec = parse_spec("exp", ISSUE_EXAMPLE)
    with_ttl = parse_spec("exp", merged(ISSUE_EXAMPLE, {"ttlSecondsAfterFinished": 0}))
    running = RLRunStatus(phase="Running")
    done = RLRunStatus(phase="Succeeded", completion_time=T0)
    assert stage_of(spec, False, running, T1) == "active"
    assert stage_of(spec, True, done, T1) == "finished"  # no TTL: its children stay
    # the pass that first sees the end records it; only a later one deletes (else the phase would be
    # derived from the deleted children, and the next pass recreate them)
    assert stage_of(with_ttl, True, running, T0) == "finished"
    assert stage_of(with_ttl, True, done, T0) == "expired"
    later = parse_spec("exp", merged(ISSUE_EXAMPLE, {"ttlSecondsAfterFinished": 600}))
    assert stage_of(later, True, done, "2026-01-01T00:09:59Z") == "finished"
    assert stage_of(later, True, done, T1) == "expired"
    failed = RLRunStatus(phase="Failed", completion_time=T0)
    assert stage_of(later, True, failed, T1) == "expired"
    invalid = RLRunStatus(phase="Failed", reason="InvalidSpec", completion_time=T0)
    assert stage_of(later, True, invalid, T1) == "finished"  # an invalid spec is no finished run


def test_the_newest_event_says_why() -> None:
    events = [
        {"reason": "ExternalProvisioning", "message": "waiting", "lastTimestamp": "2026-01-01T00:00:01Z"},
        {"reason": "ProvisioningFailed", "message": 'storageclass "nfs" not found', "lastTimestamp": T1},
        {"reason": "Old", "message": "x", "metadata": {"creationTimestamp": T0}},
    ]
    assert newest_event(events) == 'ProvisioningFailed: storageclass "nfs" not found'
    assert newest_event([]) is None


def test_a_retained_claim_is_told_from_an_earlier_runs_made_in_the_same_second() -> None:
    """Creation times have whole seconds: a run deleted and applied again within the second its claim was
    made (seen in make test) must still learn that the claim is the earlier run's. The claim names the run
    that applied it; a claim without the name (an older operator's) is judged by its age."""
    spec = parse_spec("exp", merged(CPU_ONLY, {"offload": {"retainOnDelete": True}}))
    earlier, again = RunRef("exp", "ml", "uid-earlier"), RunRef("exp", "ml", "uid-again")
    claim = build_offload_claim(earlier, spec)
    second = "2026-12-06T17:10:41Z"
    claim["metadata"]["creationTimestamp"] = second
    refused = Applying(rejected={"PersistentVolumeClaim/exp-offload": "422: spec is immutable"})
    message = _claim_conflict(again, second, spec, claim, refused)
    assert message is not None and "left from an earlier run of this name" in message
    assert _claim_conflict(earlier, second, spec, claim, refused) is None  # its own claim
    assert _claim_conflict(again, second, spec, claim, Applying()) is None  # the server took the spec
    del claim["metadata"]["annotations"]
    assert _claim_conflict(again, second, spec, claim, refused) is None  # same second, no name: unknown
    assert _claim_conflict(again, "2026-12-06T17:10:42Z", spec, claim, refused) is not None


class Recorded:
    """The calls `_release` makes: lists answered from fixed objects, patches recorded."""

    def __init__(self, objects: dict[str, list[dict[str, Any]]]) -> None:
        self.objects = objects
        self.patches: dict[str, dict[str, Any]] = {}

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return self.objects.get(kind, [])

    def patch(self, kind: str, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.patches[name] = body


def _owned(name: str, uid: str, owner_uid: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid, "ownerReferences": [{"uid": owner_uid}]}}


@pytest.mark.parametrize(("trainer_pod_phase", "stopped"), [("Succeeded", False), ("Failed", True)])
def test_a_trainer_whose_pod_succeeded_before_its_job_completed_gives_the_others_their_grace(
    trainer_pod_phase: str, stopped: bool
) -> None:
    """The run's status counts the trainer a success once its pod has Succeeded, before the Job controller
    marks the Job Complete; the release in that same pass must read it so too, or it stops the orchestrator
    (cutting its last weights sync) as after a failure."""
    trainer = {**_owned("exp-trainer", "t-1", RUN.uid), "status": {"active": 1}}
    orchestrator = {**_owned("exp-orchestrator", "o-1", RUN.uid), "status": {"active": 1}}
    pods = [
        {**_owned("exp-trainer-abc", "tp", "t-1"), "status": {"phase": trainer_pod_phase, "startTime": T0}},
        {**_owned("exp-orchestrator-abc", "op", "o-1"), "status": {"phase": "Running", "startTime": T0}},
    ]
    api = Recorded({"Job": [trainer, orchestrator], "Pod": pods})
    Reconciler(api)._release(RUN, "Job", Outcome({}, RLRunStatus(), []))  # type: ignore[arg-type]
    deadline = api.patches["exp-orchestrator-abc"]["spec"]["activeDeadlineSeconds"]
    if stopped:
        assert deadline == STOP_DEADLINE_SECONDS
    else:
        assert deadline >= FINISH_GRACE_SECONDS  # its age so far, plus the grace
