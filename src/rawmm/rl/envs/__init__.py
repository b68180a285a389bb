"""Environments: the interface (`Environment`, `Episode`, `StepResult`) and the built-in tasks (shapes, colours).

Plug in your own by naming `package.module:factory` as `orchestrator.environment.name` in the run
config (the factory gets `orchestrator.environment.args` as keyword arguments). The run config accepts
only that form and the built-in names (`rawmm.config.BUILTIN_ENVIRONMENTS`, which a test holds equal to
what this package registers), so a misspelt name is refused before a run starts; a built-in added here
is added there too.
"""

from rawmm.rl.envs.base import Environment, Episode, Message, StepResult
from rawmm.rl.envs.colours import ColoursEnvironment
from rawmm.rl.envs.registry import (
    EnvironmentLoadError,
    environment_names,
    load_environment,
    register_environment,
    resolve_environment,
)
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
