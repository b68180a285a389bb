"""Finding an environment by name: the built-ins, or any `package.module:factory` of the user's."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from rawmm.rl.envs.base import Environment

EnvironmentFactory = Callable[..., Environment]

_REGISTRY: dict[str, EnvironmentFactory] = {}


class EnvironmentLoadError(ValueError):
    """An environment name or its arguments cannot be used."""


def register_environment(name: str, factory: EnvironmentFactory) -> None:
    """Make `factory(**args)` loadable as `name`. Run configs name only the built-ins registered here
    (`rawmm.config.BUILTIN_ENVIRONMENTS`) or `package.module:factory`."""
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise EnvironmentLoadError(f"environment {name!r} is already registered")
    _REGISTRY[name] = factory


def environment_names() -> list[str]:
    return sorted(_REGISTRY)


def load_environment(name: str, args: Mapping[str, Any] | None = None) -> Environment:
    """Build the environment `name` with `args`.

    `name` is a registered name (`shapes`, `shapes-multiturn`, ...) or `module.path:attribute`, where the
    attribute is an `Environment` subclass or a function returning an `Environment`.
    """
    factory = resolve_environment(name)
    try:
        environment = factory(**dict(args or {}))
    except (TypeError, ValueError) as exc:
        raise EnvironmentLoadError(f"environment {name!r}: bad arguments {dict(args or {})}: {exc}") from exc
    if not isinstance(environment, Environment):
        raise EnvironmentLoadError(
            f"environment {name!r}: factory returned {type(environment).__name__}, not a rawmm Environment"
        )
    return environment


def resolve_environment(name: str) -> EnvironmentFactory:
    """The factory `name` names (registered, or imported from `module.path:attribute`), without calling it."""
    return _REGISTRY.get(name) or _import_factory(name)


def _import_factory(name: str) -> EnvironmentFactory:
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise EnvironmentLoadError(
            f"unknown environment {name!r}: use one of {environment_names()} or 'package.module:factory'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentLoadError(f"environment {name!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise EnvironmentLoadError(f"environment {name!r}: {module_name} has no callable {attribute!r}")
    return factory
