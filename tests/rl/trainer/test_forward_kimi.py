"""Kimi K2.5 packs with plain position ids (no M-RoPE): a packed micro-batch of the tiny Kimi model gives
each sample the logprobs it gets alone, images and MoE layer included (fp32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from rawmm.materialize import get_adapter
from rawmm.rl.samples import Sample
from rawmm.rl.trainer.forward import forward_logprobs, token_logprobs
from rawmm.rl.trainer.packing import concat_samples
from rawmm.run.tiny import build_tiny_model

IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
POLICY = get_adapter("kimi_k25").forward_policy


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("kimi_k25", tmp_path_factory.mktemp("tiny") / "kimi_k25", seed=0)


def random_image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def example(processor, text: str, images: list[Image.Image], sample_id: str):  # type: ignore[no-untyped-def]
    """A sample as transformers' own Kimi processor expands it, and its image kwargs alone."""
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    pad = processor.tokenizer.convert_tokens_to_ids("<|media_pad|>")
    n = len(ids)
    sample = Sample(
        token_ids=ids,
        mm_token_type_ids=[int(t == pad) for t in ids],
        loss_mask=[True] * n,
        advantages=[0.0] * n,
        logprobs=[0.0] * n,
        sample_id=sample_id,
    )
    return sample, {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}


def test_packed_logprobs_equal_unpacked_with_position_ids(tiny_kimi: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_kimi, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tiny_kimi)
    assert POLICY.pass_position_ids and not POLICY.requires_mm_token_type_ids
    examples = [
        example(processor, f"count the {IMAGE} shapes and answer three", [random_image(90, 60, 0)], "a"),
        example(processor, "a text only turn with no image at all", [], "b"),
        example(
            processor,
            f"first {IMAGE} then {IMAGE} answer",
            [random_image(64, 100, 1), random_image(120, 40, 2)],
            "c",
        ),
    ]
    assert sum(s.mm_token_type_ids.count(1) for s, _ in examples) > 3  # one pad per vision token, expanded
    packed = concat_samples([sample for sample, _ in examples])
    with_images = [inputs for _, inputs in examples if inputs]
    mm_kwargs = {
        k: torch.cat([inputs[k] for inputs in with_images]) for k in ("pixel_values", "image_grid_thw")
    }
    with torch.no_grad():
        got = forward_logprobs(model, packed, mm_kwargs, POLICY)
        want = torch.cat(
            [
                token_logprobs(
                    model(input_ids=torch.tensor([s.token_ids]), use_cache=False, **inputs).logits[0],
                    torch.tensor(s.token_ids),
                    [len(s.token_ids)],
                )
                for s, inputs in examples
            ]
        )
        # Without per-sample positions the samples see each other: the comparison can fail.
        naive = model(input_ids=torch.tensor([packed.token_ids]), use_cache=False, **mm_kwargs).logits[0]
    assert got.shape == want.shape == (len(packed.token_ids),)
    assert (got - want).abs().max().item() < 1e-4
    assert (token_logprobs(naive, torch.tensor(packed.token_ids), packed.seq_lens) - want).abs().max() > 1e-2
