"""The kopf wiring (`rawmm_operator.handlers`) with a stand-in reconciler, its handlers called as kopf calls
them: one loop per run that passes at once, on spec changes and child events but not on its own status
writes, backs off on failures, waits out an invalid generation, and stops with the run."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
import pytest
from kopf._core.engines import posting
from operator_samples import eventually
from prometheus_client import REGISTRY

from rawmm_operator.handlers import (
    WATCHED_CHILDREN,
    LoopTiming,
    _backoff,
    build_registry,
    operator_settings,
)
from rawmm_operator.kube import ApiError
from rawmm_operator.objects import RUN_LABEL
from rawmm_operator.reconcile import Outcome
from rawmm_operator.status import Applying, RLRunStatus, Transition

LOGGER = logging.getLogger("test-handlers")
NEVER = 3600.0  # a resync that does not come during a test: every pass is woken


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def body(generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "rawmm.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "exp", "namespace": "ml", "uid": "u-1", "generation": generation},
    }


@dataclass
class StandIn:
    """A reconciler whose passes say what `answer` says (an Outcome, or an exception to raise)."""

    answer: Callable[[int], Outcome | Exception] = lambda _: Outcome(body(), RLRunStatus(phase="Running"), [])
    passes: int = 0
    forgotten: list[tuple[str, str]] = field(default_factory=list)

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        self.passes += 1
        answer = self.answer(self.passes)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def forget(self, namespace: str, name: str) -> None:
        self.forgotten.append((namespace, name))


@dataclass
class Wiring:
    reconciler: StandIn
    handlers: dict[str, Callable[..., Any]]
    events: asyncio.Queue[posting.K8sEvent]

    async def run_event(self, generation: int = 1, type_: str | None = None) -> None:
        event = {"type": type_, "object": body(generation)}
        await self.handlers["rlrun"](event=event, namespace="ml", name="exp", logger=LOGGER)

    async def child_event(self, plural: str = "jobs") -> None:
        await self.handlers[f"child-{plural}"](namespace="ml", labels={RUN_LABEL: "exp"})

    def posted(self) -> list[tuple[str, str]]:
        found = []
        while not self.events.empty():
            event = self.events.get_nowait()
            found.append((event.type, event.reason))
        return found


@pytest.fixture
async def wire() -> AsyncIterator[Callable[..., Wiring]]:
    registries: list[kopf.OperatorRegistry] = []
    settings = operator_settings()
    queue: asyncio.Queue[posting.K8sEvent] = asyncio.Queue()
    # What kopf sets up for its handlers: events go to a queue (read here) instead of the API.
    posting.settings_var.set(settings)
    posting.event_queue_var.set(queue)
    posting.event_queue_loop_var.set(asyncio.get_running_loop())

    def make(reconciler: StandIn, timing: LoopTiming) -> Wiring:
        registry = build_registry(reconciler, login=lambda **_: None, timing=timing)  # type: ignore[arg-type]
        registries.append(registry)
        handlers = {h.id: h.fn for h in registry._watching.get_all_handlers()}
        return Wiring(reconciler, handlers, queue)

    yield make
    for registry in registries:  # stop every loop left running
        for handler in registry._activities.get_all_handlers():
            if handler.id.endswith("stop_loops"):
                await handler.fn()


async def test_a_run_is_reconciled_on_sight_on_spec_changes_and_child_events(
    wire: Callable[..., Wiring],
) -> None:
    wiring = wire(StandIn(), LoopTiming(resync_seconds=NEVER))
    await wiring.run_event(generation=1)
    await eventually(lambda: wiring.reconciler.passes == 1, what="the first pass")
    for plural in ("statefulsets", "jobs", "persistentvolumeclaims"):
        before = wiring.reconciler.passes
        await wiring.child_event(plural)
        await eventually(lambda: wiring.reconciler.passes == before + 1, what=f"a pass after {plural}")  # noqa: B023
    await wiring.run_event(generation=2)
    await eventually(lambda: wiring.reconciler.passes == 5, what="a pass after a spec change")


async def test_its_own_status_write_wakes_nothing(wire: Callable[..., Wiring]) -> None:
    wiring = wire(StandIn(), LoopTiming(resync_seconds=NEVER))
    await wiring.run_event(generation=1)
    await eventually(lambda: wiring.reconciler.passes == 1)
    await wiring.run_event(generation=1)  # the status changed: same generation
    await asyncio.sleep(0.3)
    assert wiring.reconciler.passes == 1


async def test_deleting_the_run_stops_its_loop_and_forgets_it(wire: Callable[..., Wiring]) -> None:
    wiring = wire(StandIn(), LoopTiming(resync_seconds=0.05))
    await wiring.run_event()
    await eventually(lambda: wiring.reconciler.passes >= 2, what="resync passes")
    await wiring.run_event(type_="DELETED")
    await eventually(lambda: wiring.reconciler.forgotten == [("ml", "exp")], what="the run forgotten")
    stopped_at = wiring.reconciler.passes
    await asyncio.sleep(0.3)  # six resync periods
    assert wiring.reconciler.passes == stopped_at


async def test_an_invalid_generation_is_reconciled_once(wire: Callable[..., Wiring]) -> None:
    def answer(n: int) -> Outcome:
        return Outcome(body(n), RLRunStatus(phase="Failed"), [], invalid="bad spec" if n == 1 else None)

    invalid_before = metric("rawmm_operator_reconciles_total", result="invalid")
    wiring = wire(StandIn(answer), LoopTiming(resync_seconds=0.05))
    await wiring.run_event(generation=1)
    await eventually(lambda: wiring.reconciler.passes == 1)
    await wiring.child_event()
    await asyncio.sleep(0.3)  # six resync periods and a child event: the same generation waits
    assert wiring.reconciler.passes == 1
    assert metric("rawmm_operator_reconciles_total", result="invalid") == invalid_before + 1
    await wiring.run_event(generation=2)
    await eventually(lambda: wiring.reconciler.passes >= 2, what="a pass of the next generation")


async def test_failures_back_off_warn_once_and_recover(wire: Callable[..., Wiring]) -> None:
    def answer(n: int) -> Outcome | Exception:
        if n <= 3:
            return ApiError(503, "unavailable")
        return Outcome(body(), RLRunStatus(phase="Running"), [])

    errors_before = metric("rawmm_operator_reconciles_total", result="error")
    wiring = wire(StandIn(answer), LoopTiming(resync_seconds=NEVER, error_backoffs=(0.01, 0.02)))
    await wiring.run_event()
    await eventually(lambda: wiring.reconciler.passes == 4, what="retries until the pass succeeds")
    assert metric("rawmm_operator_reconciles_total", result="error") == errors_before + 3
    assert wiring.posted() == [("Warning", "ReconcileError")]  # once, not per retry


async def test_a_rejected_child_is_retried_with_backoff_not_at_resync(wire: Callable[..., Wiring]) -> None:
    def answer(n: int) -> Outcome:
        rejected = {"Job/exp-trainer": "quota"} if n <= 2 else {}
        return Outcome(body(), RLRunStatus(phase="Pending"), [], applying=Applying(rejected=rejected))

    rejected_before = metric("rawmm_operator_reconciles_total", result="rejected")
    wiring = wire(StandIn(answer), LoopTiming(resync_seconds=NEVER, error_backoffs=(0.01,)))
    await wiring.run_event()
    await eventually(lambda: wiring.reconciler.passes == 3, what="retries of the rejected child")
    assert metric("rawmm_operator_reconciles_total", result="rejected") == rejected_before + 2


async def test_a_job_changed_under_the_pass_is_applied_again_soon(wire: Callable[..., Wiring]) -> None:
    def answer(n: int) -> Outcome:
        outcome = Outcome(body(), RLRunStatus(phase="Running"), [])
        outcome.retry_soon = n == 1
        return outcome

    wiring = wire(StandIn(answer), LoopTiming(resync_seconds=NEVER, error_backoffs=(0.01,)))
    await wiring.run_event()
    await eventually(lambda: wiring.reconciler.passes == 2, what="the soon retry")


async def test_transitions_become_events_and_the_phase_a_gauge(wire: Callable[..., Wiring]) -> None:
    transition = Transition("Normal", "Running", "phase Pending -> Running")
    wiring = wire(
        StandIn(lambda _: Outcome(body(), RLRunStatus(phase="Suspended"), [transition])),
        LoopTiming(resync_seconds=NEVER),
    )
    suspended_before = metric("rawmm_rlruns", phase="Suspended")
    await wiring.run_event()
    await eventually(lambda: metric("rawmm_rlruns", phase="Suspended") == suspended_before + 1)
    assert wiring.posted() == [("Normal", "Running")]
    await wiring.run_event(type_="DELETED")
    await eventually(lambda: metric("rawmm_rlruns", phase="Suspended") == suspended_before, what="gauge")


def test_child_watches_are_filtered_by_the_run_label_on_the_server() -> None:
    settings = operator_settings()
    for group, version, plural in WATCHED_CHILDREN:
        assert settings.watching.label_selectors[group, version, plural] == RUN_LABEL
    assert settings.posting.level == logging.WARNING  # kopf's per-handler chatter posts no events


def test_backoff_grows_to_its_last_step() -> None:
    timing = LoopTiming(error_backoffs=(1, 2, 5))
    assert [_backoff(timing, failures) for failures in range(1, 6)] == [1, 2, 5, 5, 5]
