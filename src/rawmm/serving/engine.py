"""What the HTTP routes need from an engine, and the gate that orders generation and weight updates."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from rawmm.contract import FeatureImage
from rawmm.contract.engine_api import Sampling, temperature_problem
from rawmm.contract.weight_transfer import TransferInit, TransferUpdate
from rawmm.materialize import EngineItem, LoadedProcessor


class InvalidRequest(ValueError):
    """A client error that is not about an image ref (token ids, lengths, a weights path): HTTP 400
    ``invalid_request`` with ``reason``, a stable snake_case name clients can branch on."""

    def __init__(self, message: str, *, reason: str = "invalid_request") -> None:
        super().__init__(message)
        self.reason = reason


class EngineUnavailable(RuntimeError):
    """The engine cannot serve right now (its vLLM engine core died): HTTP 503, ``/health`` unhealthy."""


@dataclass(frozen=True)
class ImageInput:
    """One image of a request: where it sits in the prompt, and its materialized item."""

    feature: FeatureImage
    item: EngineItem


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    weights_version: int


class WeightsGate:
    """Lets generations run together and a weight update run alone, so every response reports the weights
    it was generated with. A pending update holds back new generations, lets in-flight ones finish, swaps,
    then bumps the version (only if the swap succeeded)."""

    def __init__(self) -> None:
        self.version = 0
        self._active = 0
        self._updating = False
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[int]:
        """Hold the current weights for one generation; yields their version."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._active += 1
        try:
            yield self.version
        finally:
            async with self._changed:
                self._active -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """Run a weight update alone; the version advances when the block exits without error."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._updating = True
            await self._changed.wait_for(lambda: self._active == 0)
        try:
            yield
            self.version += 1
        finally:
            async with self._changed:
                self._updating = False
                self._changed.notify_all()


_NO_BROADCAST = "this engine takes weights from checkpoints only (no weight broadcast)"


class Engine(ABC):
    """A model behind the rawmm routes: generates from token ids plus materialized images."""

    processor: LoadedProcessor
    placeholder_token_id: int  # the token image placeholders are made of
    vocab_size: int
    max_model_len: int  # prompt plus completion

    def __init__(self) -> None:
        self.gate = WeightsGate()

    @property
    def weights_version(self) -> int:
        return self.gate.version

    def check_request(self, token_ids: Sequence[int], sampling: Sampling) -> None:
        """Reject a prompt the model cannot take, or sampling it cannot do (``InvalidRequest``), before any
        work is done for it."""
        if (problem := temperature_problem(sampling.temperature)) is not None:
            raise InvalidRequest(problem, reason="temperature_too_low")
        max_tokens = sampling.max_tokens
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                reason="token_out_of_vocabulary",
            )
        if len(token_ids) + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"{len(token_ids)} prompt tokens + max_tokens {max_tokens} exceed the model's "
                f"{self.max_model_len}-token context",
                reason="prompt_too_long",
            )

    @abstractmethod
    async def check_health(self) -> None:
        """Raise if the engine cannot serve."""

    @abstractmethod
    async def generate(
        self, token_ids: list[int], images: Sequence[ImageInput], sampling: Sampling
    ) -> Generation:
        """Sample a completion; the images are in prompt order.

        Cancelled when the request's client goes away: the engine then stops generating and lets go of the
        images before the ``CancelledError`` propagates, since the caller's lease on their items ends with it."""

    @abstractmethod
    async def load_weights(self, path: str) -> int:
        """Load new weights from a checkpoint directory; returns the new weights version."""

    # The broadcast path (rawmm.contract.weight_transfer): engines that cannot take it refuse every step.
    async def init_weight_transfer(self, info: TransferInit) -> str:
        """Join the sender's group; returns the dtype the engine serves its weights in (``wire_dtype``)."""
        raise InvalidRequest(_NO_BROADCAST, reason="weight_transfer_unsupported")

    async def start_weight_update(self) -> None:
        raise InvalidRequest(_NO_BROADCAST, reason="weight_transfer_unsupported")

    async def update_weights(self, update: TransferUpdate) -> None:
        raise InvalidRequest(_NO_BROADCAST, reason="weight_transfer_unsupported")

    async def finish_weight_update(self) -> int:
        """Resume on the received weights; returns the new weights version."""
        raise InvalidRequest(_NO_BROADCAST, reason="weight_transfer_unsupported")

    @abstractmethod
    async def close(self) -> None:
        """Release the model (called once at shutdown)."""
