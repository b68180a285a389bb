"""One rollout: an episode played against a pinned engine replica, and the samples it trains.

Every turn renders the whole conversation so far (all earlier images included) with the contract's
renderer, sends its tokens and image refs to the engine, and hands the decoded reply to the
episode. The trainer gets one sample per prefix-consistent branch (`branch_samples`): a turn whose
prompt starts with exactly an earlier sample's tokens and images (its prompt, the tokens the engine
sampled, nothing re-rendered) extends that sample; any other turn (a chat template that re-renders an
earlier assistant turn, a reply cut at a placeholder) starts a new branch. Either way every sampled
token is trained on, scored with exactly the context the engine saw, and never re-tokenized; a T-turn
rollout then trains its prompt tokens and images once, not T times. The turns share the rollout's
advantage. `turn_samples` (one sample per turn) is the same data unmerged: the reference the merged
samples are checked against, and the benchmark's before.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rawmm.contract import OffloadStore, offload_message_images, render_chat, resolve_preset
from rawmm.contract.engine_api import GenerateRequest, GenerateResponse, Sampling
from rawmm.rl.envs import Episode, Message
from rawmm.rl.orchestrator.replicas import ReplicaPool
from rawmm.rl.samples import Sample, completion_sample, extend_sample


class PromptRenderer:
    """The run model's tokenizer and image layout, loaded once; renders conversations to prompts.

    Safe to call from several threads: a fast tokenizer must not be used concurrently (it mutates
    its truncation/padding state per call), so tokenizer work is serialized.
    """

    def __init__(self, model_path: str | Path, preset: str, backend: str, store: OffloadStore) -> None:
        self.family, _ = resolve_preset(preset)
        self.config = self.family.config_from_pretrained(model_path)  # fails fast on a wrong path
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.backend, self.store = backend, store
        self._tokenizer_lock = threading.Lock()
        placeholder_id = self.tokenizer.convert_tokens_to_ids(self.family.placeholder_token)
        assert isinstance(placeholder_id, int)  # one token in, one id out
        self.placeholder_id = placeholder_id

    def offload(self, messages: list[Message]) -> list[Message]:
        return offload_message_images(messages, self.store)

    def render(self, messages: list[Message]) -> Any:
        with self._tokenizer_lock:
            return render_chat(
                messages,
                tokenizer=self.tokenizer,
                family=self.family,
                config=self.config,
                store=self.store,
                backend=self.backend,
            )

    def decode(self, token_ids: list[int]) -> str:
        with self._tokenizer_lock:
            return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))


@dataclass(frozen=True)
class RolloutId:
    step: int
    group: int
    index: int

    def __str__(self) -> str:
        return f"step{self.step}-g{self.group}-r{self.index}"


@dataclass(frozen=True)
class Turn:
    prompt: Any  # rawmm.contract RenderedPrompt
    generation: GenerateResponse  # with one logprob per token (the client checks)
    replica: str


@dataclass
class Rollout:
    id: RolloutId
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    seconds: float = 0.0

    @property
    def images(self) -> int:
        """Images sent over all turns (earlier images count again on every turn)."""
        return sum(len(t.prompt.images) for t in self.turns)


def request_seed(run_seed: int, rollout: RolloutId, turn: int) -> int:
    """A sampling seed unique to (run, rollout, turn), identical across restarts."""
    text = f"{run_seed}:{rollout.step}:{rollout.group}:{rollout.index}:{turn}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big") >> 1


async def play(
    episode: Episode,
    rollout_id: RolloutId,
    *,
    renderer: PromptRenderer,
    pool: ReplicaPool,
    sampling: Sampling,
    max_turns: int,
    run_seed: int,
) -> Rollout:
    """Play `episode` for at most `max_turns` replies. Engine errors propagate (the caller drops the
    rollout on an invalid ref)."""
    started = time.perf_counter()
    rollout = Rollout(rollout_id)
    messages = await asyncio.to_thread(lambda: renderer.offload(episode.start()))
    for turn in range(max_turns):
        prompt = await asyncio.to_thread(renderer.render, messages)
        request = GenerateRequest(
            prompt_token_ids=list(prompt.token_ids),
            features=prompt.features() if prompt.images else None,
            sampling=sampling.model_copy(
                update={"seed": request_seed(run_seed, rollout_id, turn), "logprobs": True}
            ),
        )
        replica, generation = await pool.generate(str(rollout_id), request)
        rollout.turns.append(Turn(prompt, generation, replica))
        reply = await asyncio.to_thread(renderer.decode, generation.token_ids)
        result = episode.step(reply)
        rollout.reward += result.reward
        if result.done or turn + 1 == max_turns:
            break
        new_messages = await asyncio.to_thread(renderer.offload, result.messages)
        messages = [*messages, {"role": "assistant", "content": reply}, *new_messages]
    rollout.seconds = time.perf_counter() - started
    return rollout


def trainable_completion(generation: GenerateResponse, placeholder_id: int) -> tuple[list[int], list[float]]:
    """The generated tokens and logprobs up to the first image placeholder token, if any.

    A policy can sample the placeholder token (random tiny models do). In a training sample the model
    would count it as an image position without an image and the forward fails, so the sample keeps
    only the prefix before it; the conversation itself goes on with the decoded text, which drops it.
    """
    tokens, logprobs = generation.token_ids, generation.logprobs
    assert logprobs is not None  # EngineClient.generate returns none without them
    cut = tokens.index(placeholder_id) if placeholder_id in tokens else len(tokens)
    return tokens[:cut], logprobs[:cut]


def _trainable_turns(
    rollout: Rollout, placeholder_id: int
) -> Iterator[tuple[int, Turn, list[int], list[float]]]:
    """Each turn that generated trainable tokens: its number, itself, and those tokens and logprobs."""
    for number, turn in enumerate(rollout.turns):
        tokens, logprobs = trainable_completion(turn.generation, placeholder_id)
        if tokens:
            yield number, turn, tokens, logprobs


def _first_turn_sample(
    rollout: Rollout, number: int, turn: Turn, tokens: list[int], logprobs: list[float], advantage: float
) -> Sample:
    return completion_sample(
        turn.prompt,
        tokens,
        logprobs,
        advantage=advantage,
        reward=rollout.reward,
        sample_id=f"{rollout.id}-t{number}",
    )


def turn_samples(rollout: Rollout, advantage: float, placeholder_id: int) -> list[Sample]:
    """One sample per turn that generated trainable tokens: its prompt plus its completion."""
    return [
        _first_turn_sample(rollout, number, turn, tokens, logprobs, advantage)
        for number, turn, tokens, logprobs in _trainable_turns(rollout, placeholder_id)
    ]


def branch_samples(rollout: Rollout, advantage: float, placeholder_id: int) -> list[Sample]:
    """One sample per prefix-consistent branch of the rollout's turns (named after its first turn).

    A turn extends the newest branch its prompt starts with (tokens and images, exactly); otherwise it
    forks a new branch. Loss is on every turn's sampled tokens, as in `turn_samples`.
    """
    branches: list[Sample] = []
    for number, turn, tokens, logprobs in _trainable_turns(rollout, placeholder_id):
        for index in reversed(range(len(branches))):
            extended = extend_sample(branches[index], turn.prompt, tokens, logprobs, advantage=advantage)
            if extended is not None:
                branches[index] = extended
                break
        else:
            branches.append(_first_turn_sample(rollout, number, turn, tokens, logprobs, advantage))
    return branches
