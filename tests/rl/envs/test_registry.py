from __future__ import annotations

import sys
import types

import pytest

from rawmm.rl.envs import (
    Environment,
    EnvironmentLoadError,
    Episode,
    MultiTurnShapesEnvironment,
    StepResult,
    environment_names,
    load_environment,
)


class EchoEpisode(Episode):
    def __init__(self, word: str) -> None:
        self.word = word

    def start(self):
        return [{"role": "user", "content": f"say {self.word}"}]

    def step(self, reply: str) -> StepResult:
        return StepResult(reward=float(reply.strip() == self.word), done=True)


class EchoEnvironment(Environment):
    def __init__(self, word: str = "hi") -> None:
        self.word = word

    def episode(self, seed: int) -> Episode:
        return EchoEpisode(f"{self.word}{seed}")


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("my_envs")
    module.EchoEnvironment = EchoEnvironment
    module.not_an_env = lambda: object()
    monkeypatch.setitem(sys.modules, "my_envs", module)
    return module


def test_builtins_are_registered_and_take_their_args():
    assert {"shapes", "shapes-multiturn"} <= set(environment_names())
    environment = load_environment("shapes-multiturn", {"views": 2, "image_size": 56})
    assert isinstance(environment, MultiTurnShapesEnvironment) and environment.views == 2


def test_the_run_config_names_exactly_the_registered_builtins():
    """The run config refuses any other name without importing rawmm.rl: its list must be the registry's."""
    from rawmm.config import BUILTIN_ENVIRONMENTS

    assert sorted(BUILTIN_ENVIRONMENTS) == environment_names()


def test_a_users_environment_loads_by_module_path(user_module):
    environment = load_environment("my_envs:EchoEnvironment", {"word": "yo"})
    episode = environment.episode(4)
    assert episode.start() == [{"role": "user", "content": "say yo4"}]
    assert episode.step("yo4").reward == 1.0


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("nope", {}, r"unknown environment 'nope'.*shapes-multiturn"),
        ("shapes", {"colours": 3}, r"environment 'shapes': bad arguments"),
        ("shapes", {"max_shapes": 99}, r"bad arguments.*max_shapes"),
        ("no_such_module_xyz:Env", {}, r"cannot import 'no_such_module_xyz'"),
        ("my_envs:Missing", {}, r"has no callable 'Missing'"),
        ("my_envs:not_an_env", {}, r"returned object, not a rawmm Environment"),
    ],
)
def test_bad_names_and_args_are_clear_errors(user_module, name, args, message):
    with pytest.raises(EnvironmentLoadError, match=message):
        load_environment(name, args)
