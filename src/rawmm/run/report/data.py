"""What a report shows, read from a run's output directory (pure reading, no plotting)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rawmm.run.state import RunState

TIMELINE_NAME = (
    "timeline.jsonl"  # one line per step event seen by `rawmm run`, with the engines' cache counters
)


@dataclass(frozen=True)
class StepRow:
    """One step's numbers; None where the step's event has not been seen (yet)."""

    step: int
    reward_mean: float | None
    reward_by_label: dict[str, float]
    loss: float | None
    grad_norm: float | None
    logprob_diff_mean: float | None
    logprob_kl_mean: float | None
    cache_hit_rate: float | None  # of this step's engine lookups
    elapsed_seconds: float | None  # since the run started, when the step's batch was written
    rollout_seconds: float | None
    sync_seconds: float | None
    materialize_seconds: float | None
    train_seconds: float | None  # the trainer's step without materialization: forward, backward, checkpoint


@dataclass(frozen=True)
class RunRecord:
    run_dir: Path
    config: dict[str, Any]
    steps: list[StepRow]
    summary: dict[str, Any] | None  # summary.json; None while the run is live
    blind_ceiling: float | None  # from the environment, when it states one
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def planned_steps(self) -> int:
        return int(self.config.get("trainer", {}).get("steps", 0))

    def rewards(self) -> list[float]:
        return [row.reward_mean for row in self.steps if row.reward_mean is not None]

    def last_mean(self, n: int = 3) -> float | None:
        rewards = self.rewards()
        return statistics.fmean(rewards[-n:]) if rewards else None

    def first_above_ceiling(self) -> StepRow | None:
        """The first step whose mean reward exceeds the blind ceiling and stays above it afterwards."""
        if self.blind_ceiling is None:
            return None
        rows = [r for r in self.steps if r.reward_mean is not None]
        for i, row in enumerate(rows):
            if all(r.reward_mean is not None and r.reward_mean > self.blind_ceiling for r in rows[i:]):
                return row
        return None


def load_run(run_dir: Path) -> RunRecord:
    """Everything a report needs from `run_dir` (what `rawmm run --output-dir` names)."""
    import yaml

    run_dir = Path(run_dir)
    config_path = run_dir / "run-config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is no rawmm run output directory (no run-config.yaml)")
    config = yaml.safe_load(config_path.read_text()) or {}
    state = RunState(engine_urls=[])
    for name in ("orchestrator", "trainer"):
        log = run_dir / "logs" / f"{name}.log"
        if log.is_file():
            for line in log.read_text(errors="replace").splitlines():
                state.read_line(line)
    timeline = _timeline(run_dir / TIMELINE_NAME)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return RunRecord(
        run_dir=run_dir,
        config=config,
        steps=_rows(state, timeline),
        summary=summary,
        blind_ceiling=_blind_ceiling(config),
    )


def _timeline(path: Path) -> dict[int, dict[str, Any]]:
    """The engines' cumulative cache counters and the run's clock when each step's batch was seen."""
    by_step: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line being written while we read
            if entry.get("event") == "orchestrator_step":
                by_step.setdefault(int(entry["step"]), entry)  # when the step was first seen
    return by_step


def _rows(state: RunState, timeline: dict[int, dict[str, Any]]) -> list[StepRow]:
    rows = []
    previous = (0.0, 0.0)
    for step in sorted(set(state.orchestrator_steps) | set(state.trainer_steps)):
        orchestrator = state.orchestrator_steps.get(step, {})
        trainer = state.trainer_steps.get(step, {})
        seen = timeline.get(step)
        hit_rate = None
        if seen is not None:
            hits, misses = float(seen["cache_hits"]), float(seen["cache_misses"])
            lookups = (hits - previous[0]) + (misses - previous[1])
            hit_rate = (hits - previous[0]) / lookups if lookups > 0 else None
            previous = (hits, misses)
        step_seconds, materialize = trainer.get("step_seconds"), trainer.get("materialize_seconds")
        rows.append(
            StepRow(
                step=step,
                reward_mean=orchestrator.get("reward_mean"),
                reward_by_label=dict(orchestrator.get("reward_by_label", {})),
                loss=trainer.get("loss"),
                grad_norm=trainer.get("grad_norm"),
                logprob_diff_mean=trainer.get("logprob_diff_mean"),
                logprob_kl_mean=trainer.get("logprob_kl_mean"),
                cache_hit_rate=hit_rate,
                elapsed_seconds=seen.get("elapsed_seconds") if seen else None,
                rollout_seconds=orchestrator.get("rollout_seconds"),
                sync_seconds=orchestrator.get("sync_seconds"),
                materialize_seconds=materialize,
                train_seconds=step_seconds - materialize
                if step_seconds is not None and materialize is not None
                else None,
            )
        )
    return rows


def _blind_ceiling(config: dict[str, Any]) -> float | None:
    from rawmm.rl.envs import EnvironmentLoadError, environment_names, load_environment

    environment = config.get("orchestrator", {}).get("environment", {})
    if environment.get("name") not in environment_names():
        return None  # a user's factory may do anything when called; only built-ins are built here
    try:
        built = load_environment(environment.get("name", ""), environment.get("args", {}))
    except EnvironmentLoadError:
        return None
    ceiling = getattr(built, "blind_ceiling", None)
    return float(ceiling) if isinstance(ceiling, int | float) else None
