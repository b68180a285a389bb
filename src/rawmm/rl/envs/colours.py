"""`colours`: name the colour of a flat image. The answer depends on the pixels alone, so the environment
measures whether a policy sees: a policy that ignores the image can do no better than the *blind
ceiling* 1/K (K colours, drawn uniformly and independently), and anything well above it must come from
the pixels.

With `turns > 1` every reply is answered with a NEW flat image of an independently drawn colour, and the
conversation keeps the earlier ones, so every request re-sends all earlier images (the materialize
cache's workload). Each turn pays 1/turns for the right colour, so a rollout earns its accuracy and the
blind ceiling stays 1/K for any number of turns.

The expected reply is the colour's name alone (`red`); `format_example` gives a well-formed reply with a
random colour, for a supervised warm-up on the format that leaves the policy at the blind ceiling. By default
a reply's first word is its answer; with `one_word` a reply of more than one word scores 0, as the question
asks for one word: the format then stays part of the reward (measured on the tiny learning run: scored on
the first word alone, the policy stopped ending its replies after the colour by step 10, `green green
green`, and the tokens after the answer, credited with its advantage, slowed learning to 0.62 at step 45).
"""

from __future__ import annotations

import random

from PIL import Image

from rawmm.rl.envs.base import Environment, Episode, Message, StepResult
from rawmm.rl.envs.registry import register_environment
from rawmm.rl.envs.scene import COLOURS

# The scene palette first (its words are in the tiny tokenizer's corpus), then more for K > 4.
PALETTE: dict[str, tuple[int, int, int]] = {
    **COLOURS,
    "purple": (130, 50, 170),
    "orange": (240, 130, 20),
    "black": (20, 20, 20),
    "white": (250, 250, 250),
}
CONSTANT_FILL = (128, 128, 128)  # the control's one image: no palette colour
_QUESTION = "What colour is this image? Answer with one word."
_NEXT = "And this one?"


def reply_words(reply: str) -> list[str]:
    """The reply's words, lower case, without surrounding punctuation (empty words dropped)."""
    words = (word.strip(".,;:!?\"'`()[]{}<>").lower() for word in reply.split())
    return [word for word in words if word]


def reply_colour(reply: str) -> str:
    """The reply's first word, lower case, without surrounding punctuation."""
    words = reply.split()
    return words[0].strip(".,;:!?\"'`()[]{}<>").lower() if words else ""


class ColoursEpisode(Episode):
    def __init__(
        self,
        seed: int,
        names: tuple[str, ...],
        image_size: int,
        turns: int,
        constant: bool,
        one_word: bool = False,
    ) -> None:
        rng = random.Random(seed)
        self.answers = [rng.choice(names) for _ in range(turns)]
        self._image_size, self._turn, self._constant = image_size, 0, constant
        self._one_word = one_word
        self._outcomes: list[tuple[str, float]] = []

    def _show(self, text: str) -> Message:
        fill = CONSTANT_FILL if self._constant else PALETTE[self.answers[self._turn]]
        image = Image.new("RGB", (self._image_size, self._image_size), fill)
        return {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
        }

    def start(self) -> list[Message]:
        return [self._show(_QUESTION)]

    def outcomes(self) -> list[tuple[str, float]]:
        return list(self._outcomes)

    def step(self, reply: str) -> StepResult:
        answer = self.answers[self._turn]
        if self._one_word:
            correct = float(reply_words(reply) == [answer])
        else:
            correct = float(reply_colour(reply) == answer)
        self._outcomes.append((answer, correct))
        reward = correct / len(self.answers)
        self._turn += 1
        if self._turn == len(self.answers):
            return StepResult(reward=reward, done=True)
        return StepResult(reward=reward, done=False, messages=[self._show(_NEXT)])


class ColoursEnvironment(Environment):
    """One flat image per turn, `colours` possible colours (K), `turns` turns; blind ceiling 1/K.

    `constant_image: true` is the control: every image is the same grey whatever the answer, so no policy
    can beat the blind ceiling (what a run learns beyond it must come from the pixels). `one_word: true`
    scores a reply only when it is the colour's name alone (module doc).
    """

    def __init__(
        self,
        colours: int = 4,
        image_size: int = 56,
        turns: int = 1,
        constant_image: bool = False,
        one_word: bool = False,
    ) -> None:
        if not 2 <= colours <= len(PALETTE) or image_size < 28 or turns < 1:
            raise ValueError(f"need 2 <= colours <= {len(PALETTE)}, image_size >= 28 and turns >= 1")
        self.names = tuple(PALETTE)[:colours]
        self.image_size, self.turns, self.constant_image = image_size, turns, constant_image
        self.one_word = one_word

    @property
    def blind_ceiling(self) -> float:
        """The best expected reward of a policy that ignores the pixels."""
        return 1.0 / len(self.names)

    def episode(self, seed: int) -> ColoursEpisode:
        return ColoursEpisode(
            seed, self.names, self.image_size, self.turns, self.constant_image, self.one_word
        )

    def format_example(self, rng: random.Random) -> str:
        """A well-formed reply with a colour drawn at random, whatever the image shows. With a leading space:
        byte-level BPE vocabularies (Qwen's, the tiny one's) hold ` red` as one token where `red` at the
        start of a reply may take several, so the answer is one decision of the policy."""
        return " " + rng.choice(self.names)


register_environment("colours", ColoursEnvironment)
