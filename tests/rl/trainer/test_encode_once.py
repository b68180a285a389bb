"""Each distinct image of a micro-batch goes through the vision tower once, and the loss and every
gradient stay what encoding it once per placeholder span gives (fp32, tiny Qwen2-VL, Qwen3-VL, Kimi K2.5)."""

from __future__ import annotations

from pathlib import Path

import torch
from rollout_kit import random_image

from rawmm.contract import OffloadStore
from rawmm.materialize import load_processor
from rawmm.rl.orchestrator.rollout import PromptRenderer
from rawmm.rl.samples import completion_sample
from rawmm.rl.trainer.forward import encodes_images_once, forward_logprobs
from rawmm.rl.trainer.loss import policy_gradient_loss
from rawmm.rl.trainer.materializer import MaterializedMicroBatch, RawImageMaterializer
from rawmm.rl.trainer.packing import concat_samples


def micro_batch(
    model_dir: Path, preset: str, store: OffloadStore
) -> tuple[MaterializedMicroBatch, RawImageMaterializer]:
    """Three samples of a group sharing its prompt image `a`, one also showing `b`, and one text-only:
    5 placeholder spans of 2 distinct images."""
    renderer = PromptRenderer(model_dir, preset, "pil", store)
    a, b = random_image(84, 56, 1), random_image(56, 56, 2)

    def sample(images, reply: str, advantage: float, sample_id: str):
        content = [*({"type": "image", "image": im} for im in images), {"type": "text", "text": "what?"}]
        prompt = renderer.render(renderer.offload([{"role": "user", "content": content}]))
        tokens = renderer.tokenizer.encode(reply)
        return completion_sample(
            prompt, tokens, [-1.0] * len(tokens), advantage=advantage, sample_id=sample_id
        )

    samples = [
        sample([a], " a red circle", 1.0, "r0"),
        sample([a, b], " two blue", -1.0, "r1"),
        sample([a, b], " a star", 0.5, "r2"),
        sample([], " hello", 0.5, "text"),
    ]
    materializer = RawImageMaterializer(
        load_processor(model_dir, backend="pil"), roots=[store.root], missing_image_policy="error"
    )
    materializer.begin_step(1)
    return materializer.materialize(concat_samples(samples)), materializer


def loss_and_grads(
    model, m, materializer, *, once: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
    """The step's loss, every parameter's gradient, and the patch rows each vision-tower call saw."""
    patches: list[int] = []
    vision = model.get_encoder(modality="image")
    hook = vision.register_forward_pre_hook(lambda _, args: patches.append(args[0].shape[0]))
    kwargs, index = m.unique_mm_kwargs() if once else (m.mm_kwargs(), None)
    model.zero_grad(set_to_none=True)
    policy, normalizer = materializer.forward_policy, materializer.normalizer
    new = forward_logprobs(model, m.batch, kwargs, policy, normalizer=normalizer, image_index=index)
    mask = torch.tensor(m.batch.loss_mask)
    parts = policy_gradient_loss(
        new,
        torch.tensor(m.batch.logprobs),
        torch.tensor(m.batch.advantages),
        mask,
        clip_low=0.2,
        clip_high=0.28,
        step_tokens=int(mask.sum()),
    )
    parts.loss.backward()
    hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return parts.loss.detach(), grads, patches


def test_each_image_is_encoded_once_with_the_same_loss_and_gradients(family_model, tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir, preset = family_model
    m, materializer = micro_batch(model_dir, preset, OffloadStore(tmp_path / "images"))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    assert encodes_images_once(model)
    _, index = m.unique_mm_kwargs()
    assert index == (0, 0, 1, 0, 1)  # spans a | a b | a b

    loss_each, grads_each, patches_each = loss_and_grads(model, m, materializer, once=False)
    loss_once, grads_once, patches_once = loss_and_grads(model, m, materializer, once=True)

    grid = m.mm_kwargs()["image_grid_thw"].prod(-1).tolist()  # patches per span
    assert patches_each == [sum(grid)]
    assert patches_once == [grid[0] + grid[2]]  # a and b, once each
    torch.testing.assert_close(loss_once, loss_each, rtol=1e-5, atol=1e-7)
    assert grads_once.keys() == grads_each.keys()
    # the vision tower is trained through the repeated outputs
    assert any(p.grad is not None for p in model.get_encoder(modality="image").parameters())
    for name, grad in grads_each.items():
        torch.testing.assert_close(grads_once[name], grad, rtol=1e-4, atol=1e-6, msg=name)
