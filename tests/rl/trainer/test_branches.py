"""One sample per prefix-consistent branch scores every sampled token exactly as its per-turn sample does.

A multi-turn rollout is scripted (no engine): each turn renders the whole conversation with the tiny
model's own renderer, the "engine" replies with fixed text plus the end-of-turn token, and the next turn
adds a new image. Its merged samples (`branch_samples`) and its per-turn samples (`turn_samples`) are
materialized and forwarded by the trainer's own code, on tiny Qwen2-VL, Qwen3-VL and Kimi K2.5; every loss token must get the same logprob
(fp32 tolerance), with a chat template that re-renders earlier assistant turns as sent (every turn
merges) and one that re-renders some of them differently (those turns fork).
"""

from __future__ import annotations

import pytest
import torch
from rollout_kit import random_image

from rawmm.contract import OffloadStore
from rawmm.contract.engine_api import GenerateResponse
from rawmm.materialize import load_processor
from rawmm.rl.orchestrator.rollout import (
    PromptRenderer,
    Rollout,
    RolloutId,
    Turn,
    branch_samples,
    turn_samples,
)
from rawmm.rl.samples import Sample
from rawmm.rl.trainer.forward import forward_logprobs
from rawmm.rl.trainer.materializer import RawImageMaterializer
from rawmm.rl.trainer.packing import concat_samples

# Earlier assistant turns are re-rendered without their reasoning (the text before " so "), as reasoning
# models' templates drop it: a reply with " so " re-renders differently, one without re-renders as sent.
AS_SENT = "{% if message['content'] is string %}{{ message['content'] }}"
REASONING_DROPPED = "{% if message['content'] is string %}{{ message['content'].split(' so ')[-1] }}"


def scripted_rollout(renderer: PromptRenderer, replies: list[str], seed: int = 0) -> Rollout:
    """Turn t shows a new image; the engine replies `replies[t]` and ends its turn (<|im_end|>)."""
    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")  # both families end a turn with it
    rollout = Rollout(RolloutId(1, 0, seed))
    messages: list[dict] = []
    for t, reply in enumerate(replies):
        size = (56 + 14 * t, 56)
        text = "what now?" if t else "what is it?"
        user = {
            "role": "user",
            "content": [
                {"type": "image", "image": random_image(*size, seed * 10 + t)},
                {"type": "text", "text": text},
            ],
        }
        messages = [*messages, *renderer.offload([user])]
        prompt = renderer.render(messages)
        tokens = [*renderer.tokenizer.encode(reply), end]
        logprobs = [-0.1 * (i + 1) for i in range(len(tokens))]
        generation = GenerateResponse(
            token_ids=tokens, logprobs=logprobs, finish_reason="stop", weights_version=0
        )
        rollout.turns.append(Turn(prompt, generation, "replica-0"))
        messages.append({"role": "assistant", "content": reply})
    rollout.reward = 1.0
    return rollout


def scored(model, materializer: RawImageMaterializer, sample: Sample) -> torch.Tensor:
    """The trainer's logprobs of `sample`'s loss tokens, alone in its micro-batch."""
    materializer.begin_step(1)
    m = materializer.materialize(concat_samples([sample]))
    with torch.no_grad():
        logprobs = forward_logprobs(
            model, m.batch, m.mm_kwargs(), materializer.forward_policy, normalizer=materializer.normalizer
        )
    return logprobs[torch.tensor(sample.loss_mask)]


def trained(samples: list[Sample], key: str) -> list:
    return [value for s in samples for value, on in zip(getattr(s, key), s.loss_mask, strict=True) if on]


@pytest.mark.parametrize(
    ("template", "replies", "branches"),
    [
        (AS_SENT, ["a red circle", "blue", "two green stars", "yes"], [[0, 1, 2, 3]]),
        (REASONING_DROPPED, ["red so circle", "blue", "green so star", "yes"], [[0], [1, 2], [3]]),
    ],
    ids=["merges", "forks"],
)
def test_branch_samples_score_every_token_as_its_turn_sample(
    family_model, tmp_path, template, replies, branches
):
    from transformers import AutoModelForImageTextToText

    store = OffloadStore(tmp_path / "images")
    model_dir, preset = family_model
    renderer = PromptRenderer(model_dir, preset, "pil", store)
    assert AS_SENT in renderer.tokenizer.chat_template  # the tiny checkpoints' templates, Qwen's and Kimi's
    renderer.tokenizer.chat_template = renderer.tokenizer.chat_template.replace(AS_SENT, template)
    rollout = scripted_rollout(renderer, replies)
    per_turn = turn_samples(rollout, 0.5, renderer.placeholder_id)
    merged = branch_samples(rollout, 0.5, renderer.placeholder_id)

    # Branch k is named after its first turn and holds the turns of `branches[k]`, whole.
    assert [s.sample_id for s in merged] == [f"{rollout.id}-t{b[0]}" for b in branches]
    assert [len(s) for s in merged] == [len(per_turn[b[-1]]) for b in branches]
    assert [len(s.mm_refs) for s in merged] == [len(per_turn[b[-1]].mm_refs) for b in branches]
    # Loss on every sampled token, exactly once, with the engine's logprobs and the rollout's advantage.
    in_branch_order = [per_turn[t] for b in branches for t in b]
    for key in ("token_ids", "logprobs", "advantages"):
        assert trained(merged, key) == trained(in_branch_order, key)
    assert sum(map(len, merged)) < sum(map(len, per_turn))

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    materializer = RawImageMaterializer(
        load_processor(model_dir, backend="pil"), roots=[store.root], missing_image_policy="error"
    )
    turn_scores = torch.cat([scored(model, materializer, s) for s in in_branch_order])
    branch_scores = torch.cat([scored(model, materializer, s) for s in merged])
    assert turn_scores.shape == branch_scores.shape
    torch.testing.assert_close(branch_scores, turn_scores, rtol=0, atol=1e-5)
