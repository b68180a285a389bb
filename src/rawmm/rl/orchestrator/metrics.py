"""The orchestrator's Prometheus metrics (docs/architecture.md §8), on a registry of its own.

A registry per orchestrator keeps every instance's numbers separate (tests run several in one
process); `rawmm orchestrate` serves it on `monitoring.orchestrator_metrics_port`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DROP_REASONS = ("invalid_mm_image_ref", "engine_rejected")
ENGINE_ERROR_KINDS = ("unreachable", "timeout", "server_error", "bad_response", "invalid_ref", "rejected")


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.step = Gauge("rawmm_orchestrator_step", "Last step whose rollout batch was written", registry=r)
        self.rollouts = Counter("rawmm_rollouts", "Rollouts completed (dropped ones excluded)", registry=r)
        self.reward_mean = Gauge(
            "rawmm_reward_mean", "Mean rollout reward of the last written step", registry=r
        )
        self.samples_dropped = Counter(
            "rawmm_samples_dropped", "Rollouts dropped before training, by reason", ["reason"], registry=r
        )
        self.engine_errors = Counter(
            "rawmm_engine_request_errors",
            "Failed engine requests (each attempt), by kind",
            ["kind"],
            registry=r,
        )
        self.replicas_up = Gauge(
            "rawmm_engine_replicas_up", "Engine replicas currently taking rollouts", registry=r
        )
        self.weights_step = Gauge(
            "rawmm_orchestrator_weights_step",
            "Checkpoint step every live replica was told to load",
            registry=r,
        )
        self.rollout_seconds = Histogram(
            "rawmm_rollout_seconds",
            "Wall time of one rollout (all turns)",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        # Show every documented label from the start, so dashboards see zeros rather than no data.
        for reason in DROP_REASONS:
            self.samples_dropped.labels(reason=reason)
        for kind in ENGINE_ERROR_KINDS:
            self.engine_errors.labels(kind=kind)
