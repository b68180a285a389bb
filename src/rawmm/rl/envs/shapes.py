"""The built-in environments: questions about generated scenes of coloured shapes, verifiable rewards.

- `shapes`: one image, one question (count, colour or position), one reply.
- `shapes-multiturn`: a scene split into several views; each reply is an action (`next`, `zoom`,
  `crop <quadrant>`) answered with a NEW image, or `answer <word>`. The conversation keeps every
  earlier image, so every request re-sends all of them: the workload the materialize cache is for.
  A reply that is no action shows the next view, so even a random policy produces one new image
  per turn.

Both take `reward: exact | partial` (environment `args`; default `exact`, see `rawmm.rl.envs.rewards`).
In `shapes-multiturn` every reply is an answer attempt: a rollout earns the score of its best attempt,
paid as each reply improves on the best so far (so the rewards of its turns sum to that score). Under
`exact` only `answer <target>` scores, and the rewards are those of a plain exact-match reward.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from PIL import Image

from rawmm.rl.envs.base import Environment, Episode, Message, StepResult
from rawmm.rl.envs.registry import register_environment
from rawmm.rl.envs.rewards import check_reward_mode, score
from rawmm.rl.envs.scene import COLOURS, GRID, Box, Shape, draw, random_panel

_QUADRANTS = ("top-left", "top-right", "bottom-left", "bottom-right")
_ACTION = re.compile(
    r"\b(?:(answer)\b(?:\s+is)?\s*[:=-]?\s*(\S+)|(crop)\s+("
    + "|".join(_QUADRANTS)
    + r")\b|(zoom)\b|(next)\b)"
)
_ANSWER = re.compile(r"\banswer\b(?:\s+is)?\s*[:=-]?\s*(\S+)")


def normalize(text: str) -> str:
    return text.strip().strip(".,;:!?\"'`()[]{}<>").lower()


def extract_answer(reply: str) -> str:
    """The word after `answer` if the reply has one, else its first word, normalized."""
    reply = reply.lower()
    match = _ANSWER.search(reply)
    if match:
        return normalize(match.group(1))
    words = reply.split()
    return normalize(words[0]) if words else ""


def image_message(image: Image.Image, text: str) -> Message:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


def ask(rng: random.Random, shapes: list[Shape], views: int) -> tuple[str, str]:
    """A (question, answer) pair about `shapes` that has exactly one correct one-word answer."""
    combos = Counter((s.colour, s.kind) for s in shapes)
    unique = [s for s in shapes if combos[(s.colour, s.kind)] == 1]
    kinds = ["count", "count_colour"] + (["where"] if unique else [])
    if views == 1:
        kinds += ["colour_of"] if unique else []
    question = rng.choice(kinds)
    scope = "in the image" if views == 1 else f"in all {views} views together"
    if question == "count":
        return f"How many shapes are there {scope}?", str(len(shapes))
    if question == "count_colour":
        colour = rng.choice(list(COLOURS))
        return f"How many {colour} shapes are there {scope}?", str(sum(s.colour == colour for s in shapes))
    target = rng.choice(unique)
    if question == "colour_of":
        return f"What colour is the {target.kind} at the {target.position}?", target.colour
    if views == 1:
        return f"Where is the {target.colour} {target.kind}?", target.position
    return f"Which view shows the {target.colour} {target.kind}? Answer with its number.", str(
        target.panel + 1
    )


class ShapesEpisode(Episode):
    def __init__(self, seed: int, image_size: int, max_shapes: int, reward: str) -> None:
        rng = random.Random(seed)
        self._shapes = random_panel(rng, 0, min_shapes=1, max_shapes=max_shapes)
        self._question, self.answer = ask(rng, self._shapes, views=1)
        self._image_size, self._reward = image_size, reward

    def start(self) -> list[Message]:
        image = draw(self._shapes, Box.panel(0), self._image_size)
        return [image_message(image, f"{self._question} Answer with one word.")]

    def step(self, reply: str) -> StepResult:
        return StepResult(reward=score(self._reward, reply, extract_answer(reply), self.answer), done=True)


class ShapesEnvironment(Environment):
    """One generated image of coloured shapes and one question about it."""

    def __init__(self, image_size: int = 112, max_shapes: int = 5, reward: str = "exact") -> None:
        if image_size < 28 or not 1 <= max_shapes <= GRID * GRID:
            raise ValueError(f"need image_size >= 28 and 1 <= max_shapes <= {GRID * GRID}")
        self.image_size, self.max_shapes, self.reward = image_size, max_shapes, check_reward_mode(reward)

    def episode(self, seed: int) -> ShapesEpisode:
        return ShapesEpisode(seed, self.image_size, self.max_shapes, self.reward)


class MultiTurnShapesEpisode(Episode):
    def __init__(self, seed: int, image_size: int, views: int, max_shapes: int, reward: str) -> None:
        rng = random.Random(seed)
        self._shapes = [
            s for v in range(views) for s in random_panel(rng, v, min_shapes=1, max_shapes=max_shapes)
        ]
        self._question, self.answer = ask(rng, self._shapes, views=views)
        self._views, self._image_size = views, image_size
        self._view, self._box = 0, Box.panel(0)
        self._reward, self._best = reward, 0.0

    def _show(self, text: str) -> Message:
        return image_message(draw(self._shapes, self._box, self._image_size), text)

    def start(self) -> list[Message]:
        instructions = (
            f"A scene of coloured shapes is split into {self._views} views; this is view 1. {self._question} "
            "Reply with one action: `next` (next view), `zoom`, "
            "`crop top-left|top-right|bottom-left|bottom-right`, or `answer <word>`."
        )
        return [self._show(instructions)]

    def step(self, reply: str) -> StepResult:
        action, argument = parse_action(reply)
        attempt = score(self._reward, reply, argument if action == "answer" else None, self.answer)
        reward, self._best = max(0.0, attempt - self._best), max(self._best, attempt)
        if action == "answer":
            return StepResult(reward=reward, done=True)
        if action == "zoom" and self._box.x1 - self._box.x0 > 1 / GRID:
            self._box, text = self._box.zoomed(), f"Zoomed in on view {self._view + 1}."
        elif action == "crop":
            assert argument is not None  # parse_action gives crop its quadrant
            self._box, text = self._box.quadrant(argument), f"The {argument} of the current image."
        elif action == "zoom":
            text = f"View {self._view + 1} is already at full zoom."
        else:
            self._view = (self._view + 1) % self._views
            self._box = Box.panel(self._view)
            prefix = "" if action == "next" else "No action recognised; "
            text = f"{prefix}View {self._view + 1} of {self._views}."
        return StepResult(reward=reward, done=False, messages=[self._show(text)])


def parse_action(reply: str) -> tuple[str, str | None]:
    """The first action in `reply`: (`answer`, word) | (`crop`, quadrant) | (`zoom`|`next`, None);
    (`none`, None) when the reply holds no action."""
    match = _ACTION.search(reply.lower())
    if match is None:
        return "none", None
    if match.group(1):
        return "answer", normalize(match.group(2))
    if match.group(3):
        return "crop", match.group(4)
    return ("zoom", None) if match.group(5) else ("next", None)


class MultiTurnShapesEnvironment(Environment):
    """A scene of `views` panels explored through actions; every action answers with a new image."""

    def __init__(
        self, image_size: int = 112, views: int = 3, max_shapes: int = 4, reward: str = "exact"
    ) -> None:
        if image_size < 28 or views < 1 or not 1 <= max_shapes <= GRID * GRID:
            raise ValueError(f"need image_size >= 28, views >= 1 and 1 <= max_shapes <= {GRID * GRID}")
        self.image_size, self.views, self.max_shapes = image_size, views, max_shapes
        self.reward = check_reward_mode(reward)

    def episode(self, seed: int) -> MultiTurnShapesEpisode:
        return MultiTurnShapesEpisode(seed, self.image_size, self.views, self.max_shapes, self.reward)


register_environment("shapes", ShapesEnvironment)
register_environment("shapes-multiturn", MultiTurnShapesEnvironment)
