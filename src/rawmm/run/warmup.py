"""A supervised warm-up on an environment's answer *format*, for random-weight tiny checkpoints.

A random model never writes a well-formed answer, so every rollout of a group scores the same and RL has
no signal. Practitioners start RL from a model that already follows the format; here that model is the
tiny checkpoint after a few dozen steps of supervised fine-tuning on the environment's prompts with
*random* well-formed replies (`Environment.format_example`): the answers carry no information about the
images, so the policy starts at (or below) the environment's blind ceiling, and what RL gains beyond it
comes from the pixels.

Two choices keep the warm-up from teaching the model to ignore the pixels, which RL would have to undo
first (on `colours`, supervised training on the right answers then took 17 steps to 80% instead of
11 steps to 100% from the random model; RL stayed near the ceiling for 6 steps):

- every image is replaced by a flat grey one of the same size (same placeholder tokens): the format is
  learned with images in place, but no two images differ, so nothing rewards ignoring their differences;
- only the output layer and the final norm train (`TRAINED`): the format is a matter of which tokens come
  out, and the vision tower and decoder layers keep their image features as they were.

Prompts go through the checkpoint's own processor and chat template (the tokens `render_chat` gives the
engines, placeholders expanded by the same image processor); each example trains one reply of a
conversation of random length, so multi-turn environments learn the format of later turns too.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rawmm.rl.envs import Environment, Message

BLANK = (128, 128, 128)  # the warm-up's one image colour
TRAINED = ("lm_head", "model.language_model.norm")  # parameter name prefixes the warm-up trains (Qwen-VL)


class FormatEnvironment(Protocol):
    def format_example(self, rng: random.Random) -> str: ...


@dataclass(frozen=True)
class WarmupSettings:
    steps: int = 40
    batch_size: int = 8
    learning_rate: float = 1e-2
    seed: int = 0
    max_turns: int = 1  # the longest conversation an example may have (the run's orchestrator.max_turns)


def supports_format_warmup(environment: Environment) -> bool:
    return callable(getattr(environment, "format_example", None))


def format_warmup(model_dir: Path, environment: Environment, settings: WarmupSettings) -> list[float]:
    """Fine-tune the checkpoint in `model_dir` in place; returns the loss of every step."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if not supports_format_warmup(environment):
        raise ValueError(f"{type(environment).__name__} has no format_example: nothing to warm up on")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars for a 1 MB checkpoint are noise in the run's console
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    trained = [p for name, p in model.named_parameters() if name.startswith(TRAINED)]
    if not trained:
        raise ValueError(
            f"{type(model).__name__} has no parameters named {TRAINED}: no format warm-up for it"
        )
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in trained:
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=settings.learning_rate)
    # Cosine decay to zero: a constant rate this high leaves the last batch's answers imprinted.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / settings.steps))
    )
    rng = random.Random(settings.seed)
    end = processor.tokenizer.eos_token
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        for _ in range(settings.steps):
            examples = [_example(environment, rng, settings.max_turns) for _ in range(settings.batch_size)]
            loss = _batch_loss(model, processor, [(m, i, r + end) for m, i, r in examples])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
    model.save_pretrained(model_dir)
    return losses


Example = tuple[list[Message], list[Any], str]  # messages up to a user turn, their images, the reply


def _example(environment: Environment, rng: random.Random, max_turns: int) -> Example:
    """A conversation of 1..max_turns user turns with random well-formed replies; returns the messages up
    to the last user turn, their images, and the reply to train on."""
    example: FormatEnvironment = environment  # type: ignore[assignment]  # checked by supports_format_warmup
    episode = environment.episode(rng.randrange(2**31))
    messages: list[Message] = list(episode.start())
    for _ in range(rng.randrange(max_turns)):
        reply = example.format_example(rng)
        result = episode.step(reply)
        if result.done:
            break
        messages += [{"role": "assistant", "content": reply}, *result.messages]
    images = [part["image"] for m in messages if isinstance(m["content"], list) for part in m["content"]
              if part.get("type") == "image"]  # fmt: skip
    return messages, [_blank(image) for image in images], example.format_example(rng)


def _blank(image: Any) -> Any:
    """A flat grey image of `image`'s size: the same placeholder tokens, no information (module doc)."""
    from PIL import Image

    return Image.new("RGB", image.size, BLANK)


def _batch_loss(model: Any, processor: Any, examples: list[Example]) -> Any:
    """Mean cross-entropy of the replies' tokens, the prompts masked out, in one padded forward."""
    texts = [
        processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) + r
        for m, _, r in examples
    ]
    images = [image for _, example_images, _ in examples for image in example_images]
    processor.tokenizer.padding_side = "right"
    inputs = processor(text=texts, images=images or None, return_tensors="pt", padding=True)
    labels = inputs["input_ids"].clone()
    lengths = inputs["attention_mask"].sum(dim=1).tolist()
    for row, ((_, _, reply), length) in enumerate(zip(examples, lengths, strict=True)):
        # The template ends the prompt with a newline, where the tokenizer's pre-split always cuts: the
        # reply's tokens are the last len(tokens(reply)) of the row.
        reply_tokens = len(processor.tokenizer.encode(reply, add_special_tokens=False))
        labels[row, : length - reply_tokens] = -100
        labels[row, length:] = -100
    return model(**inputs, labels=labels).loss
