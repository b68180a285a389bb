"""Packed micro-batches must give each sample the logprobs it gets alone (tiny models, fp32)."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, LlamaConfig, LlamaForCausalLM

from rawmm.materialize import ForwardPolicy
from rawmm.rl.samples import Sample
from rawmm.rl.trainer.forward import forward_logprobs, sample_positions, sample_starts, token_logprobs
from rawmm.rl.trainer.packing import concat_samples

QWEN = ForwardPolicy(pass_position_ids=False, requires_mm_token_type_ids=True)
POSITION_IDS = ForwardPolicy(pass_position_ids=True, requires_mm_token_type_ids=False)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class Example:
    sample: Sample
    inputs: dict[str, torch.Tensor]  # the processor's output for this sample alone


def random_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def example(processor, text: str, images: list[Image.Image], sample_id: str) -> Example:
    inputs = processor(text=[text], images=images or None, return_mm_token_type_ids=True, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    n = len(ids)
    sample = Sample(
        token_ids=ids,
        mm_token_type_ids=inputs["mm_token_type_ids"][0].tolist(),
        loss_mask=[True] * n,
        advantages=[0.0] * n,
        logprobs=[0.0] * n,
        sample_id=sample_id,
    )
    return Example(sample, {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw")})


def alone_logprobs(model, ex: Example) -> torch.Tensor:
    ids = torch.tensor([ex.sample.token_ids])
    kwargs = dict(ex.inputs)
    if kwargs:
        kwargs["mm_token_type_ids"] = torch.tensor([ex.sample.mm_token_type_ids])
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
    return token_logprobs(logits, ids[0], [len(ids[0])])


def packed_kwargs(examples: list[Example]) -> dict[str, torch.Tensor]:
    with_images = [ex.inputs for ex in examples if ex.inputs]
    return {k: torch.cat([inputs[k] for inputs in with_images]) for k in ("pixel_values", "image_grid_thw")}


@pytest.fixture(scope="module", params=["tiny_qwen2_vl", "tiny_qwen3_vl"])
def model_and_processor(request):
    path = request.getfixturevalue(request.param)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path)


def test_packed_logprobs_equal_unpacked(model_and_processor):
    model, processor = model_and_processor
    examples = [
        example(processor, f"count the {IMAGE} shapes and answer three", [random_image(90, 60, 0)], "a"),
        example(processor, "a text only turn with no image at all", [], "b"),
        example(
            processor,
            f"first {IMAGE} then zoom {IMAGE} now answer",
            [random_image(64, 100, 1), random_image(120, 40, 2)],
            "c",
        ),
    ]
    packed = concat_samples([ex.sample for ex in examples])
    with torch.no_grad():
        got = forward_logprobs(model, packed, packed_kwargs(examples), QWEN)
        want = torch.cat([alone_logprobs(model, ex) for ex in examples])
        # The same stream without per-sample positions lets samples see each other: the test can fail.
        naive = model(
            input_ids=torch.tensor([packed.token_ids]),
            mm_token_type_ids=torch.tensor([packed.mm_token_type_ids]),
            use_cache=False,
            **packed_kwargs(examples),
        ).logits[0]
    assert got.shape == want.shape == (len(packed),)
    assert (got - want).abs().max().item() < 1e-4
    assert (token_logprobs(naive, torch.tensor(packed.token_ids), packed.seq_lens) - want).abs().max() > 1e-2


def test_position_ids_policy_packs_exactly():
    """Families that take position ids (Kimi's DeepSeek-style text model) get flat per-sample positions,
    from which transformers builds the block-diagonal mask. A tiny Llama stands in for that backbone."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(config).eval()
    lengths = [7, 3, 1, 5]
    samples = [
        Sample(
            token_ids=[(7 * i + j) % 64 for j in range(n)],
            mm_token_type_ids=[0] * n,
            loss_mask=[True] * n,
            advantages=[0.0] * n,
            logprobs=[0.0] * n,
        )
        for i, n in enumerate(lengths)
    ]
    packed = concat_samples(samples)
    with torch.no_grad():
        got = forward_logprobs(model, packed, {}, POSITION_IDS)
        want = torch.cat(
            [
                token_logprobs(
                    model(input_ids=torch.tensor([s.token_ids])).logits[0],
                    torch.tensor(s.token_ids),
                    [len(s)],
                )
                for s in samples
            ]
        )
    assert (got - want).abs().max().item() < 1e-4


def test_logprobs_are_zero_at_sample_starts_and_backpropagate(model_and_processor):
    model, processor = model_and_processor
    examples = [
        example(processor, f"look {IMAGE} ok", [random_image(56, 56, 3)], "a"),
        example(processor, "hi", [], "b"),
    ]
    packed = concat_samples([ex.sample for ex in examples])
    logprobs = forward_logprobs(model, packed, packed_kwargs(examples), QWEN)
    starts = sample_starts(packed.seq_lens)
    assert starts.nonzero().flatten().tolist() == [0, packed.seq_lens[0]]
    assert (logprobs[starts] == 0).all() and (logprobs[~starts] < 0).all()
    logprobs.sum().backward()
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_sample_positions_restart_per_sample():
    assert sample_positions([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]


def test_wanted_tokens_get_every_token_logprobs_and_gradients_from_their_logits_only(model_and_processor):
    """`wanted` (the trainer passes the loss mask): the lm_head runs on the positions that predict a wanted
    token only, and those tokens' logprobs and the gradients through them are the full forward's."""
    model, processor = model_and_processor
    examples = [
        example(processor, f"count the {IMAGE} shapes and answer three", [random_image(90, 60, 0)], "a"),
        example(processor, "a text only turn with no image at all", [], "b"),
    ]
    packed = concat_samples([ex.sample for ex in examples])
    wanted = torch.zeros(len(packed), dtype=torch.bool)
    wanted[[0, 3, 4, 9, packed.seq_lens[0], packed.seq_lens[0] + 2, len(packed) - 1]] = True
    keep = wanted & ~sample_starts(packed.seq_lens)  # a sample's first token has no logits to read
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    try:
        weights = torch.linspace(0.5, 1.5, len(packed))
        full = forward_logprobs(model, packed, packed_kwargs(examples), QWEN)
        (full * weights * keep).sum().backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        part = forward_logprobs(model, packed, packed_kwargs(examples), QWEN, wanted=wanted)
        (part * weights).sum().backward()
        got_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        # No wanted token (a lockstep filler): zeros that still backpropagate through every unit.
        none = forward_logprobs(model, packed, packed_kwargs(examples), QWEN, wanted=torch.zeros_like(wanted))
        none.sum().backward()
        model.zero_grad(set_to_none=True)
    finally:
        hook.remove()
    assert rows == [len(packed), int(keep.sum()), 0]
    assert (part[~keep] == 0).all() and (none == 0).all()
    assert (part[keep] - full[keep]).abs().max().item() < 1e-5
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, rtol=1e-4, atol=1e-6), name
