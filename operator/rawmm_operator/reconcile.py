"""One reconciliation pass of one RLRun: read it, converge its children, derive and write its status.

Synchronous and free of kopf, so it can be driven by the operator's per-run loop and by tests alike.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from rawmm_operator import builders
from rawmm_operator.builders import RunRef
from rawmm_operator.kube import ApiError, KubeApi, apply, merge_patch
from rawmm_operator.progress import ProgressReader
from rawmm_operator.spec import KIND, InvalidSpec, RLRunSpec, parse_spec
from rawmm_operator.status import (
    TERMINAL_PHASES,
    Observed,
    Progress,
    RLRunStatus,
    Transition,
    derive_status,
    invalid_spec_status,
    transitions,
)

DEFAULT_POD_MONITOR = builders.PodMonitorSettings()


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


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        *,
        pod_monitor: builders.PodMonitorSettings = DEFAULT_POD_MONITOR,
        progress_interval: float = 15.0,
    ) -> None:
        self.api = api
        self.pod_monitor = pod_monitor
        self.progress = ProgressReader(api)
        # Scrape a run's pods at most this often: the hit rate is taken between two scrapes.
        self.progress_interval = progress_interval
        self._last_progress: dict[tuple[str, str], float] = {}

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is remembered about a run that is gone (or no longer ours)."""
        self._last_progress.pop((namespace, name), None)
        self.progress.forget(namespace, name)

    def _read_progress(self, run: RunRef, previous: RLRunStatus) -> Progress | None:
        key = (run.namespace, run.name)
        moment = time.monotonic()
        if moment - self._last_progress.get(key, -math.inf) < self.progress_interval:
            return None
        self._last_progress[key] = moment
        return self.progress.read(
            run.namespace, run.name, Progress(previous.trainer_step, previous.cache_hit_rate)
        )

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
        for manifest in builders.build_children(run, spec, finished=finished, pod_monitor=self.pod_monitor):
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
            suspend=spec.suspend,
            generation=generation,
            observed=observed(),
            previous=previous,
            now=now,
            progress=self._read_progress(run, previous),
        )
        self._write_status(body, status)
        outcome.status = status
        outcome.transitions = [*_child_transitions(outcome.actions), *transitions(previous, status)]
        return outcome

    def _write_status(self, body: dict[str, Any], status: RLRunStatus) -> None:
        patch = merge_patch(body.get("status") or {}, status.dump())
        if patch:
            meta = body["metadata"]
            self.api.patch(KIND, meta["namespace"], meta["name"], {"status": patch}, subresource="status")


def _child_transitions(actions: dict[str, str]) -> list[Transition]:
    """One event per pass for the children created, one for those changed, one per skipped child."""
    events = []
    for action, reason in (("created", "ChildrenCreated"), ("patched", "ChildrenUpdated")):
        children = [child for child, done in actions.items() if done == action]
        if children:
            events.append(Transition("Normal", reason, f"{action}: {', '.join(children)}"))
    events += [
        Transition("Warning", "ChildSkipped", f"{child} {done}")
        for child, done in actions.items()
        if done.startswith("skipped")
    ]
    return events
