"""kopf wiring: one loop (an asyncio task) per RLRun runs `Reconciler.reconcile`, woken by spec changes and
by events of the run's children, and at least every `resync_seconds`.

One loop per run serializes its passes and coalesces bursts of child events into one pass. It starts
when a run is first seen (creation, or the operator starting: kopf lists every run) and stops when the
run is deleted (children go with it by owner references). The loops are driven by watch events only, so
RLRuns carry no finalizer: `kubectl delete rlrun` never waits for an operator, installed or not. An
invalid spec is reported once and waits for the next generation; API errors and refused children retry
with backoff: neither crash-loops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from rawmm_operator.kube import ApiError
from rawmm_operator.metrics import RECONCILE_SECONDS, RECONCILES, PhaseTracker
from rawmm_operator.objects import RUN_LABEL
from rawmm_operator.reconcile import Outcome, Reconciler
from rawmm_operator.spec import API_GROUP, API_VERSION, PLURAL

# Children whose changes wake their run's loop (the user's own existing claim is caught by the resync).
WATCHED_CHILDREN = (
    ("apps", "v1", "statefulsets"),
    ("batch", "v1", "jobs"),
    ("", "v1", "persistentvolumeclaims"),
)


@dataclass(frozen=True)
class LoopTiming:
    resync_seconds: float = 30.0
    error_backoffs: tuple[float, ...] = (1, 2, 5, 10, 30, 60)
    progress_seconds: float = 15.0  # least time between scrapes of a run's pods (trainer step, hit rate)


DEFAULT_TIMING = LoopTiming()
# The operator's own log lines, each naming its run (`rlrun <namespace>/<name>: ...`): kopf's object logger
# names the object only under kopf's own formatter, and `rawmm operator` logs with a plain one.
log = logging.getLogger("rawmm.operator")


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.reporting_component = "rawmm-operator"
    # Only the operator's own transition events and kopf's warnings become Kubernetes events; kopf would
    # otherwise post "Handler ... succeeded" on a child at every change of it.
    settings.posting.level = logging.WARNING
    settings.peering.standalone = True
    # Filter child watches on the server: only objects labelled with a run, never every Job in the cluster.
    for group, version, plural in WATCHED_CHILDREN:
        settings.watching.label_selectors[group, version, plural] = RUN_LABEL
    return settings


@dataclass
class _Loop:
    """A run's loop: its task, what wakes it, and the newest body seen (events are posted on it)."""

    body: dict[str, Any]
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def generation(self) -> int | None:
        return self.body.get("metadata", {}).get("generation")


