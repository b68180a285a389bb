from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from rawmm.contract import OffloadStore, get_family, parse_features, parse_ref, render_chat

qwen = get_family("qwen_vl")
kimi = get_family("kimi_k25")


@cache
def load(checkpoint: Path, backend: str = "pil") -> tuple[Any, Any]:
    from transformers import AutoImageProcessor, AutoProcessor

    image_processor = AutoImageProcessor.from_pretrained(checkpoint, backend=backend)
    processor = AutoProcessor.from_pretrained(checkpoint, image_processor=image_processor)
    return processor, qwen.config_from_processor(image_processor)


def images() -> list[Image.Image]:
    return [
        Image.new("RGB", (123, 77), "red"),
        Image.new("RGB", (300, 40), "blue"),
        Image.new("RGB", (1, 1), "green"),
    ]


def multi_turn_chat(pictures: list[Image.Image]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image", "image": pictures[0]},
                {"type": "text", "text": " with "},
                {"type": "image", "image": pictures[1]},
            ],
        },
        {"role": "assistant", "content": "The first is red."},
        {
            "role": "user",
            "content": [{"type": "image", "image": pictures[2]}, {"type": "image", "image": pictures[0]}],
        },
    ]


def runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


@pytest.fixture(params=["tiny_qwen2_vl", "tiny_qwen3_vl"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_spans_agree_with_the_mask_and_the_real_processor(
    checkpoint: Path, offload_store: OffloadStore
) -> None:
    processor, config = load(checkpoint)
    tokenizer = processor.tokenizer
    pictures = images()
    messages = multi_turn_chat(pictures)
    before = copy.deepcopy(messages[0:3:2])
    rendered = render_chat(messages, tokenizer=tokenizer, family=qwen, config=config, store=offload_store)

    assert messages[0:3:2] == before
    spans = [(image.offset, image.length) for image in rendered.images]
    assert runs_of_ones(rendered.mm_token_type_ids) == spans
    pad, start, end = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    for offset, length in spans:
        assert set(rendered.token_ids[offset : offset + length]) == {pad}
        assert (rendered.token_ids[offset - 1], rendered.token_ids[offset + length]) == (start, end)
    assert rendered.token_ids.count(pad) == sum(length for _, length in spans)

    # The processor's own expansion of the same chat must give the very same ids and mask.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = processor(text=[text], images=[pictures[0], pictures[1], pictures[2], pictures[0]])
    assert rendered.token_ids == expected["input_ids"][0]
    assert rendered.mm_token_type_ids == expected["mm_token_type_ids"][0]

    # Descriptors: one per image, in order, pointing at the stored bytes, with this config's grid.
    hashes = [image.mm_hash for image in rendered.images]
    assert hashes[0] == hashes[3] and len(set(hashes)) == 3
    for image, picture in zip(
        rendered.images, [pictures[0], pictures[1], pictures[2], pictures[0]], strict=True
    ):
        layout = qwen.describe(width=picture.width, height=picture.height, config=config)
        assert image.descriptor.payload == {"image_grid_thw": [list(layout.grid_thw)]}
        assert offload_store.read_verified(image.descriptor.raw_image_uri, image.mm_hash)
        # No backend given: the family's default, the one vLLM's own Qwen-VL path runs.
        assert image.descriptor.fingerprint == qwen.fingerprint(config, "torchvision")


def test_rendered_prompt_runs_a_forward_pass_with_the_processors_pixels(
    checkpoint: Path, offload_store: OffloadStore
) -> None:
    from transformers import AutoModelForImageTextToText

    processor, config = load(checkpoint)
    pictures = images()
    rendered = render_chat(
        multi_turn_chat(pictures),
        tokenizer=processor.tokenizer,
        family=qwen,
        config=config,
        store=offload_store,
    )
    pixels = processor.image_processor(
        images=[pictures[0], pictures[1], pictures[2], pictures[0]], return_tensors="pt"
    )
    grids = [
        tuple(parse_ref(ref).payload["image_grid_thw"][0])
        for ref in rendered.features()["kwargs_data"]["image"]
    ]
    assert grids == [tuple(row) for row in pixels["image_grid_thw"].tolist()]

    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([rendered.token_ids]),
            mm_token_type_ids=torch.tensor([rendered.mm_token_type_ids]),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
        )
    assert out.logits.shape[:2] == (1, len(rendered.token_ids))
    assert torch.isfinite(out.logits).all()


def test_features_follow_the_request_format(tiny_qwen2_vl: Path, offload_store: OffloadStore) -> None:
    processor, config = load(tiny_qwen2_vl)
    rendered = render_chat(
        multi_turn_chat(images()),
        tokenizer=processor.tokenizer,
        family=qwen,
        config=config,
        store=offload_store,
    )
    features = rendered.features()
    assert set(features) == {"mm_hashes", "mm_placeholders", "kwargs_data"}
    assert features["mm_hashes"] == {"image": [image.mm_hash for image in rendered.images]}
    assert features["mm_placeholders"] == {
        "image": [{"offset": i.offset, "length": i.length} for i in rendered.images]
    }
    assert [parse_ref(ref).descriptor() for ref in features["kwargs_data"]["image"]] == [
        image.descriptor for image in rendered.images
    ]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    parsed = parse_features(features, token_ids=rendered.token_ids, placeholder_token_id=pad)
    assert [(p.offset, p.length, p.ref.mm_hash) for p in parsed] == [
        (i.offset, i.length, i.mm_hash) for i in rendered.images
    ]


def test_descriptors_carry_the_fingerprint_of_the_backend_passed(
    tiny_qwen3_vl: Path, offload_store: OffloadStore
) -> None:
    processor, config = load(tiny_qwen3_vl)
    chat = multi_turn_chat(images())
    by_backend = {
        backend: render_chat(
            chat,
            tokenizer=processor.tokenizer,
            family=qwen,
            config=config,
            store=offload_store,
            backend=backend,
        )
        for backend in ("pil", "torchvision")
    }
    assert by_backend["pil"].token_ids == by_backend["torchvision"].token_ids
    for backend, rendered in by_backend.items():
        assert {image.descriptor.fingerprint for image in rendered.images} == {
            qwen.fingerprint(config, backend)
        }
    with pytest.raises(ValueError, match="backend"):
        render_chat(
            chat,
            tokenizer=processor.tokenizer,
            family=qwen,
            config=config,
            store=offload_store,
            backend="cv2",
        )


def test_generation_prompt_is_optional(tiny_qwen2_vl: Path, offload_store: OffloadStore) -> None:
    processor, config = load(tiny_qwen2_vl)
    chat = multi_turn_chat(images())
    with_prompt = render_chat(
        chat, tokenizer=processor.tokenizer, family=qwen, config=config, store=offload_store
    )
    without = render_chat(
        chat,
        tokenizer=processor.tokenizer,
        family=qwen,
        config=config,
        store=offload_store,
        add_generation_prompt=False,
    )
    suffix = processor.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert with_prompt.token_ids == without.token_ids + suffix


def test_a_literal_image_marker_in_text_is_refused(tiny_qwen2_vl: Path, offload_store: OffloadStore) -> None:
    processor, config = load(tiny_qwen2_vl)
    chat = [{"role": "user", "content": [{"type": "text", "text": "sneaky <|image_pad|>"}]}]
    with pytest.raises(ValueError, match=r"rendered 1 <\|image_pad\|> tokens for 0 images"):
        render_chat(chat, tokenizer=processor.tokenizer, family=qwen, config=config, store=offload_store)


KIMI_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}{{ '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>' }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endfor %}"
)


