"""The operator's own metrics (`rawmm_operator.metrics`): every result and phase is exported from the start,
and `rawmm_rlruns{phase}` counts the live runs in each phase."""

from __future__ import annotations

from typing import get_args

from prometheus_client import REGISTRY

from rawmm_operator.metrics import RESULTS, PhaseTracker
from rawmm_operator.status import Phase


def runs(phase: str) -> float | None:
    return REGISTRY.get_sample_value("rawmm_rlruns", {"phase": phase})


def test_every_result_is_exported_before_its_first_pass() -> None:
    """A rate() over a series that appears only with its first increment misses that increment."""
    for result in RESULTS:
        assert REGISTRY.get_sample_value("rawmm_operator_reconciles_total", {"result": result}) is not None
    assert REGISTRY.get_sample_value("rawmm_operator_reconcile_seconds_count") is not None


def test_a_tracker_publishes_every_phase_of_the_status_model() -> None:
    PhaseTracker()
    assert {phase: runs(phase) for phase in get_args(Phase)} == dict.fromkeys(get_args(Phase), 0.0)


def test_the_gauge_counts_live_runs_by_their_latest_phase() -> None:
    tracker = PhaseTracker()
    tracker.set(("ml", "one"), "Pending")
    tracker.set(("ml", "two"), "Pending")
    tracker.set(("other", "one"), "Running")
    assert (runs("Pending"), runs("Running")) == (2.0, 1.0)
    tracker.set(("ml", "one"), "Running")  # a run moves: counted once, in its new phase
    assert (runs("Pending"), runs("Running")) == (1.0, 2.0)
    tracker.forget(("ml", "two"))
    tracker.forget(("ml", "gone"))  # never seen: nothing to forget
    assert (runs("Pending"), runs("Running")) == (0.0, 2.0)
    PhaseTracker()  # the last tracker made publishes: leave the gauge at zero for the other tests
