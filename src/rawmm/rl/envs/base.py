"""The environment interface: what the orchestrator needs from a task, and nothing more.

An `Environment` is a factory of `Episode`s. `environment.episode(seed)` starts one conversation;
the same seed must give the same task (the orchestrator runs every rollout of a group on the same
seed, so the group shares its prompt images byte for byte). An episode opens with `start()` and
answers each model reply with `step(reply)`:

    class Episode:
        def start(self) -> list[Message]: ...            # opening messages (user/system)
        def step(self, reply: str) -> StepResult: ...    # reward for this reply, new messages, done?

Messages are OpenAI/HF chat dicts. Image parts may take any shape the offload store ingests
(`{"type": "image", "image": <PIL.Image | bytes | path>}`, `{"type": "image_url", ...}` with a
`data:` URL, ...); the orchestrator offloads them to the shared volume, so an environment never
deals with refs. The orchestrator stops an episode after `max_turns` replies even if it is not done.
A rollout's reward is the sum of its steps' rewards.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model reply."""

    reward: float
    done: bool
    messages: list[Message] = field(default_factory=list)


class Episode(ABC):
    """One conversation with an environment."""

    @abstractmethod
    def start(self) -> list[Message]:
        """The opening messages of the conversation."""

    @abstractmethod
    def step(self, reply: str) -> StepResult:
        """Score `reply` (the model's text) and return what the environment says next."""

    def outcomes(self) -> list[tuple[str, float]]:
        """(label, score in [0, 1]) for each reply scored so far, the label naming what was asked (e.g. the
        correct answer): the orchestrator reports the mean score per label every step. None by default."""
        return []


class Environment(ABC):
    """A verifiable task: a deterministic source of episodes."""

    @abstractmethod
    def episode(self, seed: int) -> Episode:
        """Start the episode identified by `seed` (same seed, same task)."""
