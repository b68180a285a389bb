"""The operator's Prometheus metrics (docs/architecture.md §8)."""

from __future__ import annotations

from typing import get_args

from prometheus_client import Counter, Gauge, Histogram

from rawmm_operator.status import Phase

RESULTS = ("success", "invalid", "rejected", "error")
PHASES: tuple[Phase, ...] = get_args(Phase)

RECONCILES = Counter(
    "rawmm_operator_reconciles",
    "RLRun reconciliation passes by result (success, invalid spec, child rejected by the server, error)",
    ["result"],
)
RECONCILE_SECONDS = Histogram(
    "rawmm_operator_reconcile_seconds",
    "time of one RLRun reconciliation pass",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RLRUNS = Gauge("rawmm_rlruns", "RLRuns this operator reconciles, by phase", ["phase"])
for _result in RESULTS:
    RECONCILES.labels(result=_result)


class PhaseTracker:
    """Keeps `rawmm_rlruns{phase}` equal to the count of live runs in each phase."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}
        self._publish()

    def set(self, run: tuple[str, str], phase: str) -> None:
        self._phases[run] = phase
        self._publish()

    def forget(self, run: tuple[str, str]) -> None:
        self._phases.pop(run, None)
        self._publish()

    def _publish(self) -> None:
        for phase in PHASES:
            RLRUNS.labels(phase=phase).set(sum(1 for p in self._phases.values() if p == phase))
