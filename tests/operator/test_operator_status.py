from __future__ import annotations

from typing import Any

import pytest

from rawmm_operator.status import (
    INVALID_SPEC,
    TERMINAL_PHASES,
    Applying,
    Observed,
    Progress,
    RLRunStatus,
    derive_status,
    invalid_spec_status,
    run_ended,
    transitions,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def claim(phase: str | None = "Bound") -> dict[str, Any]:
    return {"metadata": {"name": "r-offload"}, "status": {"phase": phase} if phase else {}}


def engines(replicas: int, ready: int) -> dict[str, Any]:
    return {"spec": {"replicas": replicas}, "status": {"readyReplicas": ready}}


def job(
    *, active: int = 0, suspend: bool = False, condition: str | None = None, message: str = ""
) -> dict[str, Any]:
    status: dict[str, Any] = {"active": active}
    if condition:
        status["conditions"] = [{"type": condition, "status": "True", "message": message}]
    return {"spec": {"suspend": suspend}, "status": status}


def pod(
    name: str = "p",
    phase: str = "Running",
    *,
    unschedulable: str = "",
    waiting: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the API shows it: Running, or Pending unschedulable (the scheduler's message), or with a
    container waiting (the kubelet's reason and message)."""
    status: dict[str, Any] = {"phase": phase}
    if unschedulable:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        ]
    if waiting:
        status["containerStatuses"] = [
            {"name": "main", "state": {"waiting": {"reason": waiting[0], "message": waiting[1]}}}
        ]
    return {"metadata": {"name": name}, "status": status}


RUNNING_PODS = {"engines": (pod("e-0"), pod("e-1")), "orchestrator": (pod("o"),), "trainer": (pod("t"),)}


def observed(*, pods: dict[str, Any] | None = None, **children: Any) -> Observed:
    base: dict[str, Any] = {
        "claim": claim(),
        "engines": engines(2, 2),
        "orchestrator": job(active=1),
        "trainer": job(active=1),
    }
    return Observed(claim_name="r-offload", pods={**RUNNING_PODS, **(pods or {})}, **{**base, **children})


def derive(
    obs: Observed, previous: RLRunStatus | None = None, *, suspend: bool = False, now: str = T0, **kwargs: Any
) -> RLRunStatus:
    return derive_status(
        suspend=suspend, generation=3, observed=obs, previous=previous or RLRunStatus(), now=now, **kwargs
    )


def conditions(status: RLRunStatus) -> dict[str, str]:
    return {c.type: c.status for c in status.conditions}


def test_all_children_healthy_is_running_with_every_condition() -> None:
    status = derive(observed())
    assert status.phase == "Running"
    assert conditions(status) == {
        "OffloadVolumeReady": "True",
        "InferenceReady": "True",
        "OrchestratorRunning": "True",
        "TrainerRunning": "True",
        "Complete": "False",
        "Failed": "False",
        "Reconciled": "True",
    }
    assert status.observed_generation == 3
    assert status.engines is not None and status.engines.ready_replicas == 2
    assert status.start_time == T0 and status.completion_time is None


@pytest.mark.parametrize(
    ("children", "phase"),
    [
        ({"claim": None}, "Pending"),
        ({"claim": claim("Pending")}, "Pending"),
        ({"engines": None, "orchestrator": None, "trainer": None}, "Provisioning"),
        ({"engines": engines(2, 1)}, "Provisioning"),
        ({"trainer": job()}, "Provisioning"),
        ({"trainer": job(condition="Complete")}, "Succeeded"),
        ({"trainer": job(condition="Failed", message="BackoffLimitExceeded")}, "Failed"),
        ({"orchestrator": job(condition="Failed", message="pod crashed")}, "Failed"),
    ],
)
def test_phase_follows_the_children(children: dict[str, Any], phase: str) -> None:
    assert derive(observed(**children)).phase == phase


def test_suspended_run() -> None:
    status = derive(
        observed(engines=engines(0, 0), orchestrator=job(suspend=True), trainer=job(suspend=True)),
        suspend=True,
    )
    assert status.phase == "Suspended"
    inference = status.condition("InferenceReady")
    assert inference is not None and (inference.status, inference.reason) == ("False", "Suspended")
    trainer = status.condition("TrainerRunning")
    assert trainer is not None and trainer.reason == "Suspended"


def test_failure_carries_the_jobs_message() -> None:
    status = derive(
        observed(trainer=job(condition="Failed", message="Job has reached the specified backoff limit"))
    )
    assert (status.reason, status.message) == ("TrainerFailed", "Job has reached the specified backoff limit")
    failed = status.condition("Failed")
    assert failed is not None and failed.status == "True" and failed.reason == "TrainerFailed"
    assert status.completion_time == T0


def test_terminal_phase_sticks_when_the_children_change_later() -> None:
    succeeded = derive(observed(trainer=job(condition="Complete")))
    later = derive(observed(trainer=None, engines=engines(0, 0)), succeeded, now=T1)
    assert later.phase == "Succeeded"
    assert later.completion_time == T0


def test_transition_time_changes_only_with_the_condition_status() -> None:
    first = derive(observed(engines=engines(2, 1)))
    same = derive(observed(engines=engines(2, 1)), first, now=T1)
    ready = derive(observed(), same, now=T1)
    assert same.condition("InferenceReady").last_transition_time == T0  # type: ignore[union-attr]
    assert ready.condition("InferenceReady").last_transition_time == T1  # type: ignore[union-attr]
    assert ready.condition("OffloadVolumeReady").last_transition_time == T0  # type: ignore[union-attr]


def test_invalid_spec_keeps_the_rest_and_is_replaced_by_a_valid_pass() -> None:
    running = derive(observed())
    invalid = invalid_spec_status(
        generation=4, message="spec: inference.replicas: bad", previous=running, now=T1
    )
    assert (invalid.phase, invalid.reason, invalid.observed_generation) == ("Failed", "InvalidSpec", 4)
    assert conditions(invalid)["InferenceReady"] == "True"
    assert conditions(invalid)["Failed"] == "True"
    fixed = derive(observed(), invalid, now=T1)
    assert fixed.phase == "Running" and fixed.reason is None


def test_transitions_report_phase_and_condition_changes_once() -> None:
    provisioning = derive(observed(engines=engines(2, 0)))
    first = transitions(RLRunStatus(), provisioning)
    assert ("Normal", "Provisioning") in [(t.type, t.reason) for t in first]
    # on the first pass, only conditions that hold are news
    assert {t.reason for t in first} == {"Provisioning", "Bound", "Running"}
    running = derive(observed(), provisioning)
    changes = transitions(provisioning, running)
    assert [(t.type, t.reason, t.message) for t in changes] == [
        ("Normal", "Running", "phase Provisioning -> Running"),
        ("Normal", "AllReplicasReady", "InferenceReady=True: 2/2 engine replicas ready"),
    ]
    assert transitions(running, derive(observed(), running)) == []
    failed = derive(observed(trainer=job(condition="Failed", message="OOMKilled")), running)
    warnings = [t for t in transitions(running, failed) if t.type == "Warning"]
    assert {t.reason for t in warnings} == {"Failed", "TrainerFailed"}
    assert any("OOMKilled" in t.message for t in warnings)


def test_status_dump_is_camel_case_and_round_trips() -> None:
    status = derive(observed())
    dumped = status.dump()
    assert {"observedGeneration", "startTime", "conditions", "engines"} <= set(dumped)
    assert "lastTransitionTime" in dumped["conditions"][0]
    assert RLRunStatus.model_validate(dumped) == status


def test_a_pending_claim_says_why_from_its_events() -> None:
    hint = "FailedBinding: no persistent volumes available for this claim and no storage class is set"
    status = derive(observed(claim=claim("Pending"), claim_event=hint))
    volume = status.condition("OffloadVolumeReady")
    assert volume is not None and volume.reason == "ClaimPending"
    assert volume.message == f"PersistentVolumeClaim r-offload is Pending: {hint}"
    bound = derive(observed(claim_event=hint)).condition("OffloadVolumeReady")
    assert bound is not None and bound.message == "PersistentVolumeClaim r-offload is Bound"


def test_a_rejected_child_is_a_condition_and_a_warning_never_a_failed_run() -> None:
    healthy = derive(observed())
    message = "422: PersistentVolumeClaim is invalid: spec: Forbidden: spec is immutable after creation"
    rejected = derive(
        observed(), healthy, applying=Applying(rejected={"PersistentVolumeClaim/r-offload": message})
    )
    assert rejected.phase == "Running" and rejected.reason is None
    reconciled = rejected.condition("Reconciled")
    assert reconciled is not None and (reconciled.status, reconciled.reason) == ("False", "ChildRejected")
    assert message in reconciled.message
    events = transitions(healthy, rejected)
    assert [(t.type, t.reason) for t in events] == [("Warning", "ChildRejected")]
    # a run created into a quota that refuses a child warns on its first pass too
    first = transitions(
        RLRunStatus(), derive(observed(), applying=Applying(rejected={"Job/x": "403: quota"}))
    )
    assert ("Warning", "ChildRejected") in [(t.type, t.reason) for t in first]
    recovered = derive(observed(), rejected)
    assert [(t.type, t.reason) for t in transitions(rejected, recovered)] == [("Normal", "Applied")]


def test_events_only_on_transitions() -> None:
    """The same observation twice is no news: nothing to post (once per resync was the spam)."""
    for applying in (
        Applying(),
        Applying(unavailable=("PodMonitor/r",)),
        Applying(rejected={"Job/x": "403"}),
    ):
        first = derive(observed(), applying=applying)
        again = derive(observed(), first, now=T1, applying=applying)
        assert transitions(first, again) == []


def test_an_active_deadline_fails_the_run_with_its_reason() -> None:
    status = derive(observed(), deadline_exceeded=True)
    assert (status.phase, status.reason) == ("Failed", "DeadlineExceeded")
    done = derive(observed(trainer=job(condition="Complete")), deadline_exceeded=True)
    assert done.phase == "Succeeded"


def test_a_job_whose_pods_do_not_run_is_not_running_and_says_why_in_the_schedulers_words() -> None:
    message = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available"
    status = derive(observed(pods={"trainer": (pod("t", "Pending", unschedulable=message),)}))
    assert status.phase == "Provisioning"  # not Running: the trainer's pod is not
    trainer = status.condition("TrainerRunning")
    assert trainer is not None and (trainer.status, trainer.reason) == ("False", "Unschedulable")
    assert trainer.message == f"pod t: {message}"
    assert ("Warning", "Unschedulable") in [(t.type, t.reason) for t in transitions(RLRunStatus(), status)]
    # Active but not yet started, with nothing wrong: still not Running.
    waiting = derive(observed(pods={"trainer": (pod("t", "Pending"),)})).condition("TrainerRunning")
    assert waiting is not None and waiting.status == "False" and "0/1 pod(s) running" in waiting.message


def test_an_engine_that_cannot_pull_its_image_says_so_with_the_kubelets_message() -> None:
    pull = ("ImagePullBackOff", 'Back-off pulling image "registry.example/rawmm-inference:typo"')
    status = derive(
        observed(engines=engines(2, 1), pods={"engines": (pod("e-0"), pod("e-1", "Pending", waiting=pull))})
    )
    inference = status.condition("InferenceReady")
    assert inference is not None and (inference.status, inference.reason) == ("False", "ImagePullBackOff")
    assert (
        inference.message == f"1/2 engine replicas ready: pod e-1 container main: ImagePullBackOff: {pull[1]}"
    )


def test_a_multi_node_trainer_runs_only_when_every_node_does() -> None:
    two = {**job(active=2), "spec": {"completions": 2, "parallelism": 2}}
    half = derive(observed(trainer=two, pods={"trainer": (pod("t-0"), pod("t-1", "Pending"))}))
    assert half.phase == "Provisioning"
    both = derive(observed(trainer=two, pods={"trainer": (pod("t-0"), pod("t-1"))}))
    assert both.phase == "Running"


@pytest.mark.parametrize("condition", ["SuccessCriteriaMet", None])
def test_a_finished_trainer_is_success_before_its_job_says_complete(condition: str | None) -> None:
    """The Job controller says SuccessCriteriaMet (or counts the success) before Complete, once its pods are
    gone: the run goes from Running to Succeeded, never through Provisioning."""
    finishing = job(condition=condition)
    finishing["status"]["succeeded"] = 1
    running = derive(observed())
    status = derive(observed(trainer=finishing, pods={"trainer": ()}), running, now=T1)
    assert status.phase == "Succeeded"
    phases = [t.message for t in transitions(running, status) if t.message.startswith("phase")]
    assert phases == ["phase Running -> Succeeded"]


def test_a_pod_that_ended_before_its_job_counted_it_keeps_the_phase() -> None:
    """Between a pod's end and the Job controller's count, the run neither drops to Provisioning nor waits."""
    running = derive(observed())
    done = derive(observed(pods={"trainer": (pod("t", "Succeeded"),)}), running, now=T1)
    assert done.phase == "Succeeded"
    crashed = derive(observed(pods={"trainer": (pod("t", "Failed"),)}), running, now=T1)
    assert crashed.phase == "Running"  # until the Job controller says Failed (or starts a replacement)
    replacing = derive(
        observed(pods={"trainer": (pod("t", "Failed"), pod("t2", "Pending"))}), running, now=T1
    )
    assert replacing.phase == "Provisioning"


def test_a_claim_an_earlier_run_left_that_differs_is_a_conflict_not_a_running_run() -> None:
    conflict = "PersistentVolumeClaim r-offload is left from an earlier run of this name ..."
    status = derive(Observed(**{**observed().__dict__, "claim_conflict": conflict}))
    volume = status.condition("OffloadVolumeReady")
    assert volume is not None and (volume.status, volume.reason, volume.message) == (
        "False",
        "ClaimConflict",
        conflict,
    )
    assert status.phase == "Pending"


def test_jobs_the_operator_suspended_after_the_run_failed_are_not_reported_as_queued() -> None:
    status = derive(
        observed(trainer=job(condition="Failed", message="exit 1"), orchestrator=job(suspend=True))
    )
    orchestrator = status.condition("OrchestratorRunning")
    assert orchestrator is not None and orchestrator.message == "suspended by the operator: the run failed"
    assert "Kueue" not in orchestrator.message


def test_a_job_suspended_by_a_queue_waits_for_admission() -> None:
    status = derive(observed(orchestrator=job(suspend=True), trainer=job(suspend=True)))
    assert status.phase == "Provisioning"
    trainer = status.condition("TrainerRunning")
    assert (
        trainer is not None and trainer.reason == "Suspended" and "waiting for admission" in trainer.message
    )
    own = derive(observed(orchestrator=job(suspend=True), trainer=job(suspend=True)), suspend=True)
    assert own.phase == "Suspended"


@pytest.mark.parametrize("orchestrator", ["Running", "Failed", "Succeeded", "Suspended"])
@pytest.mark.parametrize("trainer", ["Running", "Failed", "Succeeded", "Suspended", None])
@pytest.mark.parametrize("previous", ["Running", "Succeeded", "Failed", INVALID_SPEC])
@pytest.mark.parametrize("deadline_exceeded", [False, True])
def test_run_ended_is_whether_the_derived_phase_is_terminal(
    orchestrator: str, trainer: str | None, previous: str, deadline_exceeded: bool
) -> None:
    """The reconciler picks the run's stage with `run_ended` before the pass, and derives the status once,
    after it: the two must agree."""
    state = {"Running": job(active=1), "Suspended": job(suspend=True), None: None}
    state |= {
        ending: job(condition="Complete" if ending == "Succeeded" else ending)
        for ending in ("Failed", "Succeeded")
    }
    before = (
        RLRunStatus(phase="Failed", reason=INVALID_SPEC)
        if previous == INVALID_SPEC
        else RLRunStatus(phase=previous)  # type: ignore[arg-type]
    )
    obs = observed(orchestrator=state[orchestrator], trainer=state[trainer])
    derived = derive(obs, before, deadline_exceeded=deadline_exceeded)
    ended = run_ended(observed=obs, previous=before, deadline_exceeded=deadline_exceeded)
    assert ended is (derived.phase in TERMINAL_PHASES)


def test_a_trainer_that_succeeded_finished_every_step_whatever_was_last_read() -> None:
    """The trainer's pod is gone before the operator reads it again: a read of step 3 of 10 is stale."""
    read = Progress(trainer_step=3, cache_hit_rate=0.5)
    running = derive(observed(), progress=read, steps=10)
    assert running.trainer_step == 3
    done = derive(observed(trainer=job(condition="Complete")), running, now=T1, progress=read, steps=10)
    assert (done.phase, done.trainer_step, done.cache_hit_rate) == ("Succeeded", 10, 0.5)
    failed = derive(observed(trainer=job(condition="Failed")), running, now=T1, progress=read, steps=10)
    assert (failed.phase, failed.trainer_step) == ("Failed", 3)
