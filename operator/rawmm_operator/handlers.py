"""kopf wiring: one loop (a kopf daemon) per RLRun runs `Reconciler.reconcile`, woken by spec changes and
by events of the run's children, and at least every `resync_seconds`.

One loop per run serializes its passes and coalesces bursts of child events into one pass. It starts
when a run appears (creation, or the operator starting: resume) and stops when the run is deleted
(children go with it by owner references). An invalid spec is reported once and waits for the next
generation; API errors retry with backoff: neither crash-loops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kopf

from rawmm_operator.builders import RUN_LABEL
from rawmm_operator.kube import ApiError
from rawmm_operator.metrics import RECONCILE_SECONDS, RECONCILES, PhaseTracker
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


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    # Keep kopf's bookkeeping in annotations: the status schema is ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.posting.reporting_component = "rawmm-operator"
    settings.peering.standalone = True
    # Filter child watches on the server: only objects labelled with a run, never every Job in the cluster.
    for group, version, plural in WATCHED_CHILDREN:
        settings.watching.label_selectors[group, version, plural] = RUN_LABEL
    return settings


def build_registry(
    reconciler: Reconciler, *, login: Callable[..., Any], timing: LoopTiming = LoopTiming()
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    wakeups: dict[tuple[str, str], asyncio.Event] = {}
    phases = PhaseTracker()

    def wake(namespace: str | None, name: str | None) -> None:
        event = wakeups.get((namespace or "", name or ""))
        if event is not None:
            event.set()

    kopf.on.login(registry=registry)(login)

    @kopf.on.update(API_GROUP, API_VERSION, PLURAL, field="spec", registry=registry)
    async def spec_changed(namespace: str, name: str, **_: Any) -> None:
        wake(namespace, name)

    for group, version, plural in WATCHED_CHILDREN:

        @kopf.on.event(
            group, version, plural, labels={RUN_LABEL: kopf.PRESENT}, id=f"child-{plural}", registry=registry
        )
        async def child_changed(namespace: str, labels: dict[str, str], **_: Any) -> None:
            wake(namespace, labels[RUN_LABEL])

    def timed_reconcile(namespace: str, name: str) -> Outcome | None:
        started = time.perf_counter()
        try:
            return reconciler.reconcile(namespace, name)
        finally:
            RECONCILE_SECONDS.observe(time.perf_counter() - started)

    @kopf.daemon(API_GROUP, API_VERSION, PLURAL, id="reconcile", cancellation_timeout=10, registry=registry)
    async def run_loop(
        namespace: str, name: str, body: kopf.Body, stopped: kopf.DaemonStopped, logger: Any, **_: Any
    ) -> None:
        key = (namespace, name)
        woken = wakeups.setdefault(key, asyncio.Event())
        failures = 0
        blocked_generation: int | None = None  # the invalid generation we wait to see replaced
        try:
            while not stopped:
                woken.clear()
                if blocked_generation is None or body.metadata.get("generation") != blocked_generation:
                    try:
                        outcome = await asyncio.to_thread(timed_reconcile, namespace, name)
                    except Exception as exc:  # API errors and bugs alike: report, back off, retry
                        failures += 1
                        RECONCILES.labels(result="error").inc()
                        logger.warning(
                            f"reconcile failed ({failures} in a row): {exc}",
                            exc_info=not isinstance(exc, ApiError),
                        )
                        if failures == 1:
                            kopf.warn(body, reason="ReconcileError", message=str(exc))
                        backoff = timing.error_backoffs[min(failures, len(timing.error_backoffs)) - 1]
                        await _sleep_until(None, stopped, backoff)
                        continue
                    if outcome is not None and outcome.applying.rejected:
                        # A refused child (quota, webhook, immutable field): retry with backoff, the
                        # condition says why. The run itself is not failed.
                        failures += 1
                        RECONCILES.labels(result="rejected").inc()
                    else:
                        failures = 0
                    if outcome is not None:
                        for transition in outcome.transitions:
                            kopf.event(
                                body,
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
                wait = timing.resync_seconds
                if failures:
                    wait = timing.error_backoffs[min(failures, len(timing.error_backoffs)) - 1]
                await _sleep_until(woken, stopped, wait)
        finally:
            wakeups.pop(key, None)
            phases.forget(key)
            reconciler.forget(namespace, name)

    return registry


async def _sleep_until(woken: asyncio.Event | None, stopped: kopf.DaemonStopped, timeout: float) -> None:
    """Sleep `timeout` seconds, less if woken or stopped."""
    waiters = [asyncio.ensure_future(stopped.wait(timeout))]
    if woken is not None:
        waiters.append(asyncio.ensure_future(woken.wait()))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
