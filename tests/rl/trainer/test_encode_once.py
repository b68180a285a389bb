"""Each distinct image of a micro-batch goes through the vision tower once, and the loss and every
gradient stay what encoding it once per placeholder span gives (fp32, tiny Qwen2-VL, Qwen3-VL, Kimi K2.5)."""

from __future__ import annotations

import torch
from rollout_kit import loss_and_grads, shared_image_micro_batch

from rawmm.contract import OffloadStore
from rawmm.rl.trainer.forward import encodes_images_once


def test_each_image_is_encoded_once_with_the_same_loss_and_gradients(family_model, tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir, preset = family_model
    m, materializer = shared_image_micro_batch(model_dir, preset, OffloadStore(tmp_path / "images"))
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