def build_registry(
    reconciler: Reconciler, *, login: Callable[..., Any], timing: LoopTiming = LoopTiming()
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    loops: dict[tuple[str, str], _Loop] = {}
    phases = PhaseTracker()

    def wake(namespace: str | None, name: str | None) -> None:
        loop = loops.get((namespace or "", name or ""))
        if loop is not None:
            loop.woken.set()

    kopf.on.login(registry=registry)(login)

    @kopf.on.event(API_GROUP, API_VERSION, PLURAL, id="rlrun", registry=registry)
    async def run_event(event: dict[str, Any], namespace: str, name: str, **_: Any) -> None:
        key = (namespace, name)
        body = dict(event.get("object") or {})
        if event.get("type") == "DELETED":
            loop = loops.pop(key, None)
            if loop is not None:
                loop.stopped.set()
            return
        loop = loops.get(key)
        if loop is None or (loop.task is not None and loop.task.done()):  # new, or its loop died: (re)start
            loop = loops[key] = _Loop(body)
            loop.task = asyncio.create_task(run_loop(key, loop), name=f"rlrun {namespace}/{name}")
            return
        spec_changed = body.get("metadata", {}).get("generation") != loop.generation
        loop.body = body
        if spec_changed:  # its own status writes change no generation: they wake nothing
            loop.woken.set()

    for group, version, plural in WATCHED_CHILDREN:

        @kopf.on.event(
            group, version, plural, labels={RUN_LABEL: kopf.PRESENT}, id=f"child-{plural}", registry=registry
        )
        async def child_changed(namespace: str, labels: dict[str, str], **_: Any) -> None:
            wake(namespace, labels[RUN_LABEL])

    @kopf.on.cleanup(registry=registry)
    async def stop_loops(**_: Any) -> None:
        running = [loop for loop in loops.values() if loop.task is not None]
        for loop in running:
            loop.stopped.set()
        await asyncio.gather(*(loop.task for loop in running if loop.task), return_exceptions=True)

    def timed_reconcile(namespace: str, name: str) -> Outcome | None:
        started = time.perf_counter()
        try:
            return reconciler.reconcile(namespace, name)
        finally:
            RECONCILE_SECONDS.observe(time.perf_counter() - started)

    async def run_loop(key: tuple[str, str], loop: _Loop) -> None:
        namespace, name = key
        failures = 0
        blocked_generation: int | None = None  # the invalid generation we wait to see replaced
        try:
            while not loop.stopped.is_set():
                loop.woken.clear()
                outcome: Outcome | None = None
                if blocked_generation is None or loop.generation != blocked_generation:
                    try:
                        outcome = await asyncio.to_thread(timed_reconcile, namespace, name)
                    except Exception as exc:  # API errors and bugs alike: report, back off, retry
                        failures += 1
                        RECONCILES.labels(result="error").inc()
                        log.warning(
                            "rlrun %s/%s: reconcile failed (%d in a row): %s",
                            namespace,
                            name,
                            failures,
                            exc,
                            exc_info=not isinstance(exc, ApiError),
                        )
                        if failures == 1:
                            kopf.warn(loop.body, reason="ReconcileError", message=str(exc))
                        await _sleep_until(None, loop.stopped, _backoff(timing, failures))
                        continue
                    if outcome is not None and outcome.applying.rejected:
                        # A refused child (quota, webhook, immutable field): retry with backoff, the
                        # condition says why. The run itself is not failed.
                        failures += 1
                        RECONCILES.labels(result="rejected").inc()
                    else:
                        failures = 0
                    if outcome is not None:
                        _log_outcome(namespace, name, outcome, failures)
                        for transition in outcome.transitions:
                            kopf.event(
                                outcome.body,
                                type=transition.type,
                                reason=transition.reason,
                                message=transition.message,
                            )
                        phases.set(key, outcome.status.phase)
                        blocked_generation = (
                            outcome.body["metadata"].get("generation") if outcome.invalid else None
                        )
                        if not outcome.applying.rejected:
                            RECONCILES.labels(result="invalid" if outcome.invalid else "success").inc()
                wait = _backoff(timing, failures) if failures else timing.resync_seconds
                if outcome is not None and outcome.retry_soon:
                    wait = min(wait, timing.error_backoffs[0])
                await _sleep_until(loop.woken, loop.stopped, wait)
        finally:
            if loops.get(key) is loop:
                del loops[key]
            phases.forget(key)
            reconciler.forget(namespace, name)

    return registry


def _log_outcome(namespace: str, name: str, outcome: Outcome, failures: int) -> None:
    """What a pass did, naming the run: every transition (what its events say) and every child the API
    server refused (a 422 is the user's to fix, so it is a warning every time it is retried)."""
    for transition in outcome.transitions:
        level = logging.WARNING if transition.type == "Warning" else logging.INFO
        log.log(level, "rlrun %s/%s: %s: %s", namespace, name, transition.reason, transition.message)
    for child, message in sorted(outcome.applying.rejected.items()):
        log.warning(
            "rlrun %s/%s: the API server rejected %s (retry %d): %s",
            namespace,
            name,
            child,
            failures,
            message,
        )


def _backoff(timing: LoopTiming, failures: int) -> float:
    return timing.error_backoffs[min(failures, len(timing.error_backoffs)) - 1]


async def _sleep_until(woken: asyncio.Event | None, stopped: asyncio.Event, timeout: float) -> None:
    """Sleep `timeout` seconds, less if woken or stopped."""
    waiters = [asyncio.ensure_future(stopped.wait())]
    if woken is not None:
        waiters.append(asyncio.ensure_future(woken.wait()))
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
