"""One reconciliation pass of one RLRun: read it, converge its children, derive and write its status.

Synchronous and free of kopf, so it can be driven by the operator's per-run loop and by tests alike.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from rawmm.config import format_validation_error
from rawmm_operator import builders
from rawmm_operator.builders import RunRef
from rawmm_operator.kube import ApiError, KubeApi, apply, merge_patch
from rawmm_operator.spec import KIND, RLRunSpec, run_name_problem
from rawmm_operator.status import (
    TERMINAL_PHASES,
    Observed,
    RLRunStatus,
    Transition,
    derive_status,
    invalid_spec_status,
    transitions,
)


class InvalidSpec(Exception):
    """The spec cannot be reconciled (reported in status and events; retried only when it changes)."""


@dataclass
class Outcome:
    body: dict[str, Any]
    status: RLRunStatus
    transitions: list[Transition]
    actions: dict[str, str] = field(default_factory=dict)  # "Kind/name" -> created | patched | unchanged
    invalid: str | None = None


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_status(body: dict[str, Any]) -> RLRunStatus:
    try:
        return RLRunStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return RLRunStatus()  # unreadable (another version's?): derive afresh


def parse_spec(name: str, spec: Any) -> RLRunSpec:
    problem = run_name_problem(name)
    if problem:
        raise InvalidSpec(problem)
    try:
        return RLRunSpec.model_validate(spec or {})
    except ValidationError as exc:
        raise InvalidSpec(
            format_validation_error(exc, source="spec").replace("invalid run config", "invalid RLRun spec")
        ) from None


class Reconciler:
    def __init__(self, api: KubeApi) -> None:
        self.api = api

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """Converge the run; None when it is gone or being deleted. Raises `ApiError` on API failures."""
        body = self.api.get(KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        meta = body["metadata"]
        generation = meta.get("generation")
        previous = _read_status(body)
        now = utc_now()
        try:
            spec = parse_spec(name, body.get("spec"))
            run = RunRef(name=name, namespace=namespace, uid=meta["uid"])
            return self._converge(body, run, spec, generation, previous, now)
        except InvalidSpec as exc:
            status = invalid_spec_status(generation=generation, message=str(exc), previous=previous, now=now)
            self._write_status(body, status)
            return Outcome(body, status, transitions(previous, status), invalid=str(exc))

    def _converge(
        self,
        body: dict[str, Any],
        run: RunRef,
        spec: RLRunSpec,
        generation: int | None,
        previous: RLRunStatus,
        now: str,
    ) -> Outcome:
        claim = builders.claim_name(run, spec)
        roles = {
            "claim": ("PersistentVolumeClaim", claim),
            "engines": ("StatefulSet", builders.engine_name(run)),
            "orchestrator": ("Job", builders.orchestrator_name(run)),
            "trainer": ("Job", builders.trainer_name(run)),
        }
        live: dict[tuple[str, str], dict[str, Any] | None] = {
            (kind, child): self.api.get(kind, run.namespace, child) for kind, child in roles.values()
        }

        def observed() -> Observed:
            return Observed(claim_name=claim, **{role: live[key] for role, key in roles.items()})

        before = derive_status(
            suspend=spec.suspend, generation=generation, observed=observed(), previous=previous, now=now
        )
        finished = before.phase in TERMINAL_PHASES
        outcome = Outcome(body, before, [])
        for manifest in builders.build_children(run, spec, finished=finished):
            key = (manifest["kind"], manifest["metadata"]["name"])
            if key not in live:
                live[key] = self.api.get(key[0], run.namespace, key[1])
            try:
                applied = apply(self.api, manifest, live[key])
            except ApiError as exc:
                if manifest["kind"] == "PodMonitor" and exc.status == 404:
                    outcome.actions[f"{key[0]}/{key[1]}"] = "skipped: the PodMonitor CRD is not installed"
                    continue
                if exc.transient:
                    raise
                raise InvalidSpec(f"the API server rejected {key[0]} {key[1]}: {exc}") from exc
            live[key] = applied.object
            outcome.actions[f"{key[0]}/{key[1]}"] = applied.action

        status = derive_status(
            suspend=spec.suspend, generation=generation, observed=observed(), previous=previous, now=now
        )
        self._write_status(body, status)
        outcome.status = status
        outcome.transitions = transitions(previous, status)
        return outcome

    def _write_status(self, body: dict[str, Any], status: RLRunStatus) -> None:
        patch = merge_patch(body.get("status") or {}, status.dump())
        if patch:
            meta = body["metadata"]
            self.api.patch(KIND, meta["namespace"], meta["name"], {"status": patch}, subresource="status")
