"""Environments: the interface (`Environment`, `Episode`, `StepResult`) and the built-in tasks (shapes, colours).

Plug in your own by naming `package.module:factory` as `orchestrator.environment.name` in the run
config (the factory gets `orchestrator.environment.args` as keyword arguments), or by calling
`register_environment(name, factory)` before the orchestrator starts.
"""

from rawmm.rl.envs.base import Environment, Episode, Message, StepResult
from rawmm.rl.envs.registry import (
    EnvironmentLoadError,
    environment_names,
    load_environment,
    register_environment,
    resolve_environment,
)
from rawmm.rl.envs.colours import ColoursEnvironment
from rawmm.rl.envs.shapes import MultiTurnShapesEnvironment, ShapesEnvironment

__all__ = [
    "ColoursEnvironment",
    "Environment",
    "EnvironmentLoadError",
    "Episode",
    "Message",
    "MultiTurnShapesEnvironment",
    "ShapesEnvironment",
    "StepResult",
    "environment_names",
    "load_environment",
    "register_environment",
    "resolve_environment",
]
