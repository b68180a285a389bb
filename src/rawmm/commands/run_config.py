"""Reading the run config for the commands that take one (`orchestrate`, `train`, `run`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rawmm.commands import CliError

if TYPE_CHECKING:
    from rawmm.config import RunConfig


def load_run_config(path: str) -> RunConfig:
    """The run config YAML at `path`; an unreadable or invalid one is a `CliError` naming every bad field."""
    from rawmm.config import ConfigError, RunConfig

    try:
        return RunConfig.from_yaml(path)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def steps_to_run(requested: int | None, config: RunConfig) -> int:
    """`--steps` when given, else `trainer.steps`; at least 1."""
    steps = requested if requested is not None else config.trainer.steps
    if steps < 1:
        raise CliError(f"--steps must be at least 1, got {steps}")
    return steps
