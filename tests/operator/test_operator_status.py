from __future__ import annotations

from typing import Any

import pytest

from rawmm_operator.status import Observed, RLRunStatus, derive_status, invalid_spec_status, transitions

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


def observed(**children: Any) -> Observed:
    base: dict[str, Any] = {
        "claim": claim(),
        "engines": engines(2, 2),
        "orchestrator": job(active=1),
        "trainer": job(active=1),
    }
    return Observed(claim_name="r-offload", **{**base, **children})


def derive(
    obs: Observed, previous: RLRunStatus | None = None, *, suspend: bool = False, now: str = T0
) -> RLRunStatus:
    return derive_status(
        suspend=suspend, generation=3, observed=obs, previous=previous or RLRunStatus(), now=now
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