def kimi_like_tokenizer() -> Any:
    from rawmm.run.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    extra = ["<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>", "<|im_user|>"]
    tokenizer.add_special_tokens({"extra_special_tokens": extra}, replace_extra_special_tokens=False)
    tokenizer.chat_template = KIMI_TEMPLATE
    return tokenizer


def test_kimi_expands_each_media_pad_to_one_per_vision_token_under_vision_chunk(
    offload_store: OffloadStore,
) -> None:
    tokenizer = kimi_like_tokenizer()
    config = kimi.preset("kimi_k25")
    pictures = images()
    rendered = render_chat(
        multi_turn_chat(pictures), tokenizer=tokenizer, family=kimi, config=config, store=offload_store
    )
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    # The template wrote one <|media_pad|> per image; the prompt holds what the processors expand it to.
    grids = [kimi.grid_from_payload(image.descriptor.payload) for image in rendered.images]
    tokens = [t * h * w // config.merge_size**2 for t, h, w in grids]
    assert [image.length for image in rendered.images] == tokens and max(tokens) > 1
    for image in rendered.images:
        assert rendered.token_ids[image.offset : image.offset + image.length] == [pad] * image.length
    assert runs_of_ones(rendered.mm_token_type_ids) == [(i.offset, i.length) for i in rendered.images]
    features = rendered.features()
    assert set(features["kwargs_data"]) == {"vision_chunk"}
    first = parse_ref(features["kwargs_data"]["vision_chunk"][0])
    layout = kimi.describe(width=123, height=77, config=config)
    assert first.payload == {"grid_thws": [list(layout.grid_thw)]}
    assert first.descriptor().engine_modality == "vision_chunk"
    parse_features(features, token_ids=rendered.token_ids, placeholder_token_id=pad)


def test_a_tokenizer_without_the_family_placeholder_is_refused(
    tiny_qwen2_vl: Path, offload_store: OffloadStore
) -> None:
    processor, _ = load(tiny_qwen2_vl)
    with pytest.raises(ValueError, match=r"no <\|media_pad\|> token"):
        render_chat(
            multi_turn_chat(images()),
            tokenizer=processor.tokenizer,
            family=kimi,
            config=kimi.preset("kimi_k25"),
            store=offload_store,
        )
