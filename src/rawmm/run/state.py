"""What a local run knows about itself while it runs, and the summary it writes at the end.

Per-step numbers come from the JSON lines the orchestrator and the trainer print for every step
(`{"event": "orchestrator_step" | "trainer_step", ...}`); counters and gauges from the last scrape of
each /metrics endpoint. The engines' numbers in the summary are a scrape taken after the trainer
and orchestrator finished and before the engines stop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rawmm.contract.shared_dir import SharedDir, checkpoint_dir, checkpoint_steps
from rawmm.run.scrape import Scrape

SUMMARY_KEYS = (
    "status",
    "error",
    "steps",
    "steps_completed",
    "reward_mean",
    "loss",
    "grad_norm",
    "cache_hits",
    "cache_misses",
    "cache_hit_rate",
    "invalid_mm_image_refs",
    "images_materialized_trainer",
    "missing_images_trainer",
    "samples_dropped",
    "checkpoints",
    "engine_weights_version",
    "wall_seconds",
    "output_dir",
    "shared_dir",
)


@dataclass
class RunState:
    engine_urls: list[str]
    orchestrator_steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    trainer_steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    engines: dict[str, Scrape] = field(default_factory=dict)
    orchestrator: Scrape | None = None
    trainer: Scrape | None = None
    engine_versions: dict[str, int | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def read_line(self, line: str) -> dict[str, Any] | None:
        """Record a step event if `line` is one; returns it."""
        if not line.startswith("{"):
            return None
        try:
            event = json.loads(line)
        except ValueError:
            return None
        if not isinstance(event, dict) or not isinstance(event.get("step"), int):
            return None
        if event.get("event") == "orchestrator_step":
            self.orchestrator_steps[event["step"]] = event
        elif event.get("event") == "trainer_step":
            self.trainer_steps[event["step"]] = event
        else:
            return None
        return event

    @property
    def cache_hits(self) -> int:
        return int(sum(s.total("rawmm_materialize_cache_hits_total") for s in self.engines.values()))

    @property
    def cache_misses(self) -> int:
        return int(sum(s.total("rawmm_materialize_cache_misses_total") for s in self.engines.values()))

    @property
    def cache_hit_rate(self) -> float | None:
        lookups = self.cache_hits + self.cache_misses
        return self.cache_hits / lookups if lookups else None

    @property
    def invalid_refs(self) -> int:
        return int(sum(s.total("rawmm_invalid_mm_image_ref_total") for s in self.engines.values()))

    @property
    def samples_dropped(self) -> dict[str, int]:
        dropped: dict[str, int] = {}
        for report in self.orchestrator_steps.values():
            for reason, count in report.get("dropped", {}).items():
                dropped[reason] = dropped.get(reason, 0) + int(count)
        return dropped

    def summary(
        self,
        *,
        status: str,
        error: str | None,
        steps: int,
        shared_dir: Path,
        output_dir: Path,
        wall_seconds: float,
    ) -> dict[str, Any]:
        checkpoints_dir = SharedDir(shared_dir).checkpoints_dir
        checkpoints = [checkpoint_dir(checkpoints_dir, step) for step in checkpoint_steps(checkpoints_dir)]
        trained = sorted(self.trainer_steps)
        summary = {
            "status": status,
            "error": error,
            "steps": steps,
            "steps_completed": len(trained),
            "reward_mean": [
                self.orchestrator_steps[s]["reward_mean"] for s in sorted(self.orchestrator_steps)
            ],
            "loss": [self.trainer_steps[s]["loss"] for s in trained],
            "grad_norm": [self.trainer_steps[s]["grad_norm"] for s in trained],
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "cache_hit_rate": self.cache_hit_rate,
            "invalid_mm_image_refs": self.invalid_refs,
            "images_materialized_trainer": sum(
                int(self.trainer_steps[s]["images_materialized"]) for s in trained
            ),
            "missing_images_trainer": sum(int(self.trainer_steps[s]["missing_images"]) for s in trained),
            "samples_dropped": self.samples_dropped,
            "checkpoints": [str(p) for p in checkpoints],
            "engine_weights_version": {url: self.engine_versions.get(url) for url in self.engine_urls},
            "wall_seconds": round(wall_seconds, 3),
            "output_dir": str(output_dir),
            "shared_dir": str(shared_dir),
        }
        return {**summary, "per_step": self._per_step(), "warnings": list(self.warnings)}

    def _per_step(self) -> list[dict[str, Any]]:
        steps = sorted(set(self.orchestrator_steps) | set(self.trainer_steps))
        return [
            {"step": s, "orchestrator": self.orchestrator_steps.get(s), "trainer": self.trainer_steps.get(s)}
            for s in steps
        ]
