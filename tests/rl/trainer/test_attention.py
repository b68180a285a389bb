"""`rawmm_varlen` attention keeps every sample of a packed micro-batch to itself, as sdpa's mask does.

On CPU it runs its fallback (sdpa with the block-causal mask it derives from the position ids); on a GPU
the variable-length flash kernel. Either way packed logprobs equal each sample's alone.
"""

from __future__ import annotations

import pytest
import torch
from test_forward import IMAGE, QWEN, Example, alone_logprobs, example, packed_kwargs, random_image
from transformers import AutoModelForImageTextToText, AutoProcessor

from rawmm.rl.trainer import attention
from rawmm.rl.trainer.attention import block_causal_mask, register_varlen_attention, sample_bounds
from rawmm.rl.trainer.forward import forward_logprobs, token_logprobs
from rawmm.rl.trainer.packing import concat_samples


def test_sample_bounds_and_mask_follow_position_restarts():
    positions = torch.tensor([[0, 1, 2, 0, 0, 1]])
    bounds, longest = sample_bounds(positions)
    assert bounds.tolist() == [0, 3, 4, 6] and bounds.dtype == torch.int32 and longest == 3
    mask = block_causal_mask(positions)[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]


def batch(processor):
    examples = [
        example(processor, f"count the {IMAGE} shapes and answer three", [random_image(90, 60, 0)], "a"),
        example(processor, "a text only turn with no image at all", [], "b"),
        example(processor, f"first {IMAGE} then zoom {IMAGE} now", [random_image(64, 100, 1)] * 2, "c"),
    ]
    return examples, concat_samples([ex.sample for ex in examples])


@pytest.mark.parametrize("name", ["tiny_qwen2_vl", "tiny_qwen3_vl"])
def test_varlen_packed_logprobs_equal_unpacked(request, name):
    path = request.getfixturevalue(name)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    examples, packed = batch(processor)
    with torch.no_grad():
        want = torch.cat([alone_logprobs(model, ex) for ex in examples])
        model.set_attn_implementation(register_varlen_attention())
        assert model.config._attn_implementation == "rawmm_varlen"
        got = forward_logprobs(model, packed, packed_kwargs(examples), QWEN)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.gpu  # the variable-length flash kernel is CUDA's
@pytest.mark.parametrize("name", ["tiny_qwen2_vl", "tiny_qwen3_vl"])
def test_varlen_kernel_packed_equals_sdpa_unpacked_under_bf16_autocast(request, monkeypatch, name):
    """The flash kernel on the packed micro-batch against sdpa on each sample alone, both in bf16. The
    bound: bf16 keeps 8 significant bits, so two kernels that sum in different orders differ by a few
    units of 2^-8 on these logprobs (|logprob| < 7); a kernel that let samples see each other is off by
    0.2-0.5 on these samples (measured with the fp32 fallback's mask made plainly causal), and the same
    kernel told the whole row is one sample must exceed the bound, or the bound proves nothing."""
    path = request.getfixturevalue(name)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval().cuda()
    examples, packed = batch(processor)
    # The test's own tensors on the GPU: forward_logprobs takes image tensors on any device.
    cuda = {k: v.cuda() for k, v in packed_kwargs(examples).items()}
    alone = [Example(ex.sample, {k: v.cuda() for k, v in ex.inputs.items()}) for ex in examples]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = torch.cat([cuda_alone_logprobs(model, ex) for ex in alone])  # sdpa, no packing
        model.set_attn_implementation(register_varlen_attention())
        got = forward_logprobs(model, packed, cuda, QWEN).cpu()
        whole_row = len(packed)
        monkeypatch.setattr(
            attention,
            "sample_bounds",
            lambda positions: (
                torch.tensor([0, whole_row], dtype=torch.int32, device=positions.device),
                whole_row,
            ),
        )
        leaked = forward_logprobs(model, packed, cuda, QWEN).cpu()
    bound = 5e-2
    assert (got - want).abs().max().item() < bound, (got - want).abs().max().item()
    assert (leaked - want).abs().max().item() > bound, (leaked - want).abs().max().item()


def cuda_alone_logprobs(model, ex: Example) -> torch.Tensor:
    """`alone_logprobs` with the sample's tensors on the model's device; the result on the CPU."""
    ids = torch.tensor([ex.sample.token_ids], device="cuda")
    kwargs = dict(ex.inputs)
    if kwargs:
        kwargs["mm_token_type_ids"] = torch.tensor([ex.sample.mm_token_type_ids], device="cuda")
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
    return token_logprobs(logits, ids[0], [len(ids[0])]).cpu()
